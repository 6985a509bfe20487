"""The per-chip report, regenerated from a results file alone: report.md, report.html, figures/.

Both renderings come from one list of blocks, so the markdown and the HTML say the same thing.
The HTML is self-contained (figures embedded as data URIs). Files are written to a temporary
folder and moved into place at the end, so an interrupted report never replaces a complete one.
"""

from __future__ import annotations

import base64
import html
import shutil
import tempfile
from pathlib import Path

from mac_moesd.analysis import fit as fit_module
from mac_moesd.reporting import pair_sections, plots
from mac_moesd.reporting.cluster_section import cluster_blocks
from mac_moesd.reporting.serving_section import draw as draw_serving, serving_blocks
from mac_moesd.analysis import expert_reads, round_terms, spec_runs, theory, verdict
from mac_moesd.analysis.digest import VERIFY_WINDOW, Digest
from mac_moesd.results import parse_point_key
from mac_moesd.reporting.formatting import (ROUND_HEADER, invalid_lines, lookup_lines, measured_speedup, plain_vs_sweep,
                                             newer_fit_note, precision_note, predicted_cells, kv_lines, one_row_lines,
                                             pipelining_lines, rollback_cell, roofline_shrunk_line, round_cell,
                                             routing_sentence, throttled_lines, Block)
from mac_moesd.reporting.numbers import f2, pct, seconds

__all__ = ["build_blocks", "write_report"]

TYPICAL_ALPHA = theory.DEFAULT_ALPHA


# ---- sections ----


def _title(d: Digest) -> list[Block]:
    m = d.meta
    backend = m.get("backend", "?")
    blocks: list[Block]
    blocks = [("h1", f"mac-moesd report: {m.get('chip', 'unknown machine')}"), *pair_sections.first_lines(d)]
    blas, threads = m.get("blas", {}).get("name", "?"), m.get("blas", {}).get("threads")
    if threads:
        blas += f" ({threads} thread{'s' if threads > 1 else ''})"
    versions = m.get("versions", {})
    line = (f"Backend **{backend}**, BLAS {blas}, {m.get('os', '')}; measured {m.get('time', '?')} "
            f"with mac-moesd {versions.get('mac_moesd')}, MLX {versions.get('mlx')}, "
            f"mlx-lm {versions.get('mlx_lm')}.")
    blocks.append(("p", line))
    if backend != "metal":
        blocks.append(("note", "These numbers come from MLX's " + backend.upper() + " backend, not an "
                       "Apple-silicon GPU. They show what the suite produces; the figures describe "
                       "this machine only."))
    for what, why in d.data.get("skipped", {}).items():
        blocks.append(("note", f"Skipped {what}: {why}"))
    blocks += [("note", line) for line in throttled_lines(d.data)]
    missing = [s for s in ("roofline", "sweeps", "routing", "fits") if not d.data.get(s)]
    if missing:
        blocks.append(("note", "INCOMPLETE: no " + ", ".join(missing) + " in the results; the "
                       "sections that need them are left out."))
    return blocks


def _best_gamma(fit: dict, alpha: float) -> dict:
    """The fit's stored batch-1 prediction row of the best gamma at ``alpha``."""
    rows = {p["gamma"]: p for p in fit["predictions"] if p["batch"] == 1 and p["alpha"] == alpha}
    best = theory.best_gamma(lambda g: rows[g]["speedup"] if g in rows else None, tuple(sorted(rows)))
    assert best is not None, "a drafted fit predicts batch 1 at each of its alphas"
    return rows[best[0]]


