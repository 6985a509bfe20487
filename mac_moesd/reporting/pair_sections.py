"""The report's sections for a pair of the user's own (`run --target --draft`): what was measured,
the verdict, acceptance per prompt set and temperature, measured against predicted speedup, and
routing on the prompts. Blocks as ``report.py`` renders them (markdown and HTML from one list)."""

from __future__ import annotations

from pathlib import Path

from mac_moesd.analysis import fit as fit_module
from mac_moesd.analysis import spec_runs, theory, verdict
from mac_moesd.analysis.digest import Digest, weight_format
from mac_moesd.reporting.formatting import (ROUND_HEADER, Block, by_position, invalid_lines, measured_speedup,
                                             newer_fit_note, plain_vs_sweep, precision_note, predicted_cells, rollback_cell,
                                             round_cell)
from mac_moesd.results import keys
from mac_moesd.units import human_bytes

__all__ = ["first_lines", "pair_blocks"]


def first_lines(d: Digest) -> list[Block]:
    """What the report is about, before anything else: the user's pair, or why random weights."""
    blocks: list[Block] = []
    for p in d.pairs:
        kind = p.get("drafter_kind", "model")
        drafter = p["draft"] if kind == "model" else KIND_NAMES[kind]
        weights = {"model": "real weights as stored", "prompt-lookup": "the target's real weights as stored",
                   "mtp-head": "the target's weights as stored, the head's random (acceptance imposed)"}[kind]
        blocks.append(("note", f"Your pair: target **{p['target']}** with drafter **{drafter}** "
                       f"({p['found']}), {weights}; SD measured on the prompt sets "
                       f"{', '.join(p['prompt_sets'])} at temperatures "
                       f"{', '.join(f'{t:g}' for t in p['temperatures'])}."))
    search = d.pair_search
    if search and search["target"] is None and not d.pairs:
        reasons = "; ".join(f"{k}: {v}" for k, v in search["passed_over"].items())
        blocks.append(("note", "RANDOM WEIGHTS: no known MoE/drafter pair in the Hugging Face cache at "
                       f"{search['cache']} could be measured ({reasons}). Timing is real; acceptance is "
                       "emulated, not produced by a drafter. Measure a pair of your own with "
                       "`mac-moesd run --target MODEL --draft MODEL`."))
    return blocks


