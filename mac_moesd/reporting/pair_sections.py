"""The report's sections for a pair of the user's own (`run --target --draft`): what was measured,
the verdict, acceptance per prompt set and temperature, measured against predicted speedup, and
routing on the prompts. Blocks as ``report.py`` renders them (markdown and HTML from one list)."""

from __future__ import annotations

from mac_moesd.analysis import theory
from mac_moesd.analysis.digest import Digest, weight_format
from mac_moesd.measure.routing import prompts_label

__all__ = ["first_lines", "pair_blocks"]


def first_lines(d: Digest) -> list:
    """What the report is about, before anything else: the user's pair, or why random weights."""
    blocks = []
    for p in d.pairs:
        blocks.append(("note", f"Your pair: target **{p['target']}** with drafter **{p['draft']}** "
                       f"({p['found']}), real weights as stored; SD measured on the prompt sets "
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


def _human_bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _params(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def _measured(d: Digest, p: dict) -> list:
    rows = []
    target = d.model(p["target"])
    if target is not None:
        fp = target.footprint
        rows.append(["target", p["target"], p["target_arg"], target.weight_format,
                     f"{fp['experts']} experts, top-{fp['top_k']}", str(target.full["layers_full"]),
                     f"{_params(fp['params_total'])} ({_params(fp['params_active'])} active)",
                     _human_bytes(fp["bytes_total"])])
    draft = d.draft_entry(p["draft"], p["context"])
    if draft is not None:
        fp = draft["footprint"]
        rows.append(["drafter", p["draft"], p["draft_arg"], weight_format(draft), "dense",
                     str(draft["layers_full"]), _params(fp["params_total"]), _human_bytes(fp["bytes_total"])])
    blocks = [("h3", "What was measured")]
    if rows:
        blocks.append(("table", ["role", "model", "from", "format", "experts", "layers", "parameters",
                                 "weights"], rows))
    blocks.append(("p", f"Prompt sets: {', '.join(p['prompt_sets'])}; temperatures "
                   f"{', '.join(f'{t:g}' for t in p['temperatures'])}; SD at batches "
                   f"{', '.join(map(str, p['spec_batches']))} with gamma "
                   f"{', '.join(map(str, p['spec_gammas']))} (batch 1 with mlx-lm's "
                   "`speculative_generate_step`, larger batches with the suite's loop driven by the "
                   f"drafter); the target's sweep at context {p['context']} over random token ids "
                   "(timing depends on the routing the ids cause; the routing on your prompts is "
                   "measured below)."))
    return blocks


def _routing(d: Digest, p: dict) -> list:
    docs = {s: r for s in p["prompt_sets"] for r in d.routing
            if r["model"] == p["target"] and r["text"] == prompts_label(s)}
    if not docs:
        return []
    rows = []
    for prompt_set, r in docs.items():
        rows.append([prompt_set, f"{r['sequences']} x {r['length']}", r["token_ids"],
                     f"{r['correlation']:.3f}", f"{r['batch_correlation']:.3f}",
                     str(r["threshold_corrected"]), str(r["threshold_uniform"]), r.get("trace", "-")])
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
                  "independent tokens. The traces hold the captured indices for routing-controlled "
                  "sweeps (`sweep --routing trace:FILE`).")]


def pair_blocks(d: Digest, figures: dict) -> list:
    """The pair sections, one group per measured pair."""
    blocks = []
    for p in d.pairs:
        blocks.append(("h2", f"Your pair: {p['target']} with {p['draft']}"))
        blocks += _measured(d, p)
        blocks += _routing(d, p)
    return blocks