def _verdict(d: Digest) -> list[Block]:
    # A pair's target has its own verdict, at the acceptance measured on its prompts.
    fits = [f for f in d.fits if f["model"] not in {p["target"] for p in d.pairs}]
    if d.pairs and not fits:
        return []
    blocks: list[Block] = [("h2", "Verdict: is speculative decoding worth it here?")]
    if not fits:
        return blocks + [("p", "No fit yet: run `mac-moesd run` (or `sweep` with `--draft`, then `fit`).")]
    roof = d.roofline
    for fit in fits:
        rho = fit["top_k"] / fit["experts"]
        threshold = theory.saturation_threshold(rho)
        drafter = f"drafter {fit['draft_model']}" if fit["drafted"] else "no drafter measured"
        blocks.append(("h3", f"{fit['model']} (E = {fit['experts']}, K = {fit['top_k']}), {drafter}"))
        if not fit["drafted"]:
            eff = {p["gamma"]: p["target_efficiency"] for p in fit["predictions"] if p["batch"] == 1}
            blocks.append(("p", "No verdict on speedup: " + "; ".join(fit["missing"]) + ". What the "
                           "target alone says: at batch 1 a verify window of gamma+1 tokens costs "
                           + ", ".join(f"{1 / eff[g]:.2f}x a plain step at gamma={g}"
                                       for g in (1, 2, 4) if g in eff)
                           + f" (`{fit['chosen']}` expert loads)."))
            continue
        alphas = sorted({p["alpha"] for p in fit["predictions"]})
        at1 = {(p["gamma"], p["alpha"]): p["speedup"] for p in fit["predictions"] if p["batch"] == 1}
        best = _best_gamma(fit, TYPICAL_ALPHA)
        peak = next(p for p in fit["peaks"] if p["gamma"] == best["gamma"] and p["alpha"] == TYPICAL_ALPHA)
        worth = "pays off" if best["speedup"] > 1.0 else "does not pay off"
        window = best["gamma"] + 1
        lead = _measured_lead(d, fit)
        if lead:
            blocks.append(("p", lead))
        label = "Prediction" if lead else "Prediction (no SD run of this model was timed)"
        text = (f"{label}: at batch 1 and acceptance {TYPICAL_ALPHA}, SD {worth}: best gamma = {best['gamma']} "
                f"with a predicted speedup of {f2(best['speedup'])}. For that gamma SD peaks at batch "
                f"{peak['peak_batch']} ({f2(peak['peak_speedup'])}), within peak/sqrt(2) for batches "
                f"{peak['window'][0]}-{peak['window'][1]}. A batch-1 step routes 1 token "
                f"({fit['top_k']} of {fit['experts']} experts); its verify window of {window} tokens "
                f"(gamma drafts plus one) activates {_window_experts(fit, window)} and makes "
                f"{window * fit['top_k']} token-expert pairs, against MoESD's batch "
                f"threshold of {threshold} tokens. "
                + (f"Predictions use the `{fit['chosen']}` expert loads, which fit this chip better than "
                   "MoESD's `unique` (see the fitted model; `unique` is shown beside)."
                   if fit["chosen"] != "unique" else
                   "Predictions use MoESD's own `unique` expert loads, which fit this chip best of the "
                   "three variants (see the fitted model)."))
        model = d.model(fit["model"])
        if roof and model:
            ridge_tokens = theory.ridge_in_tokens(roof["ridge_flop_per_byte"], model.weight_format)
            text += (f" The ridge in tokens for its {model.weight_format} weights is "
                     f"{ridge_tokens:.1f}: beyond that a forward is compute-bound.")
        text += (f" SD breaks even at acceptance {f2(best['break_even_alpha'])} at this gamma, and with a drafter "
                 f"step up to {f2(best['break_even_draft_ratio'])} of a plain step at acceptance {TYPICAL_ALPHA}."
                 if best.get("break_even_alpha") is not None and best.get("break_even_draft_ratio") is not None
                 else "")
        blocks.append(("p", text))
        unique = {(r["gamma"], r["alpha"]): r["unique"] for r in fit["paper_comparison"]}
        beside = fit["chosen"] != "unique"  # MoESD's own loads shown next to the chosen ones
        rows = [[str(g)] + [f2(at1[(g, a)]) for a in alphas] + ([f2(unique[(g, TYPICAL_ALPHA)])] if beside else [])
                for g in sorted({g for g, _ in at1})]
        blocks.append(("table", ["gamma", *[f"S at alpha={a:g}" for a in alphas]]
                       + ([f"MoESD `unique`, alpha={TYPICAL_ALPHA:g}"] if beside else []), rows))
    return blocks


def _measured_lead(d: Digest, fit: dict) -> str:
    """The verdict's first sentences where SD of this model was timed at batch 1: the measured
    speedups with their CIs, the best, and whether the fitted model agrees with each (inside the
    CI widened by its held-out error); where it does not, the part of the round it prices furthest
    from the SD stage's own timing of it. Empty where nothing was timed."""
    model = fit_module.FittedModel.from_document(fit)
    found = [(r, doc) for doc in d.spec if doc.get("target") == fit["model"]
             for r in spec_runs.valid_runs(doc.get("runs", [])) if r["batch"] == 1 and r.get("measured_speedup")]
    if not found:
        return ""
    best, _ = max(found, key=lambda x: x[0]["measured_speedup"])
    imposed = sorted({r["alpha"] for r, _ in found if r.get("mode") == "emulated-acceptance"})
    # Prompt lookup solves no alpha (its proposals vary in length).
    realised = [a for r, _ in found if (a := fit_module.run_alpha(r)) is not None]
    span = f"{min(realised):.2f}-{max(realised):.2f}" if realised else "n/a"
    how = (f"acceptance imposed at {', '.join(f'{a:.2f}' for a in imposed)}, realised {span}" if imposed else
           f"acceptance measured {span}")
    worth = "pays off" if best["measured_speedup"] > 1.0 else "does not pay off"
    parts, off = [], []
    for r, doc in sorted(found, key=lambda x: x[0]["gamma"]):
        prediction = fit_module.model_prediction(fit, r, doc)
        if prediction.shown is None:
            continue
        check = verdict.agreement(r, prediction.shown, fit.get("heldout_mape"))
        said = (f"predicted {f2(prediction.stored)} when timed, {f2(prediction.now)} by the current fit"
                if prediction.now is not None and prediction.stored is not None
                else f"predicted {f2(prediction.shown)}")
        parts.append(f"gamma {r['gamma']} measured {measured_speedup(r)}, {said} "
                     f"({'agrees' if check['agrees'] else 'disagrees'})")
        if not check["agrees"]:
            term = verdict.differing_term(model, r, fit_module.run_context(r, doc), fit_module.run_alpha(r))
            off.append(f"at gamma {r['gamma']} the model's {term['term']} is {term['model_over_measured']:.2f}x "
                       "the SD stage's own timing of it" if term else
                       f"at gamma {r['gamma']} the run predates the timing of its round's parts")
    text = (f"**Measured at batch 1** ({how}): SD {worth} here, best timed gamma {best['gamma']} at "
            f"{measured_speedup(best)}. Against the fitted model: " + "; ".join(parts) + ".")
    if off:
        text += (" **The measurement and the model disagree**: " + "; ".join(off) + ". Trust the "
                 "measurement at these points; the model remains the what-if engine below.")
    return text


