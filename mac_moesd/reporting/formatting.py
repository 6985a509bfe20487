"""Human renderings of the CLI's documents. Data stays in SI units; only this module humanises
(byte sizes through ``units``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, TypeAlias

from mac_moesd.machine import thermal
from mac_moesd.units import gib, human_bytes
from mac_moesd.reporting.numbers import num, seconds

if TYPE_CHECKING:
    from mac_moesd.analysis.fit.document import RunPrediction

# One block of the report, as report.py renders it: a heading, paragraph or note (its text), a
# numbered list (its items), a table (headers, rows) or a figure (its name, caption).
Block: TypeAlias = (tuple[Literal["h1", "h2", "h3", "p", "note"], str] | tuple[Literal["list"], list[str]]
                    | tuple[Literal["table"], list[str], list[list[str]]] | tuple[Literal["figure"], str, str])


def si(value: float | None, unit: str, digits: int = 3) -> str:
    """1.5e11, 'B/s' -> '150 GB/s'. None -> 'n/a'."""
    if value is None:
        return "n/a"
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.{digits}g} {prefix}{unit}"
    return f"{value:.{digits}g} {unit}"


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A plain right-aligned text table."""
    cells = [headers, *rows]
    widths = [max(len(str(r[i])) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(str(c).rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def render_selftest(doc: dict) -> str:
    lines = [f"mac-moesd selftest on {doc['chip']} ({doc['backend']}; mlx {doc['versions'].get('mlx')}, "
             f"mac-moesd {doc['versions'].get('mac_moesd')})"]
    lines += [f"{c['status']:<4}  {c['check']}: {c['detail']} ({c['seconds']:.1f} s)" for c in doc["checks"]]
    failed = sum(c["status"] == "FAIL" for c in doc["checks"])
    lines.append(f"{failed} of {len(doc['checks'])} checks failed" if failed else "all checks passed")
    return "\n".join(lines)


def render_info(doc: dict) -> str:
    spec = doc["spec"]
    blas = doc["blas"]
    lines = [
        f"chip:        {doc['chip']}" + (f" ({doc['gpu_cores']}-core GPU)" if doc["gpu_cores"] else ""),
        f"slug:        {doc['slug']}",
        f"os:          {doc['os']}",
        f"backend:     {doc['backend']}",
        f"blas:        {blas['name']}" + (f" ({blas['path']})" if blas["path"] else "")
        + (f", threads {blas['threads']}" if blas.get("threads") else "")
        + (f" [{blas['note']}]" if blas["note"] else ""),
        f"memory:      {gib(doc['memory_bytes'])}, usable for a measurement {gib(doc['available_bytes'])}",
    ]
    if doc["power_source"]:
        lines.append(f"power:       {doc['power_source']}"
                     + (", Low Power Mode on" if doc.get("low_power_mode") else ""))
    if doc.get("thermal"):
        thermal = doc["thermal"]
        lines.append(f"thermal:     CPU speed limit {thermal['speed_limit']}%"
                     + "".join(f"; {w}" for w in thermal["warnings"]))
    if spec:
        ridge = spec["ridge_flop_per_byte"]
        lines += [
            f"spec:        {si(spec['bandwidth_bytes_s'], 'B/s')} memory bandwidth, "
            f"{si(spec['fp32_flops'], 'FLOP/s')} FP32"
            + (f", ridge {ridge:.1f} FLOP/byte" if ridge else ""),
            f"             source: {spec['source']}" + (f" ({spec['derived']})" if spec["derived"] else ""),
        ]
    else:
        lines.append("spec:        none (not an Apple chip in the table; `roofline` measures it)")
    versions = ", ".join(f"{k} {v}" for k, v in doc["versions"].items() if v)
    lines.append(f"versions:    {versions}")
    return "\n".join(lines)


def _powers_of_two(limit: int) -> list[int]:
    out, t = [], 1
    while t <= limit:
        out.append(t)
        t *= 2
    return out


def render_theory(doc: dict) -> str:
    E, K = doc["experts"], doc["top_k"]
    lines = [
        f"E = {E} experts, K = {K} per token, rho = K/E = {doc['rho']:.4g}, tau = {doc['tau']}",
        f"MoESD's batch threshold T_thres = {doc['threshold_tokens']} tokens "
        f"(independent tokens, uniform routing; N(t) >= {doc['tau']} E)",
    ]
    if doc["correlation"] is not None:
        lines.append(
            f"within-sequence threshold at correlation c = {doc['correlation']}: "
            f"{doc['threshold_corrected']} consecutive tokens of one sequence (N_c(t) = N(1 + c(t-1)))"
        )
    by_t = {row["t"]: row for row in doc["activated"]}
    per_expert = {row["t"]: row["tokens"] for row in doc["tokens_per_expert"]}
    shown = _powers_of_two(max(by_t))
    for extra in (doc["threshold_tokens"], doc["threshold_corrected"]):
        if extra in by_t and extra not in shown:
            shown.append(extra)
    headers = ["t", "N(t)", "N/E", "tokens/expert"]
    if doc["correlation"] is not None:
        headers += ["N_c(t)", "N_c/E"]
    rows = []
    for t in sorted(shown):
        row = by_t[t]
        cells = [str(t), f"{row['uniform']:.2f}", f"{row['fraction']:.3f}", f"{per_expert[t]:.2f}"]
        if "correlated" in row:
            cells += [f"{row['correlated']:.2f}", f"{row['correlated'] / E:.3f}"]
        rows.append(cells)
    lines += ["", table(headers, rows), ""]
    acc_rows = [
        [f"{a['alpha']:g}", str(a["gamma"]), f"{a['omega']:.3f}", f"{a['sigma']:.3f}"]
        for a in doc["acceptance"]
    ]
    lines.append(table(["alpha", "gamma", "Omega", "sigma"], acc_rows))
    return "\n".join(lines)


def render_zoo(doc: dict) -> str:
    rows = []
    for m in doc["models"]:
        moe = m["experts"] is not None
        rows.append([
            m["name"], m["role"], m["arch"],
            str(m["experts"]) if moe else "-", str(m["top_k"]) if moe else "-",
            f"{m['rho']:.3f}" if moe else "-", str(m["threshold_tokens"]) if moe else "-",
            f"{m['params_total'] / 1e9:.2f}B", f"{m['params_active'] / 1e9:.2f}B",
            gib(m["bytes"]["fp16"]), gib(m["bytes"]["4bit"]),
        ])
    headers = ["model", "role", "arch", "E", "K", "rho", "T_thres", "params", "active", "fp16", "4-bit"]
    note = "Bytes are params x bytes/param of the format (4-bit: 0.5625 B with group-64 scales)."
    return table(headers, rows) + "\n" + note


def render_sweep(doc: dict) -> str:
    points = {(p["batch"], p["tokens"]): p for p in doc["points"]}
    batches = sorted({b for b, _ in points})
    tokens = sorted({t for _, t in points})
    depth = f"{doc['layers_full']} layers"
    if doc["extrapolated"]:
        depth += f" (extrapolated from slices of {' and '.join(map(str, doc['layers_measured']))})"
    fmt = f"{doc['bits']}-bit" if doc["bits"] else doc["dtype"]
    lines = [
        f"{doc['model']}: {fmt}, context {doc['context']}, {depth}"
        + (f"; routing {doc['routing']}, gather {doc['gather']}"
           if (doc.get("routing"), doc.get("gather")) not in ((None, None), ("model", "mlx-lm")) else ""),
        "",
        "T_T(B,t) / T_T(B,1)  (the ratio MoESD studies; 1.00 = a free verify window)",
    ]
    rows = []
    for b in batches:
        base = points.get((b, 1))
        cells = [str(b)]
        for t in tokens:
            p = points.get((b, t))
            cells.append(f"{p['median_s'] / base['median_s']:.2f}" if p and base else "-")
        rows.append(cells)
    lines.append(table(["B \\ t", *map(str, tokens)], rows))
    lines += ["", "median time per forward (CV, repeats)"]
    rows = []
    for b in batches:
        cells = [str(b)]
        for t in tokens:
            p = points.get((b, t))
            cells.append(f"{seconds(p['median_s'])} ({p['cv']:.0%}, {p['repeats']})" if p else "-")
        rows.append(cells)
    lines.append(table(["B \\ t", *map(str, tokens)], rows))
    if any(p.get("pipelined") for p in points.values()):
        lines += ["", "pipelined, per forward (next graph built while one runs, as mlx-lm generates)"]
        rows = []
        for b in batches:
            cells = [str(b)]
            for t in tokens:
                pipe = (points.get((b, t)) or {}).get("pipelined")
                cells.append(f"{seconds(pipe['median_s'])} ({pipe['cv']:.0%})" if pipe else "-")
            rows.append(cells)
        lines.append(table(["B \\ t", *map(str, tokens)], rows))
    if any("unique_experts" in p for p in points.values()):
        lines += ["", f"unique experts per MoE layer as run (token-expert pairs); routing "
                      f"{doc.get('routing', 'model')}, gather {doc.get('gather', 'mlx-lm')}"]
        rows = []
        for b in batches:
            cells = [str(b)]
            for t in tokens:
                p = points.get((b, t))
                cells.append(f"{p['unique_experts']:.1f} ({p['pairs']})" if p and "unique_experts" in p else "-")
            rows.append(cells)
        lines.append(table(["B \\ t", *map(str, tokens)], rows))
    if doc.get("draft"):
        d = doc["draft"]
        steps = ", ".join(f"B={p['batch']}: {seconds(p['median_s'])}"
                          + (f" ({seconds(p['pipelined']['median_s'])} pipelined)" if p.get("pipelined") else "")
                          for p in d["points"])
        lines += ["", f"drafter {d['model']} one-token step T_D(B,1): {steps}"]
    if doc.get("reject"):
        r = doc["reject"]
        steps = ", ".join(f"B={p['batch']}: {seconds(p['median_s'])}" for p in r["points"])
        lines += [f"rejection sampling T_rej(B), gamma={r['gamma']}, V={r['vocab']}: {steps}"]
    for s in doc["slices"]:
        if s["drift"]:
            d = s["drift"]
            state = "FLAGGED" if d["flagged"] else "ok"
            lines.append(f"drift check ({s['layers']} layers, point {d['point']}): {d['change']:+.1%} {state}")
    if doc.get("ranks"):
        lines += ["", f"sharded over {doc['ranks']} ranks ({doc['parallel']} parallel, split by "
                      f"{doc['sharded_by']}, {doc['backend']} backend; hosts {', '.join(doc['hosts'])}): "
                      "communication per forward (collectives timed alone) and its share of T_T"]
        rows = [[str(p["batch"]), str(p["tokens"]), seconds(p["median_s"]),
                 seconds(p["comm_s"]) if p["comm_s"] is not None else "-",
                 f"{p['comm_share']:.1%}" if p["comm_share"] is not None else "-"] for p in doc["points"]]
        lines.append(table(["B", "t", "T_T", "communication", "share"], rows))
    blas = doc["meta"]["blas"]["name"]
    lines += [f"backend {doc['meta']['backend']}, BLAS {blas}; results in {doc['results_file']}"]
    return "\n".join(lines)


def render_roofline(doc: dict) -> str:
    bw, fl = doc["bandwidth_gbs"], doc["flops_tflops"]
    lines = [f"backend {doc['backend']}; bandwidth kernels: {doc['kernels']['note']}", ""]
    lines.append(table(["bandwidth", "GB/s"], [[k, f"{v:.1f}"] for k, v in bw.items()]))
    lines.append(f"ceiling: {doc['bandwidth_ceiling_gbs']:.1f} GB/s ({doc['bandwidth_ceiling_source']})")
    lines += ["", table(["compute", "TFLOPS"], [[k, f"{v:.4g}"] for k, v in fl.items()])]
    lines += [
        "",
        f"ridge point ({doc['ridge_dtype']}): {doc['ridge_flop_per_byte']:.1f} FLOP/byte",
        "in tokens per forward: " + ", ".join(f"{k} {v:.1f}" for k, v in doc["ridge_tokens"].items()),
        "quantized-matmul knee (tokens where compute time equals weight-streaming time): "
        + ", ".join(f"{b}-bit {v:.1f}" if v else f"{b}-bit n/a" for b, v in doc["qmm_knee_tokens"].items()),
    ]
    rows = []
    for r in doc["qmm_curve"]:
        rows.append([f"{r['bits']}", str(r["tokens"]), seconds(r["median_s"]), f"{r['cv']:.0%}",
                     f"{r['tflops'] * 1e3:.3g}"])
    lines += ["", table(["bits", "tokens", "time", "CV", "GFLOPS"], rows)]
    frac = doc["fraction_of_spec"]
    if frac:
        parts = [f"bandwidth {frac['bandwidth']:.0%}"]
        if "fp32_flops" in frac:
            parts.append(f"FP32 {frac['fp32_flops']:.0%}")
        lines.append("of the chip's published spec: " + ", ".join(parts))
    else:
        lines.append("no published spec for this machine")
    lines.append(f"results in {doc['results_file']}")
    return "\n".join(lines)


def render_routing(doc: dict) -> str:
    lines = [
        f"{doc['model']}: E = {doc['experts']}, K = {doc['top_k']}; {doc['sequences']} sequences x "
        f"{doc['length']} tokens from {doc['text']} ({doc['token_ids']} ids); "
        f"{doc['moe_layers_measured']} MoE layers averaged",
        "",
        "unique experts per window: measured (sd) / uniform N(B*t)",
    ]
    cells = {(w["batch"], w["tokens"]): w for w in doc["windows"]}
    batches = sorted({b for b, _ in cells})
    tokens = sorted({t for _, t in cells})
    rows = []
    for b in batches:
        row = [str(b)]
        for t in tokens:
            w = cells[(b, t)]
            row.append(f"{w['measured_unique']:.1f} ({w['std_unique']:.1f}) / {w['uniform_unique']:.1f}")
        rows.append(row)
    lines.append(table(["B \\ t", *map(str, tokens)], rows))
    lines += [
        "",
        f"correlation c (consecutive tokens of one sequence): {doc['correlation']:.3f}",
        f"correlation across independent sequences: {doc['batch_correlation']:.3f}",
        f"MoESD's batch threshold (independent tokens): {doc['threshold_uniform']} tokens; "
        f"within-sequence threshold at c = {doc['correlation']:.2f}: {doc['threshold_corrected']} "
        "consecutive tokens",
    ]
    sat = {(s["batch"], s["gamma"]): s for s in doc["saturation"]}
    gammas = sorted({g for _, g in sat})
    def mark(s):
        return ("yes" if s["saturated"] else "-") + ("" if s["source"] == "measured" else "*")

    rows = [[str(b)] + [mark(sat[(b, g)]) for g in gammas] for b in batches]
    lines += ["", f"does a verify window of B x (gamma+1) tokens reach {doc['tau']} E? "
              "(* predicted from the fitted correlations, others measured)",
              table(["B \\ gamma", *map(str, gammas)], rows)]
    return "\n".join(lines)


def by_position(rates: list[float | None]) -> str:
    """Acceptance by draft position, "-" where no round offered that position (prompt lookup)."""
    return " ".join(num(v, ".2f") for v in rates)


def pipelining_lines(pipe: dict | None) -> list[str]:
    """One sentence on what pipelining hides per forward, when the sweep measured it."""
    if not pipe or not pipe.get("target_points"):
        return []
    fit = "" if pipe.get("target_mape") is None else f"; fitted T_T less it: MAPE {pipe['target_mape']:.1%} on the pipelined points"
    draft = f", drafter {seconds(pipe['draft_s'])}" if pipe.get("draft_points") else ""
    how = "mean, weighted 1/T^2," if pipe.get("weighted") else "median"
    return [f"pipelining hides per forward ({how} of synchronous - pipelined over {pipe['target_points']} points): "
            f"target {seconds(pipe['target_s'])}{draft}{fit}; speedups use pipelined plain and draft steps"]


def measured_speedup(run: dict) -> str:
    """A timed run's speedup, the median over its pairs: with its 95% CI and pairs where it was
    measured to a precision (and what ended it otherwise: a decided verdict, the budget), else
    with the pairs' range."""
    text = f"{run['measured_speedup']:.2f}"
    ci = run.get("measured_ci")
    if ci:
        stopped = run.get("stopped") or ("precision" if run.get("precision_met") else "budget")
        why = {"precision": "", "decided": ", stopped: decided", "budget": ", budget spent",
               "repeats": ", the fewest pairs asked (too few for a 95% interval)"}[stopped]
        return f"{text} [{ci[0]:.2f}-{ci[1]:.2f}] {run['pairs']} pairs{why}"
    spread = run.get("speedup_range")
    return text if not spread or run.get("repeats", 1) < 2 else f"{text} ({spread[0]:.2f}-{spread[1]:.2f})"


def precision_note(runs: list[dict]) -> str:
    """How the table's speedups were measured: to a precision (the CI, the budget), or, for runs
    recorded before precisions, not."""
    measured = [r for r in runs if r.get("measured_ci")]
    if not measured:
        pairs = sorted({r["repeats"] for r in runs if r.get("repeats")})
        return (f"Measured S is the median of per-pair ratios over {', '.join(map(str, pairs))} pairs with "
                "their range, not measured to a precision (recorded before confidence intervals).")
    met = sum(bool(r.get("precision_met")) for r in measured)
    decided = sum(r.get("stopped") == "decided" for r in measured)
    r = measured[0]
    early = (f", or (a quick run) until it lay wholly more than {r['precision']:.0%} from 1.0, the answer "
             f"decided" if decided else "")
    pooled_rows = sum(bool(run.get("pooled_tokens_per_round")) for run in measured)
    pooled = (" (each SD run's rounds per second at the tokens per round all of the configuration's SD runs "
              "realised together, so that one run's luck in acceptance does not spread the pairs"
              + ("" if pooled_rows == len(measured) else f"; in {pooled_rows} of {len(measured)} rows") + ")"
              if pooled_rows else "")
    methods = {run.get("measured_ci_method", "bootstrap") for run in measured}
    interval = ("distribution-free 95% confidence interval (order statistics)" if methods == {"order statistics"}
                else "95% bootstrap confidence interval" if methods == {"bootstrap"}
                else "95% confidence interval (bootstrap in older rows, order statistics in newer)")
    return (f"Measured S is the median of per-pair ratios of alternating plain and SD runs{pooled}, with its "
            f"{interval}: pairs were added until the interval was within "
            f"+-{r['precision']:.0%} of the median{early}, or {r['budget_s']:g} s of the configuration were "
            f"spent (at least {r['repeats']} pairs); {met} of {len(measured)} configurations met the precision"
            + (f", {decided} stopped at a decided answer." if decided else "."))


def predicted_cells(run: dict, model: RunPrediction) -> list[str]:
    """A timed run's two predictions beside its measurement, each with its error: from the SD
    stage's own timed forwards (``predicted_by.measured``), and from the fitted model as stored
    with the run, with a newer fit's beside it where that predicts otherwise (``NEWER_FIT_NOTE``)."""
    measured = (run.get("predicted_by") or {}).get("measured")

    def cell(pred):
        return ["-", "-"] if pred is None else [f"{pred:.2f}", f"{pred / run['measured_speedup'] - 1:+.0%}"]

    fitted = cell(model.stored)
    if model.newer:
        fitted[0] += f" (current fit: {model.now:.2f})"
    return cell(measured) + fitted


NEWER_FIT_NOTE = ("A fit prediction with \"current fit\" beside it: the first figure (and its error) is the one "
                  "the SD stage stored with the run when it timed it (\"-\": there was no fit then), the second "
                  "what the results' fit predicts now, which differs: the fit was made again after the run "
                  "(or, for results recorded before fits were dated, the model has changed since).")


def newer_fit_note(predictions: list[RunPrediction]) -> list[str]:
    """``NEWER_FIT_NOTE`` where a row shows a newer fit's prediction, else nothing."""
    return [NEWER_FIT_NOTE] if any(p.newer for p in predictions) else []


PLAIN_VS_SWEEP_FLAG = 0.15  # the machine changed between the sweep and the SD stage beyond this


def plain_vs_sweep(run: dict) -> str:
    """The SD stage's plain step over the sweep's, flagged beyond PLAIN_VS_SWEEP_FLAG."""
    ratio = run.get("plain_vs_sweep")
    if ratio is None:
        return "-"
    return f"{ratio:.2f}" + (" FLAGGED" if abs(ratio - 1) > PLAIN_VS_SWEEP_FLAG else "")


def one_row_lines(doc: dict) -> list[str]:
    """One sentence on the timed one-row forward the predictions use, beside the curve's value."""
    row = doc.get("one_row")
    curve = next((r["predicted_s"] for r in doc.get("train_points", []) if (r["batch"], r["tokens"]) == (1, 1)),
                 None)
    if not row or curve is None:
        return []
    pipelined = f", {seconds(row['pipelined_s'])} pipelined" if row.get("pipelined_s") is not None else ""
    return [f"one-row forward T_T(1,1) (MLX's matrix-vector kernels): timed {seconds(row['sync_s'])}{pipelined} "
            f"at context {row['context']}, the fitted curve {seconds(curve)} ({curve / row['sync_s'] - 1:+.1%}); "
            "predictions take the timed one"]


def kv_lines(doc: dict) -> list[str]:
    """How the fit told the KV cache's growth from costs per sequence: from two contexts, with its
    error at the second, or at one context, where the two are confounded."""
    kv = doc.get("kv")
    k_seq = doc.get("k_seq", 0.0)
    if not kv or not kv["separated"]:
        return [f"KV term k_kv = {doc['k_kv'] * 1e6:.2f} us per cached token per sequence, fitted at "
                f"context {doc['context']} alone: it also carries every cost per sequence, so predictions "
                "at a longer context overstate its growth"]
    return [f"KV term k_kv = {kv['k_kv'] * 1e6:.2f} us per cached token per sequence and k_seq = "
            f"{k_seq * 1e3:.3f} ms per sequence, told apart by the one-token points at contexts "
            f"{kv['context']} and {kv['second_context']} (MAPE {kv['mape']:.1%} at {kv['second_context']})"]


def routing_sentence(doc: dict) -> str:
    """How the fit counted expert reads: the sweep's unique experts and the fitted correlations."""
    routing = doc.get("routing") or {}
    if not routing.get("counts"):
        return ("Expert reads assume uniform routing, N(B*t) (this sweep counted no unique experts: "
                "rerun it to count them).")
    return (f"Expert reads follow the {len(routing['counts'])} points' counted unique experts; between them, "
            f"consecutive tokens of a sequence act like c = {routing['correlation']:.2f} and the batch's "
            f"sequences like c_batch = {routing['batch_correlation']:.2f} uniform tokens each (1 = uniform).")


def render_fit(doc: dict) -> str:
    p = doc["params"]
    drafter = f"drafter {doc['draft_model']}" if doc["drafted"] else "no drafter measured"
    ridge = ("" if doc["ridge_flop_per_byte"] is None
             else f"ridge {doc['ridge_flop_per_byte']:.1f} FLOP/byte from the ")
    bandwidth = ("no bandwidth" if doc["bandwidth_bytes_s"] is None
                 else f"bandwidth {doc['bandwidth_bytes_s'] / 1e9:.1f} GB/s")
    lines = [
        f"{doc['model']} (E = {doc['experts']}, K = {doc['top_k']}, {doc['weight_format']} weights), "
        f"{drafter}, context {doc['context']}; verify forward of {doc['verify_tokens']} tokens",
        f"{ridge}{doc['ridge_source']}; {bandwidth}",
        f"knee of G: {doc['knee_tokens']:.1f} tokens per forward (lam = {p['lam']:.3g} x "
        f"{doc['ridge_tokens']:.1f} tokens, "
        + (f"the ridge in tokens for {doc['weight_format']})" if doc["ridge_flop_per_byte"] is not None
           else "the grid's largest n: no ridge known)"),
        f"mlx-lm sorts expert pairs from n*K >= {doc['sort_threshold']} ({doc['sort_threshold_source']})",
        "",
        "expert-load variants (held-out MAPE):",
        table(["variant", "held-out MAPE", "knee (tokens)", ""],
              [[v["name"], num(v["heldout_mape"], ".1%"), f"{v['knee_tokens']:.1f}",
                "chosen" if v["name"] == doc["chosen"] else ""] for v in doc["variants"]]),
        doc["regime"],
        *pipelining_lines(doc.get("pipelining")),
        *one_row_lines(doc),
        "",
        f"parameters of `{doc['chosen']}`:",
        table(["parameter", "value", "lower", "upper"],
              [[k, num(v, ".4g"), f"{doc['bounds'][k][0]:.3g}",
                "inf" if doc["bounds"][k][1] is None else f"{doc['bounds'][k][1]:.3g}"] for k, v in p.items()]
              + [["k_kv", f"{doc['k_kv']:.4g}", "0", "inf"],
                 ["k_seq", f"{doc.get('k_seq', 0.0):.4g}", "0", "inf" if (doc.get("kv") or {}).get("separated") else "0"],
                 ["k_rec", f"{doc.get('k_rec', 0.0):.4g}", "0", "inf" if doc.get("linear_layers") else "0"]]),
        "k_kv: MagicDec's KV-read term, seconds per cached token per sequence; k_seq: seconds per "
        "sequence whatever the context (together B * (k_seq + k_kv * L)); k_rec: seconds per token "
        f"per recurrent layer, whatever the batch ({doc.get('linear_layers', 0)} layers: k_rec * layers * t)",
        *kv_lines(doc),
        "",
    ]
    if doc["heldout_mape"] is not None:
        w = doc["worst_point"]
        held, every = len(doc["heldout_points"]), len(doc["train_points"])
        lines.append(f"held-out error: MAPE {doc['heldout_mape']:.1%} over {held} points from a fit to the "
                     f"other {every - held}; worst B={w['batch']} t={w['tokens']}: {w['error']:+.1%}; "
                     f"parameters refitted on all {every}")
    lines.append(routing_sentence(doc))
    alphas = sorted({q["alpha"] for q in doc["predictions"]})
    gammas = sorted({q["gamma"] for q in doc["predictions"]})
    if not doc["drafted"]:
        eff = {q["gamma"]: q["target_efficiency"] for q in doc["predictions"] if q["batch"] == 1}
        lines += ["", "predicted target efficiency T_T(1,1)/T_T(1,gamma+1) at batch 1 (no speedups: "
                  "the drafter was not measured)",
                  table(["gamma", "efficiency"], [[str(g), f"{eff[g]:.2f}"] for g in gammas])]
        lines += [f"missing: {m}" for m in doc["missing"]]
        return "\n".join(lines)
    at1 = {(q["gamma"], q["alpha"]): q["speedup"] for q in doc["predictions"] if q["batch"] == 1}
    lines += ["", f"predicted SD speedup at batch 1 (`{doc['chosen']}`)",
              table(["gamma", *[f"alpha={a:g}" for a in alphas]],
                    [[str(g)] + [f"{at1[(g, a)]:.2f}" for a in alphas] for g in gammas])]
    rows = [[str(k["gamma"]), f"{k['alpha']:g}", str(k["peak_batch"]), f"{k['peak_speedup']:.2f}",
             f"{k['window'][0]}-{k['window'][1]}"] for k in doc["peaks"] if k["gamma"] in (2, 4, 8)]
    lines += ["", table(["gamma", "alpha", "peak B", "peak S", "B within peak/sqrt2"], rows)]
    lines += [f"missing: {m}" for m in doc["missing"]]
    return "\n".join(lines)


def rollback_cell(run: dict) -> str:
    """How a run's caches were rolled back and whether its audit passed ("-": a run of a file
    written before runs were audited)."""
    record = run.get("rollback")
    if record is None:
        return "-"
    return f"{record['strategy']}, {'audit ok' if record['audit']['ok'] else 'AUDIT FAILED'}"


def round_cell(run: dict) -> str:
    """A timed round's parts as the SD stage priced them: the drafter's steps, the verify forward,
    rejection sampling, the rollback (its cost times how often a round rejects) and the loop's own
    bookkeeping, and the round as measured end to end beside their sum; "-" for runs made before
    the parts were timed, and no rollback or bookkeeping part (or measured round) for runs before
    they were."""
    parts = run.get("round")
    if not parts:
        return "-"
    shown = [parts["draft_s"], parts["verify_s"], parts["reject_s"]]
    shown += [parts[k] for k in ("rollback_s", "bookkeeping_s") if k in parts]
    cell = " + ".join(seconds(v) for v in shown) + f" = {seconds(parts['round_s'])}"
    return cell + (f" (measured {seconds(parts['measured_s'])})" if parts.get("measured_s") else "")


ROUND_HEADER = "round: draft + verify + reject + rollback + bookkeeping (measured)"


def invalid_lines(doc: dict) -> list[str]:
    """One line per invalid run of a spec document: its configuration and why."""
    lines = []
    for r in doc["runs"]:
        if r.get("valid", True):
            continue
        audit = r["rollback"]["audit"]
        why = (audit.get("reason") or f"caches differ from plain decoding by {audit['max_abs_diff']:.2g} "
               f"(tolerance {audit['tolerance']:g})") if not audit["ok"] else \
            "SD output differs from greedy where the target's choice was no near-tie"
        lines.append(f"INVALID B={r['batch']} gamma={r['gamma']}: {why}; its speedup is not a measurement of SD")
    return lines


def lookup_lines(doc: dict) -> list[str]:
    """What prompt lookup proposed in each timed run of a spec document (none for other drafters)."""
    if doc.get("drafter_kind") != "prompt-lookup":
        return []
    rule = doc.get("lookup") or {}
    lines = [f"prompt lookup: the context's last {rule.get('max_ngram')} down to {rule.get('min_ngram')} tokens "
             "searched for, up to gamma tokens proposed; the batch's rows verify together (the longest "
             "proposal; rows roll back to the shortest accepted prefix, each credited what it emitted)"]
    for r in doc["runs"]:
        lk = r.get("lookup")
        if lk:
            lines.append(f"  B={r['batch']} gamma={r['gamma']}: a proposal in {lk['proposal_rate']:.0%} of "
                         f"rounds, {lk['mean_proposal']:.1f} tokens each; rounds verified "
                         f"{lk['mean_width']:.1f} drafts on average; {lk['rolled_back_share']:.0%} rolled back")
    return lines


def render_spec(doc: dict) -> str:
    rows = []
    many_temperatures = len(doc.get("temperatures", [0])) > 1 or doc.get("temperatures", [0]) != [0]
    for r in doc["runs"]:
        pred = "-" if r["predicted_speedup"] is None else f"{r['predicted_speedup']:.2f}"
        err = ("" if r["predicted_speedup"] is None
               else f"{r['predicted_speedup'] / r['measured_speedup'] - 1:+.0%}")
        rows.append([str(r["batch"]), *([f"{r['temperature']:g}"] if many_temperatures else []),
                     str(r["gamma"]), str(r["gamma"] + 1), num(r["alpha"], ".2f"),
                     num(r.get("mean_accepted"), ".2f"), r["mode"],
                     f"{r['tokens_per_s_plain']:.1f}", f"{r['tokens_per_s_sd']:.1f}",
                     measured_speedup(r), pred, err, rollback_cell(r)])
    prompts = doc.get("prompts") or {}
    where = (f"prompts '{prompts['name']}' ({prompts['count']}, {prompts['encoding']}, "
             f"{prompts['tokens'][0]}-{prompts['tokens'][1]} tokens)" if prompts.get("count")
             else f"context {doc['context']}")
    head = (f"{doc['target']} with drafter {doc['draft']}, {where}, "
            f"{doc['new_tokens']} tokens per sequence, median of {doc['runs'][0]['repeats']} runs; "
            "alpha solved from the mean accepted draft tokens per round unless imposed (emulated)")
    lines = [head, table(["B", *(["temp"] if many_temperatures else []), "gamma", "verify tokens",
                          "alpha", "accepted/round", "mode", "plain tok/s", "SD tok/s", "measured S (range)",
                          "predicted S", "pred/meas", "rollback"], rows)]
    lines += lookup_lines(doc)
    lines += invalid_lines(doc)
    checks = [r["greedy_check"] for r in doc["runs"] if "greedy_check" in r]
    checks += [a["greedy_check"] for a in doc.get("acceptance", []) if "greedy_check" in a]
    if checks:
        mismatched = sum(c["mismatched"] for c in checks)
        sequences = sum(c["sequences"] for c in checks)
        unexplained = sum(1 for c in checks for tie in c.get("near_tie", []) if not tie)
        why = ("" if mismatched == 0 else " (all at float near-ties)" if unexplained == 0
               else f" ({unexplained} not at a near-tie: the SD output is wrong)")
        lines.append(f"temperature 0: SD output differs from greedy in {mismatched} of {sequences} "
                     f"sequences{why}")
    if doc.get("acceptance"):
        lines += ["", "Acceptance on the prompt set (untimed, batch 1, every prompt on its own):"]
        acc_rows = []
        for a in doc["acceptance"]:
            shown = [(a["rule_run"], "measured", a["measured"])]
            shown += [(rule, "expected from p, q", stats) for rule, stats in a.get("rules", {}).items()]
            for rule, how, stats in shown:
                acc_rows.append([f"{a['temperature']:g}", str(a["gamma"]), rule, how,
                                 by_position(stats["acceptance_by_position"]),
                                 f"{stats['mean_accepted']:.2f}", f"{stats['sigma']:.2f}",
                                 num(stats["alpha"], ".2f")])
        lines.append(table(["temp", "gamma", "rule", "how", "accepted by position", "accepted/round",
                            "sigma", "alpha"], acc_rows))
        for a in doc["acceptance"]:
            if "rules" in a:
                lines.append(f"temperature {a['temperature']:g}, gamma {a['gamma']}: exact rejection "
                             f"sampling would give {a['rejection_over_mlx_lm']:.2f}x mlx-lm's tokens "
                             "per round, hence its speedup at equal cost per round")
    return "\n".join(lines)


def render_compare(doc: dict) -> str:
    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    headers = ["machine", "backend", "source", "GB/s", "TFLOPS", "ridge FLOP/B",
               *[f"{m} S(1)" for m in doc["models"]]]
    rows = []
    for r in doc["machines"]:
        cells = [r["chip"], r["backend"], "measured" if r["measured"] else "published spec",
                 num(r["bandwidth_gbs"], ".1f"), num(r["tflops"], ".3g"), num(r["ridge_flop_per_byte"], ".1f")]
        for m in doc["models"]:
            s = r["speedup_batch1"].get(m)
            cells.append(f"{s['speedup']:.2f} (gamma={s['gamma']})" if s else "-")
        rows.append(cells)
    note = (f"S(1): predicted SD speedup at batch 1 for the best gamma, alpha={doc['alpha']}. "
            "Figures: " + ", ".join(doc["figures"].values()))
    shares = [(r["chip"], m, v) for r in doc["machines"] for m, v in r.get("comm_share_verify", {}).items()]
    if shares:
        note += "\ncommunication share of a batch-1 verify forward (gamma=4): " + "; ".join(
            f"{chip}, {m}: {v:.1%}" for chip, m, v in shares)
    return table(headers, rows) + "\n" + note


def render_plan(doc: dict) -> str:
    """The dry run: one line per stage, peak memory against usable, and the ETA."""
    machines = f"{doc['ranks']} x " if doc.get("ranks") else ""
    per = " each" if doc.get("ranks") else ""
    width = max([28] + [len(s["stage"]) for s in doc["stages"]])
    lines = [
        f"{machines}{doc['chip']} ({doc['backend']}, {doc['dtype']}"
        + (f", {doc['bits']}-bit" if doc["bits"] else "") + f"): memory {gib(doc['memory_bytes'])}{per}, "
        f"usable {gib(doc['usable_bytes'])}{per}",
        f"rates: {doc['rates']['bandwidth_bytes_s'] / 1e9:.0f} GB/s, {doc['rates']['flops'] / 1e12:.2f} "
        f"TFLOP/s ({doc['rates']['source']})",
        f"{'stage':<{width}} {'layers':>9} {'peak':>10} {'fits':>5} {'eta':>8}",
    ]
    for s in doc["stages"]:
        layers = "-"
        if s.get("layers"):
            layers = "+".join(str(n) for n in s["layers"]) + f"/{s['layers_full']}"
        if "skipped" in s:
            lines.append(f"{s['stage']:<{width}} skipped: {s['skipped']}")
            continue
        lines.append(f"{s['stage']:<{width}} {layers:>9} {gib(s['peak_bytes']):>10} "
                     f"{'yes' if s['fits'] else 'NO':>5} {s['eta_s']:>7.0f}s")
        if "alpha_assumed" in s:
            lines.append(f"  acceptance pass over {s['acceptance_prompts']} prompts per gamma and temperature; "
                         f"ETA at alpha {s['alpha_assumed']:g} (unknown before the run)")
        if "alpha_imposed" in s:
            lines.append(f"  an emulated MTP head, acceptance imposed at {s['alpha_imposed']:g}")
        if s.get("assumes"):
            lines.append(f"  ETA assumes {s['assumes']}")
        for r in s.get("ranks", []):
            lines.append(f"  rank {r['rank']}: {r['layers']} layers, weights {gib(r['weights_bytes'])}, "
                         f"peak {gib(r['peak_bytes'])} ({r['phase']})")
        if s.get("comm_share_batch1"):
            shares = ", ".join(f"t={t}: {v:.1%}" for t, v in s["comm_share_batch1"].items())
            lines.append(f"  link time per batch-1 forward (bandwidth only): {shares}")
    if doc.get("ranks"):
        lines.append(f"{doc['parallel']} parallel over {doc['ranks']} machines; link "
                     f"{doc['link']['gbps']:g} Gb/s ({doc['link']['source']}); whole model: "
                     + ", ".join(f"{m} {gib(b)}" for m, b in doc["whole_model_bytes"].items()))
    lines.append(f"total ETA {doc['eta_s']:.0f} s ({doc['eta_s'] / 60:.1f} min); "
                 f"not estimated: {', '.join(doc['not_estimated'])}")
    return "\n".join(lines)


def _document_name(section: str, doc: dict) -> str | None:
    """What a stage document measured, as the report names it (None: not a timing)."""
    if section == "roofline":
        return "the roofline"
    if section == "sweeps":
        return f"the sweep of {doc.get('model')} ({doc.get('layers')} layers, context {doc.get('context')})"
    if section == "draft":
        return f"the drafter step of {doc.get('model')}"
    if section == "reject":
        return "the rejection-sampling step"
    if section == "routing":
        return f"the routing of {doc.get('model')} on {doc.get('text')}"
    if section == "spec":
        return f"measured SD of {doc.get('target')} with {doc.get('draft')} on {doc.get('prompts', {}).get('name')}"
    if section == "serving":
        return f"serving {doc.get('target_name') or doc.get('target')}"
    return None


def throttled_lines(data: dict) -> list[str]:
    """One line per stage document that records thermal pressure at "moderate" or above."""
    docs = [("roofline", data["roofline"])] if data.get("roofline") else []
    docs += [(section, doc) for section in ("sweeps", "draft", "reject", "routing", "spec", "serving")
             for doc in data.get(section, {}).values()]
    lines = []
    for section, doc in docs:
        pressure, name = doc.get("thermal_pressure"), _document_name(section, doc)
        if name and pressure and any(thermal.throttled(pressure.get(k)) for k in ("before", "after")):
            lines.append(f"THROTTLED: {name} ran under thermal pressure ({pressure.get('before') or 'unknown'} "
                         f"before, {pressure.get('after') or 'unknown'} after): macOS slowed the chip, so its "
                         "timings are below this Mac's best. Let the Mac cool and measure it again.")
    return lines


def roofline_shrunk_line(shrunk: dict | None) -> str | None:
    """What ``roofline.fit_memory`` shrank to fit memory, or None when it ran as configured."""
    if not shrunk:
        return None
    was, now = shrunk["from"], shrunk["to"]
    changes = []
    if now["sizes_bytes"] != was["sizes_bytes"]:
        changes.append(f"STREAM arrays up to {human_bytes(max(now['sizes_bytes']))} (not {human_bytes(max(was['sizes_bytes']))})")
    if now["gemv_bytes"] != was["gemv_bytes"]:
        changes.append(f"a {human_bytes(now['gemv_bytes'])} GEMV weight (not {human_bytes(was['gemv_bytes'])})")
    if now["min_launch_bytes"] != was["min_launch_bytes"]:
        changes.append(f"launch outputs of at least {human_bytes(now['min_launch_bytes'])} per timed eval "
                       f"(not {human_bytes(was['min_launch_bytes'])})")
    line = (f"Shrunk to fit memory: the configured roofline peaks at {human_bytes(was['peak_bytes'])} and "
            f"{human_bytes(shrunk['usable_bytes'])} was usable, so it ran with " + ", ".join(changes)
            + f", peaking at {human_bytes(now['peak_bytes'])}.")
    if not shrunk["plateau_reached"]:
        line += (" No STREAM size reached the plateau past the caches: the bandwidth is that of the "
                 "largest size that fit, and may be a cache's.")
    return line