def _params(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def _format(run: str, p: dict, role: str) -> str:
    """The format a model ran in, and the checkpoint's own when they differ (MLX's CPU backend
    runs float16 checkpoints in float32: its gather_mm supports float32 only)."""
    stored = p.get("stored", {}).get(role)
    return run if stored in (None, run) else f"{run} (stored {stored})"


def _measured(d: Digest, p: dict) -> list[Block]:
    rows = []
    target = d.model(p["target"])
    if target is not None:
        fp = target.footprint
        rows.append(["target", p["target"], p["target_arg"], _format(target.weight_format, p, "target"),
                     f"{fp['experts']} experts, top-{fp['top_k']}", str(target.full["layers_full"]),
                     f"{_params(fp['params_total'])} ({_params(fp['params_active'])} active)",
                     human_bytes(fp["bytes_total"], places=2)])
    draft = d.draft_entry(p["draft"], p["context"])
    if draft is not None:
        fp = draft["footprint"]
        rows.append(["drafter", p["draft"], p["draft_arg"], _format(weight_format(draft), p, "draft"), "dense",
                     str(draft["layers_full"]), _params(fp["params_total"]), human_bytes(fp["bytes_total"], places=2)])
    blocks: list[Block] = [("h3", "What was measured")]
    if rows:
        blocks.append(("table", ["role", "model", "from", "format", "experts", "layers", "parameters",
                                 "weights"], rows))
    blocks.append(("p", f"Prompt sets: {', '.join(_prompt_sets(d, p))}; temperatures "
                   f"{', '.join(f'{t:g}' for t in p['temperatures'])}; SD at batches "
                   f"{', '.join(map(str, p['spec_batches']))} with gamma "
                   f"{', '.join(map(str, p['spec_gammas']))} {_engines(p)}; the target's sweep at context "
                   f"{p['context']} {_sweep_routing(p)}."))
    return blocks


def _engines(p: dict) -> str:
    """Which loop ran SD at which batch, by the pair's kind of drafter."""
    if p.get("drafter_kind") == "prompt-lookup":
        return ("(every batch with the suite's loop, drafted by prompt lookup from each sequence's own "
                "context: mlx-lm has no prompt lookup)")
    if p.get("drafter_kind") == "mtp-head":
        return ("(every batch with the suite's loop, drafted by an emulated MTP head on the target: one of "
                "its decoder layers fed its last hidden state, with the target's LM head; acceptance imposed)")
    return ("(batch 1 with mlx-lm's `speculative_generate_step` against its `generate_step`, larger "
            "batches with the suite's loop driven by the drafter)")


def _sweep_routing(p: dict) -> str:
    """Which routing the target's sweep timed (runs that did not record it swept random ids)."""
    r = p.get("sweep_routing")
    if r is None:
        return ("over random token ids (timing depends on the routing the ids cause; the routing on "
                "your prompts is measured below)")
    if r["key"] == "model":
        return f"over random token ids under the target's own routing, not the prompts' ({r['why']})"
    spans = ("" if r["spans_per_sequence"] == 1 else f"; its largest batch takes up to "
             f"{r['spans_per_sequence']} disjoint spans of one prompt")
    return (f"with the prompts' routing, replayed from {r['trace']} (the experts the target chose on "
            f"{', '.join(r['prompt_sets'])}: {r['sequences']} sequences of {r['length']} tokens{spans}; "
            "the router still runs), so the grid and the SD runs share one routing")


def _prompt_sets(d: Digest, p: dict) -> list[str]:
    """Each prompt set with its size and encoding, where its SD run recorded them."""
    out = []
    for prompt_set in p["prompt_sets"]:
        info = (d.pair_spec(p).get(prompt_set) or {}).get("prompts") or {}
        if info.get("count"):
            out.append(f"{prompt_set} ({info['count']} prompts of {info['tokens'][0]}-{info['tokens'][1]} "
                       f"tokens, {info['encoding']})")
        else:
            out.append(prompt_set)
    return out


def _routing(d: Digest, p: dict) -> list[Block]:
    docs = {s: r for s in p["prompt_sets"] for r in d.routing
            if r["model"] == p["target"] and r["text"] == keys.prompt_set_text(s)}
    if not docs:
        return []
    rows = []
    for prompt_set, r in docs.items():
        rows.append([prompt_set, f"{r['sequences']} x {r['length']}", r["token_ids"],
                     f"{r['correlation']:.3f}", f"{r['batch_correlation']:.3f}",
                     str(r["threshold_corrected"]), str(r["threshold_uniform"]),
                     f"traces/{Path(r['trace']).name}" if r.get("trace") else "-"])
    any_doc = next(iter(docs.values()))
    rho = theory.sparsity(any_doc["experts"], any_doc["top_k"])
    return [("h3", "Routing on your prompts"),
            ("table", ["prompt set", "sequences x tokens", "token ids", "c (one sequence)",
                       "c (across sequences)", "within-sequence threshold", "MoESD batch threshold",
                       "trace"], rows),
            ("p", f"Each prompt is one sequence, routed through the target with its own tokenizer "
                  "(the prompt's text, without the chat template, whose fixed tokens would open every "
                  "sequence alike). c is fitted in the anchored form N(1 + c(t-1)): 1 is uniform "
                  f"routing, smaller means consecutive tokens reuse experts. With E = {any_doc['experts']} "
                  f"and K = {any_doc['top_k']} (rho = {rho:.3g}), the within-sequence threshold is where "
                  "one sequence's consecutive tokens reach tau*E experts; MoESD's batch threshold counts "
                  "independent tokens. The traces, beside results.json, hold the captured indices "
                  "for routing-controlled sweeps (`sweep --routing trace:FILE`).")]


def _why_not(row: dict) -> str:
    why, gamma = row["deciding"], row["gamma"]
    without = why["speedup_without"][why["term"]]
    if why["term"] == "drafter cost":
        steps = "1 drafter step takes" if gamma == 1 else f"{gamma} drafter steps take"
        return (f"the drafter's cost: {steps} {why['round_share']['drafter']:.0%} of a "
                f"round (one costs {why['draft_step_over_plain']:.2f}x a target step); with a free drafter "
                f"S would be {without:.2f}")
    if why["term"] == "verify cost":
        return (f"the verify cost: the {gamma + 1}-token verify forward costs {why['verify_over_plain']:.2f}x "
                f"a one-token step; at the price of one step S would be {without:.2f}")
    return (f"acceptance: alpha = {row['alpha']:.2f} yields {why['tokens_per_round']:.2f} tokens per "
            f"round of {gamma + 1}; with every draft accepted S would be {without:.2f}")


def _worth(run: dict) -> str:
    """Whether a measured speedup pays off, judged by its CI where it has one."""
    answer = verdict.measured_answer(run)
    return "SD breaks about even (its CI spans 1)" if answer == "breaks even" else f"SD {answer}"


def _break_even(row: dict) -> str:
    alpha, ratio = row.get("break_even_alpha"), row.get("break_even_draft_ratio")
    if alpha is None and ratio is None:
        return " Not even every draft accepted would pay at this gamma."
    parts = []
    if alpha is not None:
        parts.append(f"SD breaks even at acceptance {alpha:.2f} at this gamma (measured {row['alpha']:.2f})")
    if ratio is not None:
        parts.append(f"with a drafter step up to {ratio:.2f} of a plain step at the measured acceptance")
    return " " + ", and ".join(parts) + "."


def _verdict_line(prompt_set: str, row: dict, run: dict | None) -> str:
    """One verdict sentence at batch 1: the measurement first where the recommended configuration
    was timed (``run``), with the prediction beside it and whether they agree; else the
    prediction, labelled as such."""
    where = f"On {prompt_set} at temperature {row['temperature']:g}"
    predicted = f"predicted {row['predicted_speedup']:.2f} at alpha {row['alpha']:.2f}"
    why = "" if row["pays_off"] else f" The model's deciding term is {_why_not(row)}."
    if run is None:
        return (f"{where}: prediction only (gamma {row['gamma']} was not timed): SD "
                f"{'pays off' if row['pays_off'] else 'does not pay off'} with best gamma {row['gamma']}, "
                f"{predicted}.{why}{_break_even(row)}")
    text = (f"{where}: **measured at batch 1 with gamma = {row['gamma']}: {_worth(run)}**, "
            f"{measured_speedup(run)}; the fitted model {predicted} "
            f"({'agrees' if row['agrees'] else 'disagrees'}).")
    differs = row.get("differs_most")
    if not row["agrees"] and differs:
        text += (f" The model and the measurement differ most in the {differs['term']}: the model's is "
                 f"{differs['model_over_measured']:.2f}x the SD stage's own timing of it.")
    return text + why + _break_even(row)


def _no_verdict(missing: str) -> Block:
    return ("p", f"No verdict: {missing} is missing (the skipped stages above say why); rerun the same "
                 "command to retry them.")


def _lookup_verdict(p: dict, docs: dict[str, dict]) -> list[Block]:
    """The verdict of prompt lookup, from its timed runs (``verdict.lookup_rows``)."""
    blocks: list[Block] = [("h3", "Verdict for prompt lookup")]
    if not docs:
        return blocks + [_no_verdict("measured SD on the prompt sets")]
    batches = tuple(sorted({1, max(p["spec_batches"])}))
    rows, lines = [], []
    for prompt_set, doc in docs.items():
        for row in verdict.lookup_rows(doc["runs"], prompt_set, batches):
            run, needed = row["run"], row["break_even_accepted"]
            rows.append([prompt_set, f"{row['temperature']:g}", str(row["batch"]), str(row["gamma"]),
                         measured_speedup(run), row["answer"],
                         "-" if row["predicted_speedup"] is None else f"{row['predicted_speedup']:.2f}",
                         f"{row['proposal_rate']:.0%}", f"{row['mean_accepted']:.2f}",
                         "-" if needed is None else f"{needed:.2f}"])
            if row["batch"] == 1:
                lines.append(f"On {prompt_set} at temperature {row['temperature']:g}: **measured at batch 1, "
                             f"proposals of up to {row['gamma']} tokens: {_worth(run)}**, {measured_speedup(run)}; "
                             f"a proposal in {row['proposal_rate']:.0%} of rounds, {row['mean_accepted']:.2f} "
                             "draft tokens accepted per round"
                             + ("" if needed is None else f", where {needed:.2f} would break even") + ".")
    blocks.append(("list", lines))
    blocks.append(("table", ["prompt set", "temperature", "B", "fastest gamma", "measured S", "answer",
                             "predicted S", "rounds with a proposal", "accepted/round",
                             "break-even accepted/round"], rows))
    blocks.append(("p", "Prompt lookup drafts by copying: the tokens that followed the latest earlier "
                   "occurrence of the context's last n tokens (docs/design.md §4.8). It costs host time only, "
                   "so no draft length is chosen by a model: the fastest timed gamma (its longest proposal) is "
                   "shown, measured (median speedup, 95% CI), with the prediction from the round's timed parts. "
                   "Break-even accepted/round: the draft tokens a round would have to accept for S = 1 at "
                   "the round's measured cost ((accepted + 1) / S plain steps). At batch > 1 a "
                   "round verifies the batch's longest proposal and the batch rolls back to its shortest "
                   "accepted prefix (each sequence credited what it emitted), so one sequence without a "
                   "proposal holds the batch to one token that round: a lower bound on an engine that "
                   "rolls each sequence back on its own."))
    return blocks


def _imposed_verdict(p: dict, docs: dict[str, dict]) -> list[Block]:
    """The verdict of an MTP head, timed at an imposed acceptance: what it would need to accept."""
    blocks: list[Block] = [("h3", "Verdict for an MTP head (acceptance imposed)")]
    if not docs:
        return blocks + [_no_verdict("measured SD on the prompt sets")]
    rows, lines = [], []
    for prompt_set, doc in docs.items():
        for batch in sorted({1, max(p["spec_batches"])}):
            run = verdict.fastest_run(doc["runs"], batch, 0.0)
            if run is None:
                continue
            needed = verdict.break_even_alpha(run)
            rows.append([prompt_set, str(batch), str(run["gamma"]), f"{run['alpha']:.2f}", measured_speedup(run),
                         "-" if run.get("predicted_speedup") is None else f"{run['predicted_speedup']:.2f}",
                         "never" if needed is None else f"{needed:.2f}"])
            if batch == 1:
                pays = ("no acceptance would pay off" if needed is None
                        else f"it pays off above acceptance {needed:.2f}")
                lines.append(f"On {prompt_set} at batch 1, gamma {run['gamma']}: **at imposed acceptance "
                             f"{run['alpha']:.2f}, {measured_speedup(run)}**; {pays}.")
    blocks.append(("list", lines))
    blocks.append(("table", ["prompt set", "B", "fastest gamma", "imposed alpha", "measured S", "predicted S",
                             "break-even alpha"], rows))
    blocks.append(("p", "The MTP head here is emulated: one decoder layer at the target's dimensions fed the "
                   "target's last hidden state, with the target's LM head (docs/design.md §4.9), its drafts "
                   "accepted with the imposed probability; so its row measures what MTP drafting costs, not "
                   "how often a trained head is right. Break-even alpha: the acceptance at which S = 1 at the "
                   "round's measured cost (the round costs (accepted + 1) / S plain steps; the alpha whose "
                   "expected tokens per round equal that)."))
    return blocks


def _verdict(d: Digest, p: dict, docs: dict[str, dict]) -> list[Block]:
    if p.get("drafter_kind") == "prompt-lookup":
        return _lookup_verdict(p, docs)
    if p.get("drafter_kind") == "mtp-head":
        return _imposed_verdict(p, docs)
    blocks: list[Block] = [("h3", "Verdict for this pair")]
    fitted = d.fit_of(p["target"], p["draft"])
    if fitted is None or not fitted.get("drafted") or not docs:
        missing = "the fit of the target with the drafter's step" if fitted is None or not fitted.get(
            "drafted") else "measured SD on the prompt sets"
        return blocks + [_no_verdict(missing)]
    batches = tuple(sorted({1, max(p["spec_batches"])}))
    rows, lines = [], []
    for prompt_set, doc in docs.items():
        accepted = spec_runs.measured_acceptance(doc)
        for row in verdict.verdict_rows(fitted, accepted, doc["context"], batches,
                                        runs=spec_runs.valid_runs(doc["runs"])):
            run = verdict.timed_run(doc["runs"], row)
            # none for exact rejection sampling, which the timed runs do not use
            fastest = (None if row["rule"] == "rejection"
                       else verdict.fastest_run(doc["runs"], row["batch"], row["temperature"]))
            rows.append([prompt_set, f"{row['temperature']:g}", row["rule"], f"{row['alpha']:.2f}",
                         str(row["batch"]), str(row["gamma"]),
                         "not timed" if run is None else measured_speedup(run),
                         f"{row['predicted_speedup']:.2f}",
                         "-" if run is None else ("yes" if row["agrees"] else "no"),
                         "-" if fastest is None else f"{fastest['measured_speedup']:.2f} (gamma {fastest['gamma']})",
                         "-" if row.get("break_even_alpha") is None else f"{row['break_even_alpha']:.2f}",
                         "-" if row.get("break_even_draft_ratio") is None else f"{row['break_even_draft_ratio']:.2f}"])
            if row["batch"] == 1 and row["rule"] != "rejection":
                lines.append(_verdict_line(prompt_set, row, run))
    blocks.append(("list", lines))
    blocks.append(("table", ["prompt set", "temperature", "acceptance rule", "alpha", "B", "best gamma",
                             "measured S", "predicted S", "agree", "best measured S",
                             "break-even alpha", "break-even T_D/T_T"], rows))
    blocks.append(("p", f"Best gamma over 1-8 by the fitted model (`{fitted['chosen']}` expert loads, "
                   "gamma+1 verify tokens) at the alpha measured on each prompt set, pooled over the "
                   "measured gammas; the SD stage times that gamma too, so the recommendation is "
                   "measured: measured S is that run's median speedup with its 95% CI, and the "
                   "prediction agrees when it lies inside the CI widened by the fit's held-out error. "
                   "Best measured S is the fastest timed gamma at that batch. Break-even alpha: the "
                   "acceptance at which S = 1 at that gamma; break-even T_D/T_T: the largest drafter "
                   "step, as a fraction of a plain step, at which S = 1 at the measured alpha. Rule "
                   "`greedy` is temperature 0; at temperature 1 `mlx-lm` is the rule mlx-lm runs (the "
                   "target's sampled token must equal the draft) and `rejection` exact rejection "
                   "sampling (min(1, p/q)), expected from the same distributions. Where SD does not "
                   "pay, the deciding term is the one whose removal raises S the most: the drafter's "
                   "steps, the verify forward's excess over one step, or missed drafts."))
    return blocks


def _counted(docs: dict[str, dict]) -> str:
    """How many prompts of each set the acceptance pass decoded."""
    parts = []
    for prompt_set, doc in docs.items():
        measured = {a["prompts_measured"] for a in doc.get("acceptance") or []}
        total = (doc.get("prompts") or {}).get("count")
        if measured:
            parts.append(f"{max(measured)} of the {total} prompts of {prompt_set}" if total else
                         f"{max(measured)} prompts of {prompt_set}")
    return "; ".join(parts)


def _acceptance(docs: dict[str, dict], figures: dict[str, Path]) -> list[Block]:
    rows, notes = [], []
    for prompt_set, doc in docs.items():
        for a in doc.get("acceptance") or []:
            rules = a.get("rules") or {a["rule_run"]: a["measured"]}
            for rule, stats in rules.items():
                rows.append([prompt_set, f"{a['temperature']:g}", str(a["gamma"]), rule,
                             "expected from p, q" if "rules" in a else "measured",
                             str(stats["rounds"]),
                             by_position(stats["acceptance_by_position"]),
                             f"{stats['mean_accepted']:.2f}", f"{stats['sigma']:.2f}",
                             "-" if stats["alpha"] is None else f"{stats['alpha']:.2f}"])
            if "rules" in a:
                notes.append(f"{prompt_set}, temperature {a['temperature']:g}, gamma {a['gamma']}: exact "
                             f"rejection sampling gives {a['rejection_over_mlx_lm']:.2f}x the tokens per round "
                             "of mlx-lm's rule, so that much more speedup at the same cost per round")
            check = a.get("greedy_check")
            if check:
                notes.append(f"{prompt_set}, gamma {a['gamma']}: at temperature 0 SD output differs from "
                             f"plain greedy output in {check['mismatched']} of {check['sequences']} prompts"
                             + ("" if not check["mismatched"] else " (float near-ties flip an argmax)"))
    if not rows:
        return []
    blocks: list[Block]
    blocks = [("h3", "Acceptance per prompt set and temperature"),
              ("table", ["prompt set", "temperature", "gamma", "rule", "how", "rounds",
                         "accepted at position 1..gamma", "accepted/round", "sigma", "alpha"], rows),
              ("p", f"Untimed pass, batch 1, over {_counted(docs)}. Accepted at position i: the share "
                    "of rounds offering an i-th draft token (every round, for a drafter model; those whose "
                    "proposal reached i, for prompt lookup) that accepted it. alpha is solved from the mean "
                    "accepted draft tokens per round, L = alpha(1 - alpha^gamma)/(1 - alpha), where every "
                    "round drafts gamma tokens (not for prompt lookup: '-'); sigma = (L+1)/(gamma+1).")]
    if notes:
        blocks.append(("list", notes))
    return blocks + [("figure", "acceptance", "Acceptance at each draft position, per prompt set and "
                      "temperature.")] if "acceptance" in figures else blocks


def _speedups(d: Digest, p: dict, docs: dict[str, dict], figures: dict[str, Path]) -> list[Block]:
    fitted = d.fit_of(p["target"], p["draft"])
    rows, predictions = [], []
    for prompt_set, doc in docs.items():
        for r in doc["runs"]:
            pred = fit_module.model_prediction(fitted, r, doc)
            predictions.append(pred)
            rules = r.get("rules")
            rows.append([prompt_set, f"{r.get('temperature', 0):g}", str(r["batch"]), str(r["gamma"]),
                         r["engine"], "-" if r["alpha"] is None else f"{r['alpha']:.2f}",
                         f"{r['tokens_per_s_plain']:.1f}", f"{r['tokens_per_s_sd']:.1f}",
                         measured_speedup(r), *predicted_cells(r, pred), plain_vs_sweep(r),
                         "-" if not rules else f"{rules['projected_speedup_rejection']:.2f}",
                         round_cell(r), rollback_cell(r)])
    if not rows:
        return []
    runs = [r for doc in docs.values() for r in doc["runs"]]
    blocks: list[Block]
    blocks = [("h3", "Measured against predicted speedup"),
              ("table", ["prompt set", "temperature", "B", "gamma", "engine", "alpha", "plain tok/s",
                         "SD tok/s", "measured S", "predicted (timed parts)", "error", "predicted (fit)",
                         "error", "plain vs sweep", "S with exact rejection", ROUND_HEADER, "rollback"], rows),
              ("p", "SD ran " + _engines(p)[1:-1] + ", B prompts of the set at a time. "
                    + precision_note(runs) + " The first prediction prices a round from the forwards the SD "
                    "stage timed beside its pairs, the second comes from the fit; both at the run's own alpha "
                    "and prompt length. Plain vs sweep: this stage's plain step over the sweep's, flagged "
                    "beyond 15%. The last column scales the measured speedup by exact rejection sampling's "
                    "gain in tokens per round over mlx-lm's rule (temperature > 0). The rollback column says "
                    "how the caches went back after rejected drafts and whether the audit against plain "
                    "decoding passed; an invalid run is left out of the verdict.")]
    blocks += [("p", note) for note in newer_fit_note(predictions)]
    blocks += [("p", f"**{line}**") for doc in docs.values() for line in invalid_lines(doc)]
    return blocks + ([("figure", "measured_vs_predicted", "Measured against predicted SD speedup for this "
                       "pair (dashed: equal).")] if "measured_vs_predicted" in figures else [])


KIND_NAMES = {"model": "drafter model", "prompt-lookup": "prompt lookup", "self": "self-draft",
              "mtp-head": "MTP head"}


def _compared(where: tuple[str, float, int], fastest: dict[str, dict], kinds: dict[str, str],
              imposed: set[str]) -> tuple[list[list[str]], str | None]:
    """The comparison table's rows at one (prompt set, temperature, batch), the kinds whose
    acceptance was measured ranked by measured S and those timed at an imposed acceptance after
    them, unranked; and, at batch 1, the lead sentence."""
    prompt_set, temperature, batch = where
    ranked = sorted((k for k in fastest if k not in imposed), key=lambda k: -fastest[k]["measured_speedup"])
    rows = []
    for draft in ranked + [k for k in fastest if k in imposed]:
        run = fastest[draft]
        needed = verdict.break_even_accepted(run)
        label = f"{kinds[draft]} ({draft})" + (f", alpha imposed at {run['alpha']:.2f}" if draft in imposed else "")
        rows.append([prompt_set, f"{temperature:g}", str(batch), label, str(run["gamma"]), measured_speedup(run),
                     verdict.measured_answer(run),
                     "-" if run.get("mean_accepted") is None else f"{run['mean_accepted']:.2f}",
                     "-" if needed is None else f"{needed:.2f}",
                     "imposed" if draft in imposed else ("best" if draft == ranked[0] else "")])
    if batch != 1:
        return rows, None
    parts = []
    if ranked:
        best = fastest[ranked[0]]
        others = ", ".join(f"{kinds[k]} {fastest[k]['measured_speedup']:.2f}" for k in ranked[1:])
        parts.append(f"**{kinds[ranked[0]]} is fastest**, {measured_speedup(best)} "
                     f"({verdict.measured_answer(best)})" + (f"; then {others}" if others else ""))
    for draft in (k for k in fastest if k in imposed):
        needed = verdict.break_even_alpha(fastest[draft])
        parts.append(f"an {kinds[draft]} would pay off above acceptance {needed:.2f}" if needed is not None
                     else f"an {kinds[draft]} would not pay off at any acceptance")
    return rows, f"On {prompt_set} at temperature {temperature:g}, batch 1: " + "; ".join(parts) + "."


def drafter_blocks(d: Digest) -> list[Block]:
    """Where a target was measured with several kinds of drafter on the same prompts: each kind's
    fastest measured S per prompt set, temperature and batch, the best kind first, and what the
    others would need to accept per round to pay off (from their rounds' measured cost). Kinds
    timed at an imposed acceptance (an MTP head) are never ranked against measured ones: for them,
    the acceptance they would need."""
    blocks: list[Block] = []
    by_target: dict[str, list[dict]] = {}
    for p in d.pairs:
        by_target.setdefault(p["target"], []).append(p)
    for target, pairs in by_target.items():
        if len(pairs) < 2:
            continue
        rows, lines = [], []
        docs = {p["draft"]: d.pair_spec(p) for p in pairs}
        kinds = {p["draft"]: KIND_NAMES.get(p.get("drafter_kind", "model"), "drafter model") for p in pairs}
        imposed = {p["draft"] for p in pairs if p.get("drafter_kind") == "mtp-head"}
        for prompt_set in dict.fromkeys(s for p in pairs for s in p["prompt_sets"]):
            temperatures = sorted({r.get("temperature", 0) for sd in docs.values() if prompt_set in sd
                                   for r in sd[prompt_set]["runs"]})
            for temperature in temperatures:
                for batch in sorted({1, max(pairs[0]["spec_batches"])}):
                    timed = {draft: verdict.fastest_run(sd[prompt_set]["runs"], batch, temperature)
                             for draft, sd in docs.items() if prompt_set in sd}
                    fastest = {k: v for k, v in timed.items() if v is not None}
                    if fastest:
                        more, lead = _compared((prompt_set, temperature, batch), fastest, kinds, imposed)
                        rows += more
                        lines += [lead] if lead else []
        blocks += [("h2", f"Which drafter for {target}"), ("list", lines),
                   ("table", ["prompt set", "temperature", "B", "drafter", "gamma", "measured S", "answer",
                              "accepted/round", "break-even accepted/round", ""], rows),
                   ("p", "Each kind of drafter measured on the same prompts, against plain decoding of the same "
                         "target (at batch 1 mlx-lm's own `generate_step` where its speculative decoding ran, "
                         "else the suite's loop's), its "
                         "fastest timed gamma at each batch (median speedup over pairs, 95% CI). Break-even "
                         "accepted/round: the draft tokens a round would have to accept for S = 1 at that "
                         "kind's measured cost of a round; a kind pays off once it accepts more. A kind timed at "
                         "an imposed acceptance (an emulated MTP head) is not ranked: its measured S is at the "
                         "acceptance imposed, so its line says the acceptance it would need. Each kind's own "
                         "verdict follows in its section.")]
    return blocks


def pair_blocks(d: Digest, figures: dict[str, Path]) -> list[Block]:
    """The pair sections, one group per measured pair, after the comparison of drafters."""
    blocks = drafter_blocks(d)
    for p in d.pairs:
        docs = d.pair_spec(p)
        blocks.append(("h2", f"Your pair: {p['target']} with {p['draft']}"))
        blocks += _verdict(d, p, docs)
        blocks += _measured(d, p)
        blocks += _acceptance(docs, figures)
        blocks += _speedups(d, p, docs, figures)
        blocks += _routing(d, p)
    return blocks