def _window_experts(fit: dict, window: int) -> str:
    """Unique experts a batch-1 verify window activates: as the sweep's routing did (counted, or
    the fitted correlation between counts), beside uniform routing's N(window)."""
    E, K = fit["experts"], fit["top_k"]
    uniform = float(theory.activated_experts(window, E, K))
    routing = expert_reads.Routing.from_dict(fit.get("routing"))
    if not routing.counts:
        return f"{uniform:.1f} experts under uniform routing"
    how = "counted" if (1, window) in routing.counts else f"fitted c = {routing.correlation:.2f}"
    return (f"{float(routing.unique(1, window, E, K)):.1f} experts as the sweep's routing did ({how}; "
            f"{uniform:.1f} under uniform routing)")


def _roofline(d: Digest, figures: dict[str, Path]) -> list[Block]:
    roof = d.roofline
    if not roof:
        return []
    bw, fl = roof["bandwidth_gbs"], roof["flops_tflops"]
    rows = [[k, f"{v:.1f} GB/s"] for k, v in bw.items()] + [[k, f"{v * 1e3:.3g} GFLOP/s"] for k, v in fl.items()]
    text = (f"Ridge point: **{roof['ridge_flop_per_byte']:.1f} FLOP/byte** ({roof['ridge_dtype']} peak over the "
            f"{roof['bandwidth_ceiling_gbs']:.1f} GB/s {roof['bandwidth_ceiling_source']} ceiling); in tokens per "
            "forward: " + ", ".join(f"{k} {v:.1f}" for k, v in roof["ridge_tokens"].items()) + ". "
            f"Bandwidth kernels: {roof['kernels']['note']}.")
    knees = ", ".join(f"{b}-bit {v:.1f}" for b, v in roof["qmm_knee_tokens"].items() if v)
    if knees:
        text += f" Knee of the quantized-matmul curve (tokens): {knees}."
    frac = roof.get("fraction_of_spec")
    if frac:
        text += f" Measured bandwidth is {pct(frac['bandwidth'])} of the published spec."
    blocks: list[Block] = [("h2", "Roofline"), ("p", text), ("table", ["measure", "value"], rows)]
    shrunk = roofline_shrunk_line(roof.get("shrunk"))
    if shrunk:
        blocks.insert(2, ("note", shrunk))
    return blocks + _figure(figures, "roofline", "Measured roofline; circles: batch-1 decode, squares: a "
                            f"{VERIFY_WINDOW}-token verify window, for each swept model.")


def _shape(d: Digest, figures: dict[str, Path]) -> list[Block]:
    models = [m for m in d.models if m.points]
    if not models:
        return []
    blocks: list[Block] = [("h2", "Two-factor shape: what a t-token forward costs")]
    rows = []
    for m in models:
        for b in m.batches:
            ts, rs = m.ratio_curve(b)
            rows.append([m.name, str(b)] + [f"{r:.2f}" for r in rs])
    width = max(len(r) for r in rows)
    tokens = models[0].tokens
    headers = ["model", "B"] + [f"t={t}" for t in tokens][: width - 2]
    blocks.append(("table", headers, [r + [""] * (width - len(r)) for r in rows]))
    blocks += _figure(figures, "ratio", "T_T(B,t)/T_T(B,1): MoE models climb with t as each token "
                      "loads more experts; the dense control stays flat while memory-bound.")
    blocks += _figure(figures, "efficiency", "Measured target efficiency T_T(B,1)/T_T(B,gamma+1).")
    return blocks


def _routing(d: Digest, figures: dict[str, Path]) -> list[Block]:
    if not d.routing:
        return []
    blocks: list[Block] = [("h2", "Activated experts")]
    rows = []
    for r in d.routing:
        rows.append([r["model"], r["text"], f"{r['correlation']:.3f}", f"{r['batch_correlation']:.3f}",
                     str(r["threshold_uniform"]), str(r["threshold_corrected"])])
    blocks.append(("table", ["model", "tokens from", "c (one sequence)", "c (across sequences)",
                             "MoESD batch threshold", "within-sequence threshold"], rows))
    blocks.append(("p", "Correlation is fitted in the anchored form N(1 + c(t-1)) (one token always "
                   "activates K experts). MoESD's batch threshold counts independent tokens under uniform "
                   "routing; the within-sequence threshold counts consecutive tokens of one sequence at "
                   "the fitted c. A verify window of B sequences mixes both."))
    return blocks + _figure(figures, "routing", "Unique experts per layer, measured against uniform N(t).")


def _gather_gains(views: list, window: int) -> list[str]:
    """For each routing measured with both gathers: what sorting every gather does to a verify window."""
    lines = []
    for plain in (v for v in views if v.gather == "mlx-lm"):
        rival = next((v for v in views if v.gather == "sorted" and v.routing == plain.routing), None)
        if rival is None:
            continue
        for b in plain.batches:
            ts = [t for t in (window, *reversed(plain.tokens)) if t > 1 and plain.median(b, t)
                  and rival.median(b, t) and plain.median(b, 1) and rival.median(b, 1)]
            if not ts:
                continue
            t = ts[0]
            a, s = plain.median(b, t), rival.median(b, t)
            lines.append(f"routing {plain.routing}, B={b}: a {t}-token forward costs "
                         f"{a / plain.median(b, 1):.2f}x a one-token step with mlx-lm's gather and "
                         f"{s / rival.median(b, 1):.2f}x with every gather sorted ({seconds(a)} against "
                         f"{seconds(s)}: sorted is {a / s:.2f}x as fast)")
    return lines


def _what_ifs(d: Digest, figures: dict[str, Path]) -> list[Block]:
    groups = [(m, d.what_ifs(m)) for m in d.models if d.what_ifs(m)]
    if not groups:
        return []
    blocks: list[Block]
    blocks = [("h2", "What-ifs: forced routing and sorted gather"),
              ("p", "The same model swept with its experts chosen otherwise (`sweep --routing`: uniform, "
                    "MoESD's assumption; correlated:C, t consecutive tokens activating N(1 + C(t-1)); a "
                    "replayed trace of a real model; the router itself still runs) or with mlx-lm's sorted "
                    "expert gather forced at every size (`sweep --gather sorted`; mlx-lm sorts only from 64 "
                    "indices). Unique experts per MoE layer as the forwards ran them are in brackets.")]
    if d.meta.get("backend", "metal") != "metal":
        blocks.append(("note", "On MLX's CPU backend gather_mm reads an expert once per (token, expert) "
                       "pair whether or not the pairs are sorted, so the sorted gather gains little here; on "
                       "Metal the sorted kernel reads each unique expert once."))
    for primary, others in groups:
        views = [primary, *others]
        tokens = sorted({t for v in views for t in v.tokens})
        rows = []
        for v in views:
            for b in v.batches:
                cells = []
                for t in tokens:
                    m, u = v.median(b, t), v.unique_experts(b, t)
                    cells.append("-" if m is None else seconds(m) + ("" if u is None else f" [{u:.1f}]"))
                rows.append([v.routing, v.gather, str(b), *cells])
        blocks.append(("h3", f"{primary.name} ({primary.weight_format}, context {primary.full['context']})"))
        blocks.append(("table", ["routing", "gather", "B", *[f"T_T(B,{t})" for t in tokens]], rows))
        gains = _gather_gains(views, VERIFY_WINDOW)
        if gains:
            blocks.append(("p", "If every expert were gathered once per unique expert: " + "; ".join(gains) + "."))
    return blocks + _figure(figures, "what_if", "T_T(B,t) under each measured routing (colour) and gather "
                            "(solid: mlx-lm's, dashed: sorted at every size).")


def _fit(d: Digest, figures: dict[str, Path]) -> list[Block]:
    if not d.fits and not d.stale_fits:
        return []
    blocks: list[Block] = [("h2", "The fitted MoESD model")]
    for name in d.stale_fits:
        blocks.append(("note", f"The stored fit of {name} predates the expert-load variants; rerun "
                       "`mac-moesd fit` on this results file."))
    for f in d.fits:
        w = f["worst_point"]
        p = f["params"]
        blocks.append(("h3", f["model"]))
        held, every = len(f["heldout_points"]), len(f["train_points"])
        blocks.append(("p", f"Held-out MAPE **{pct(f['heldout_mape'])}** over {held} points, from a fit to "
                       f"the other {every - held}; worst B={w['batch']} t={w['tokens']} at {w['error']:+.1%}. "
                       f"The parameters below are refitted on all {every}. {routing_sentence(f)} "
                       f"Knee of G at **{f['knee_tokens']:.1f} tokens** per forward "
                       + (f"(lam = {p['lam']:.3g} of the {f['ridge_tokens']:.1f}-token ridge for "
                          f"{f['weight_format']} weights; ridge from the {f['ridge_source']}). "
                          if f["ridge_flop_per_byte"] is not None else
                          f"(lam = {p['lam']:.3g} of the grid's largest n, {f['ridge_tokens']:g} tokens: "
                          f"{f['ridge_source']}). ")
                       + "mlx-lm sorts "
                       f"(token, expert) pairs from n*K >= {f['sort_threshold']}, n >= "
                       f"{f['sorted_from_tokens']} tokens here ({f['sort_threshold_source']})."))
        lam_lo, lam_hi = f["bounds"]["lam"]
        if min(p["lam"] - lam_lo, lam_hi - p["lam"]) < 1e-3 * lam_hi:
            side = "lower" if p["lam"] - lam_lo < lam_hi - p["lam"] else "upper"
            blocks.append(("note", f"lam sits on its {side} bound: the grid puts the knee "
                           f"{'at or below' if side == 'lower' else 'at or above'} "
                           f"{f['knee_tokens']:.1f} tokens, and the fit cannot place it more precisely."))
        rows = [[v["name"], pct(v["heldout_mape"]) if v["heldout_mape"] is not None else "-",
                 f"{v['knee_tokens']:.1f}", "chosen" if v["name"] == f["chosen"] else ""]
                for v in f["variants"]]
        blocks.append(("table", ["expert loads", "held-out MAPE", "knee (tokens)", ""], rows))
        blocks.append(("p", "Regime: " + f["regime"] + " `unique` reads each activated expert once "
                       "(MoESD's Algorithm 1, k2*N(n)); `pairs` once per token-expert pair (k2*n*K); "
                       "`mlx` switches from pairs to unique at mlx-lm's sort threshold."))
        blocks += [("p", line[0].upper() + line[1:] + ".")
                   for line in pipelining_lines(f.get("pipelining")) + one_row_lines(f) + kv_lines(f)
                   + _recurrence_lines(f) + _bookkeeping_lines(f) + _draft_start_lines(f)]
        rows = [[k, "-" if v is None else f"{v:.4g}"] for k, v in p.items()] + [
            ["k_kv", f"{f['k_kv']:.4g}"], ["k_seq", f"{f.get('k_seq', 0.0):.4g}"],
            *([["k_rec", f"{f['k_rec']:.4g}"]] if f.get("linear_layers") else [])]
        blocks.append(("table", ["parameter", f"value (`{f['chosen']}`)"], rows))
        for line in f["missing"]:
            blocks.append(("note", line))
        if f["paper_comparison"]:
            beside = f["chosen"] != "unique"
            rows = [[str(r["gamma"]), f2(r["chosen"])] + ([f2(r["unique"])] if beside else [])
                    + [f2(r["unique_paper_verify"])]
                    for r in f["paper_comparison"] if r["alpha"] == TYPICAL_ALPHA]
            blocks.append(("p", f"Against the paper: predicted batch-1 speedup at alpha = {TYPICAL_ALPHA} with "
                           "the chosen loads and gamma+1 verify tokens (what the loops and mlx-lm run)"
                           + (", with MoESD's `unique` loads," if beside else ",")
                           + " and with `unique` loads and the paper's convention of a gamma-token verify "
                           "forward (MoESD's S(B, gamma) counts gamma verify tokens)."))
            blocks.append(("table", ["gamma", f"`{f['chosen']}`, gamma+1"]
                           + (["`unique`, gamma+1"] if beside else []) + ["`unique`, gamma (paper)"], rows))
    blocks += _figure(figures, "fit", "Fitted model (chosen expert loads) against measurement (x: held out).")
    blocks += _figure(figures, "speedup", "Predicted speedup against batch; dotted lines mark "
                      "B*(gamma+1) = T_thres; shading: the gamma=4 window within peak/sqrt(2).")
    return blocks


def _bookkeeping_lines(f: dict) -> list[str]:
    """The fit's term for the SD loop's own work a round, and its share of a batch-1 round."""
    return _round_term_lines(f, "bookkeeping", lambda book: (
        f"the SD loop's own work a round besides its forwards (the token choice, the one "
        f"synchronisation, the acceptance decision: an empty round the sweep timed at {book['points']} "
        f"batches) is T_book(B) = {book['a_s'] * 1e3:.3f} ms + {book['b_s'] * 1e3:.4f} ms x B "
        f"(MAPE {pct(book['mape'])}), priced in every predicted round"), lambda model, cost: cost.bookkeeping)


def _draft_start_lines(f: dict) -> list[str]:
    """The fit's term for the drafter's start after a verify, and its share of a batch-1 round."""
    return _round_term_lines(f, "draft_start", lambda start: (
        f"the drafter's chain right after the target's verify, as a round runs it, costs beyond its fitted "
        f"steps (chains the sweep timed after a verify, {start['points']} of them) "
        f"T_start(B, gamma) = {start['a_s'] * 1e3:.3f} ms + {start['b_s'] * 1e3:.4f} ms x B + "
        f"{start.get('c_s', 0.0) * 1e3:.3f} ms x (gamma - 1) (MAPE {pct(start['mape'])} of a chain), "
        f"priced in every predicted round"), lambda model, cost: float(round_terms.seconds(model.draft_start, 1, 4)))


def _round_term_lines(f: dict, key: str, describe, part) -> list[str]:
    """A fitted term a round (``round_terms``), as ``describe(term)`` words it, with its share of
    a batch-1 round; none where the sweep timed nothing for it."""
    term = f.get(key) or {}
    if not term.get("points"):
        return []
    return [describe(term) + _batch_one_share(f, part)]


def _batch_one_share(f: dict, part) -> str:
    """": N% of a batch-1 round at gamma 4" for the seconds ``part(model, cost)`` of that round
    (``verdict.round_cost``); nothing where the fit has no drafter to price a round with."""
    model = fit_module.FittedModel.from_document(f)
    if not model.drafted:
        return ""
    cost = verdict.round_cost(model, 1, 4, f["context"], TYPICAL_ALPHA)
    return f": {part(model, cost) / cost.round:.0%} of a batch-1 round at gamma 4, alpha {TYPICAL_ALPHA}"


def _recurrence_lines(f: dict) -> list[str]:
    """A hybrid's fitted recurrent term, and its share of a batch-1 verify of gamma 4."""
    if not f.get("linear_layers"):
        return []
    model = fit_module.FittedModel.from_document(f)
    layers, tokens = f["linear_layers"], 5
    verify = float(model.target(1, tokens, f["context"]))
    share = f["k_rec"] * layers * tokens / verify
    return [f"the {layers} recurrent layers' sequential state update is k_rec = {f['k_rec'] * 1e6:.1f} us per "
            f"token per layer, whatever the batch: {share:.0%} of a batch-1 verify of {tokens} tokens"]


def _questions(d: Digest) -> list[Block]:
    blocks: list[Block] = [("h2", "Answers")]
    items = []
    moe = [m for m in d.models if m.experts and m.points]
    dense = [m for m in d.models if not m.experts and m.points]
    if moe:
        m = moe[0]
        b = max(m.batches)
        bs, es = m.efficiency_curve(VERIFY_WINDOW)
        if bs:
            effs = dict(zip(bs, es))
            line = (f"Two-factor shape: for {m.name} at the largest measured batch B={b}, verifying "
                    f"{VERIFY_WINDOW} tokens (gamma = {VERIFY_WINDOW - 1}) costs {1 / effs[max(bs)]:.2f}x "
                    "a plain step")
            if dense and dense[0].efficiency_curve(VERIFY_WINDOW)[0]:
                dbs, des = dense[0].efficiency_curve(VERIFY_WINDOW)
                line += f", against {1 / des[-1]:.2f}x for the dense {dense[0].name} at B={dbs[-1]}"
            fit = d.fit_of(m.name)
            if fit:
                eff = {p["batch"]: p["target_efficiency"] for p in fit["predictions"]
                       if p["gamma"] == VERIFY_WINDOW - 1 and p["alpha"] == TYPICAL_ALPHA}
                line += ("; the fit predicts target efficiency " +
                         ", ".join(f"{eff[bb]:.2f} at B={bb}" for bb in (8, 16, 32) if bb in eff))
            items.append(line + " (figures: ratio, efficiency).")
    gamma = VERIFY_WINDOW - 1
    for r in d.routing:
        saturated = [s for s in r["saturation"] if s["saturated"] and s["gamma"] == gamma]
        first = min((s["batch"] for s in saturated), default=None)
        where = (f"from B={first} agents (gamma={gamma}, {VERIFY_WINDOW}-token verify windows) the "
                 "experts saturate" if first else
                 f"no measured batch saturates the experts at gamma={gamma}")
        items.append(f"Multi-agent saturation for {r['model']} ({r['text']}): MoESD's batch threshold is "
                     f"{r['threshold_uniform']} independent tokens; consecutive tokens of one sequence "
                     f"(c = {r['correlation']:.2f}) saturate only after {r['threshold_corrected']} "
                     f"(the within-sequence threshold); {where} (figure: routing).")
    if d.roofline:
        roof = d.roofline
        items.append(f"Ridge point: {roof['ridge_flop_per_byte']:.1f} FLOP/byte, so a 4-bit model turns "
                     f"compute-bound at about {roof['ridge_tokens']['4bit']:.1f} tokens per forward "
                     "(figure: roofline).")
    return blocks + [("list", items)] if items else []


def _spec(d: Digest) -> list[Block]:
    own = [id(doc) for p in d.pairs for doc in d.pair_spec(p).values()]  # shown with their pair
    docs = [s for s in d.spec if id(s) not in own]
    if not docs:
        return []
    blocks: list[Block] = [("h2", "Measured speculative decoding")]
    for s in docs:
        fitted = d.fit_of(s["target"], s["draft"])
        rows, predictions = [], []
        for r in s["runs"]:
            pred = fit_module.model_prediction(fitted, r, s)
            predictions.append(pred)
            rows.append([str(r["batch"]), str(r["gamma"]), str(r["gamma"] + 1),
                         "-" if r["alpha"] is None else f"{r['alpha']:.2f}", r["mode"],
                         f"{r['tokens_per_s_plain']:.1f}", f"{r['tokens_per_s_sd']:.1f}",
                         measured_speedup(r), *predicted_cells(r, pred), plain_vs_sweep(r),
                         round_cell(r), rollback_cell(r)])
        how = ("the fitted model's at each run's realised alpha and context, as this stage stored it with "
               "the run" + (f" (the fit now in these results: `{fitted['chosen']}` expert loads)"
                            if fitted and "chosen" in fitted else ""))
        blocks.append(("p", f"{s['target']} with drafter {s['draft']}, context {s['context']}, "
                       f"{s['new_tokens']} tokens per sequence; each verify forward has gamma+1 tokens. "
                       + precision_note(s["runs"]) + " Two predictions stand beside each measurement: "
                       "from the forwards this stage timed beside its pairs (the round's parts on the same "
                       f"prompt and caches, priced as the loop runs them), and {how}. In emulated-acceptance "
                       "runs alpha is imposed (the table's), and the draws scatter around it; predictions "
                       "use the alpha each run realised, solved from its mean accepted draft tokens per "
                       "round. Plain vs sweep: this stage's plain step over the sweep's, flagged beyond "
                       "15% (the machine's speed changed between the two stages). The round's timed parts "
                       "include the rollback of rejected drafts, priced by how often a round rejects; the "
                       "rollback column says how the caches went back and whether the audit against plain "
                       "decoding passed (docs/design.md §4.7)."))
        blocks.append(("table", ["B", "gamma", "verify tokens", "alpha", "mode", "plain tok/s", "SD tok/s",
                                 "measured S", "predicted (timed parts)", "error", "predicted (fit)", "error",
                                 "plain vs sweep", ROUND_HEADER, "rollback"], rows))
        blocks += [("p", note) for note in newer_fit_note(predictions)]
        lookup = lookup_lines(s)
        if lookup:
            blocks += [("p", lookup[0] + "."), ("list", [line.strip() for line in lookup[1:]])]
        blocks += [("p", f"**{line}**") for line in invalid_lines(s)]
    return blocks


def _method(d: Digest) -> list[Block]:
    rows, pipelined, steps = [], [], set()
    for m in d.models:
        pipe, sync = m.pipelined.get((1, 1)), m.median(1, 1)
        steps |= {p["steps"] for p in m.pipelined.values() if "steps" in p}
        if pipe and sync:
            pipelined.append(f"{m.name} {seconds(pipe['median_s'])} pipelined against {seconds(sync)} "
                             "synchronous")
        med, worst, repeats = m.cv_stats()
        drift = [e["drift"] for e in m.entries if e.get("drift")]
        flagged = any(x["flagged"] for x in drift)
        layers = "/".join(str(e["layers"]) for e in m.entries)
        rows.append([m.name, m.weight_format, str(m.full["context"]), f"{layers} of {m.full['layers_full']}"
                     + (" (extrapolated)" if m.extrapolated else ""), str(repeats), pct(med), pct(worst),
                     ("FLAGGED " if flagged else "ok ") + ", ".join(f"{x['change']:+.1%}" for x in drift)])
    blocks: list[Block]
    blocks = [("h2", "Method"),
              ("p", "Each point: warm-up, then rounds in shuffled order until the median's 95% CI is "
                    "within 1% or the time budget ends; every call forced with mx.eval on logits and "
                    "KV cache; cache rolled back and checked after each call; the first point "
                    "re-measured at the end to detect drift (flagged above 3%). Modes of measured SD "
                    "runs are labelled (emulated acceptance is drawn, not produced by a drafter).")]
    if rows:
        blocks.append(("table", ["model", "format", "context", "layers measured", "repeats",
                                 "median CV", "worst CV", "drift"], rows))
    if pipelined:
        blocks.append(("p", "Every point is timed two ways, interleaved: synchronously (one forward, graph "
                       "construction included: what a verify forward whose tokens are read back costs) and "
                       f"pipelined (chains of {'/'.join(map(str, sorted(steps))) or 'several'} forwards, each built while the previous one runs, as "
                       "mlx-lm generates: what a decode step costs). Predictions use the pipelined time for "
                       "plain decode and drafter steps, and the synchronous one where a loop waits. "
                       "Batch-1 decode step: " + "; ".join(pipelined) + "."))
    return blocks


def _figure(figures: dict[str, Path], name: str, caption: str) -> list[Block]:
    return [("figure", name, caption)] if name in figures else []


def build_blocks(data: dict, figures: dict[str, Path]) -> list[Block]:
    d = Digest(data)
    return (_title(d) + pair_sections.pair_blocks(d, figures) + _verdict(d) + cluster_blocks(d)
            + _questions(d) + _roofline(d, figures) + _shape(d, figures) + _routing(d, figures)
            + _what_ifs(d, figures) + _fit(d, figures) + _spec(d) + serving_blocks(data, figures) + _method(d))


# ---- renderings ----


def to_markdown(blocks: list[Block]) -> str:
    out = []
    for block in blocks:
        if block[0] in ("h1", "h2", "h3"):
            out.append("#" * int(block[0][1]) + " " + block[1])
        elif block[0] == "p":
            out.append(block[1])
        elif block[0] == "note":
            out.append("> " + block[1])
        elif block[0] == "list":
            out.append("\n".join(f"{i}. {item}" for i, item in enumerate(block[1], 1)))
        elif block[0] == "table":
            headers, rows = block[1], block[2]
            lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
            lines += ["| " + " | ".join(r) + " |" for r in rows]
            out.append("\n".join(lines))
        elif block[0] == "figure":
            out.append(f"![{block[2]}](figures/{block[1]}.png)\n\n*{block[2]}*")
    return "\n\n".join(out) + "\n"


def _inline(text: str) -> str:
    escaped = html.escape(text)
    parts = escaped.split("**")
    return "".join(f"<b>{p}</b>" if i % 2 else p for i, p in enumerate(parts))


CSS = ("body{font-family:-apple-system,Helvetica,Arial,sans-serif;max-width:980px;margin:2em auto;"
       "padding:0 1em;color:#222}table{border-collapse:collapse;margin:1em 0;font-size:14px}"
       "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}th{background:#f3f3f3}"
       "img{max-width:100%}.note{background:#fff6d5;padding:.6em 1em;border-left:4px solid #e0b000}"
       "figcaption{font-style:italic;font-size:13px;color:#555}")


def to_html(blocks: list[Block], figures: dict[str, Path]) -> str:
    body = []
    for block in blocks:
        if block[0] in ("h1", "h2", "h3"):
            body.append(f"<{block[0]}>{_inline(block[1])}</{block[0]}>")
        elif block[0] == "p":
            body.append(f"<p>{_inline(block[1])}</p>")
        elif block[0] == "note":
            body.append(f"<p class='note'>{_inline(block[1])}</p>")
        elif block[0] == "list":
            body.append("<ol>" + "".join(f"<li>{_inline(item)}</li>" for item in block[1]) + "</ol>")
        elif block[0] == "table":
            head = "".join(f"<th>{html.escape(h)}</th>" for h in block[1])
            rows = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in block[2])
            body.append(f"<table><tr>{head}</tr>{rows}</table>")
        elif block[0] == "figure":
            data = base64.b64encode(figures[block[1]].read_bytes()).decode()
            body.append(f"<figure><img alt='{html.escape(block[2])}' src='data:image/png;base64,{data}'>"
                        f"<figcaption>{html.escape(block[2])}</figcaption></figure>")
    title = html.escape(blocks[0][1]) if blocks and blocks[0][0] == "h1" else "mac-moesd report"
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{title}</title>"
            f"<style>{CSS}</style></head><body>{''.join(body)}</body></html>\n")


def sweep_csv(data: dict) -> str:
    lines = ["model,dtype,bits,context,layers,layers_full,batch,tokens,median_s,iqr_s,cv,repeats,"
             "routing,gather,unique_experts,pairs"]
    for e in data.get("sweeps", {}).values():
        for key, m in sorted(e["points"].items()):
            b, t = parse_point_key(key)
            routing = e.get("routing", "model")
            if "," in routing or '"' in routing:  # a trace path: one CSV field
                routing = '"' + routing.replace('"', '""') + '"'
            lines.append(f"{e['model']},{e['dtype']},{e['bits'] or ''},{e['context']},{e['layers']},"
                         f"{e['layers_full']},{b},{t},{m['median_s']!r},{m['iqr_s']!r},{m['cv']!r},{m['repeats']},"
                         f"{routing},{e.get('gather', 'mlx-lm')},{m.get('unique_experts', '')},{m.get('pairs', '')}")
    return "\n".join(lines) + "\n"


def write_report(data: dict, folder: Path) -> dict[str, Path]:
    """Write report.md, report.html, figures/*.png and sweep.csv into ``folder`` atomically."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".report-", dir=folder))
    try:
        figures = plots.draw_all(Digest(data), staging / "figures")
        figures.update(draw_serving(data, staging / "figures"))
        blocks = build_blocks(data, figures)
        (staging / "report.md").write_text(to_markdown(blocks))
        (staging / "report.html").write_text(to_html(blocks, figures))
        (staging / "sweep.csv").write_text(sweep_csv(data))
        if (folder / "figures").exists():
            shutil.rmtree(folder / "figures")
        (staging / "figures").rename(folder / "figures")
        for name in ("report.md", "report.html", "sweep.csv"):
            (staging / name).replace(folder / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {"markdown": folder / "report.md", "html": folder / "report.html",
            "figures": folder / "figures", "csv": folder / "sweep.csv"}

