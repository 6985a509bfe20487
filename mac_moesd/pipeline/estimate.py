"""`mac-moesd run --dry-run`: each stage's models, slices, grid, peak memory and duration, from
shapes and the chip's figures alone. Nothing is allocated: models are built lazily. The stages
are the run's own (``Stage.estimate``), in its order.

Durations are a roofline estimate: one forward of B x t tokens over L cached ones takes
max(bytes / bandwidth, FLOP / FLOPS), with bytes = dense weights + the experts N(B t) activates
under uniform routing + the KV cache read, and FLOP = 2 x active parameters x tokens + attention.
Each timed point then costs what the timer's budget rule makes of that time (warm-ups, then
samples until the budget is spent; the confidence-interval stop is assumed never to come early),
and prefills, model builds and SD runs are counted the same way.
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

from mac_moesd.machine import hardware, memory
from mac_moesd.inputs import models, zoo
from mac_moesd.measure.clock import timing
from mac_moesd.measure.experts import routing
from mac_moesd.measure.forward import draft_chain, sweep
from mac_moesd.measure.peaks import roofline
from mac_moesd.measure.sd import speedup
from mac_moesd.analysis import theory
from mac_moesd.errors import BadInput, MacMoesdError
from mac_moesd.inputs.prompts import load_prompts
from mac_moesd.pipeline.plans import PairPlan, Plan
from mac_moesd.results import schema

__all__ = ["Rates", "Sizing", "chip_rates", "dry_run", "parse_chip"]

# Apple's newest per-core FP32 figure (M2: 3.6 TFLOPS over 10 GPU cores, hardware.APPLE_CHIPS)
# stands in for chips without a published one (M3 and later), whose GPU cores are no slower.
_M2_PER_CORE = 3.6e12 / 10
PAIR_ALPHA = theory.DEFAULT_ALPHA  # a real pair's acceptance, unknown before it runs, for its SD stage's ETA
# The spread of per-pair speedups the SD stage's ETA assumes (unknown before it runs): the 95% CI
# of a median of n pairs is about +-1.96*1.2533*spread/sqrt(n) wide (the median's standard error
# for normal data), so a precision p takes n = (2.46*spread/p)^2 pairs, 17 at 5% and +-3%.
PAIR_SPREAD = 0.05
# What a quick run's SD ETA assumes: each configuration's answer decided by its fewest pairs, which
# with the order-statistic CI (at 8 pairs: their whole range) needs every pair more than 3% from 1.0
# on the same side. On this suite's CPU quick run (2026-12-07) 7 of 9 configurations decided, at 8-27
# pairs, and the 2 whose speedup lay within 5% of 1.0 ran to their 30 s budget.
SD_STOP_ASSUMED = ("each SD configuration stops at its fewest pairs, its answer decided "
                   "(one whose speedup lies within a few percent of 1.0 runs to its budget)")


@dataclass(frozen=True)
class Rates:
    bandwidth_bytes_s: float
    flops: float
    source: str


@dataclass(frozen=True)
class Sizing:
    """What a stage's estimate is made for: the backend (its dtype), the memory usable and the
    rates its durations come from."""

    backend: str
    usable_bytes: int
    rates: Rates

    @property
    def dtype(self) -> str:
        return "float16" if self.backend != "cpu" else "float32"


def parse_chip(text: str) -> schema.ChipSpec:
    """'Apple M3 Pro' (full-core tier) or 'Apple M3 Pro 18c' from the chip table."""
    match = re.fullmatch(r"\s*(.*?)(?:\s+(\d+)\s*c(?:ores?)?)?\s*", text, flags=re.IGNORECASE)
    # no match: a line break inside the name, which no chip of the table has
    name, cores = (match.group(1), match.group(2)) if match else (text, None)
    if not name.lower().startswith("apple"):
        name = f"Apple {name}"
    found = hardware.lookup_spec(name, int(cores) if cores else None)
    if found is None:
        known = sorted({f"{c['name']} {c['gpu_cores']}c" for c in hardware.APPLE_CHIPS})
        raise BadInput(f"unknown chip {text!r}; known: {', '.join(known)}")
    return found


def chip_rates(chip: schema.ChipSpec) -> Rates:
    if chip["fp32_flops"] is not None:
        return Rates(chip["bandwidth_bytes_s"], chip["fp32_flops"], f"{chip['name']} spec")
    return Rates(chip["bandwidth_bytes_s"], _M2_PER_CORE * chip["gpu_cores"],
                 f"{chip['name']} spec bandwidth; FLOPS from {chip['gpu_cores']} cores at M2's "
                 "published per-core rate (no figure published for this chip)")


def measured_rates(results: Path) -> Rates | None:
    """Bandwidth and FLOPS of a roofline already measured into ``results``."""
    try:
        roof = json.loads(results.read_text())["roofline"]
        flops = roof["flops_tflops"][roof["ridge_dtype"]] * 1e12
        return Rates(roof["bandwidth_ceiling_gbs"] * 1e9, flops, f"measured roofline in {results}")
    except (OSError, ValueError, KeyError, TypeError):
        return None


# ---- durations ----


def forward_seconds(built, rates: Rates, batch: int, tokens: int, context: int) -> float:
    fp = built.footprint
    config = built.config
    n = batch * tokens
    weight_bytes = fp["bytes_dense_streamed"]
    if fp["experts"]:
        weight_bytes += theory.activated_experts(n, fp["experts"], fp["top_k"]) * fp["bytes_per_expert"]
    shape = memory.cache_shape(built)  # of the layers this process runs (a pipeline stage: fewer)
    moved = weight_bytes + batch * shape.bytes(context)
    # attention over the context, in the layers that keep keys (a window's over at most its size)
    one_layer = memory.kv_bytes_per_slot(config, models.DTYPES[built.dtype].size)
    attended = (shape.bytes(context) - shape.state) / one_layer if one_layer else 0
    heads = config.get("num_attention_heads", 1)
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    flop = 2 * fp["params_active"] * n + 4 * n * heads * head_dim * attended
    return max(moved / rates.bandwidth_bytes_s, flop / rates.flops)


def point_seconds(t: float, budget: timing.Budget, untimed: float = 0.0, seconds: float | None = None) -> float:
    """What timing.measure spends on a point whose call takes ``t``: warm-ups, then visits of
    ``per_visit`` samples until min_repeats and the time budget (or max_repeats) are reached;
    ``untimed``: what each call runs before its clock starts (``timing.Point.before``), which
    counts in the budget; ``seconds``: the point's own budget (``timing.Point.seconds``)."""
    n = 0
    limit = seconds or budget.seconds_per_point
    while n < budget.min_repeats or (n < budget.max_repeats and n * (t + untimed) < limit):
        n += budget.per_visit
    return (budget.warmup + n) * (t + untimed)


def grid_point_seconds(t: float, budget: timing.Budget, tokens: int) -> float:
    """A sweep point of ``tokens`` new tokens is timed twice: one synchronous forward per sample,
    and a pipelined chain of ``sweep.pipelined_steps(tokens, budget)`` forwards per sample, for
    ``sweep.pipelined_seconds``."""
    return point_seconds(t, budget) + point_seconds(sweep.pipelined_steps(tokens, budget) * t, budget,
                                                    seconds=sweep.pipelined_seconds(tokens, budget))


def prefill_seconds(built, rates: Rates, batch: int, context: int) -> float:
    chunks = memory.prefill_forwards(context, sweep.PREFILL_CHUNK)
    return sum(forward_seconds(built, rates, batch, c, done + c)
               for done, c in zip([0, *_cumsum(chunks)], chunks))


def _cumsum(values):
    total, out = 0, []
    for v in values:
        total += v
        out.append(total)
    return out


def materialise_seconds(built, rates: Rates) -> float:
    """Random float32 init written, read for the cast, cast written and read for quantization,
    final weights written: 12 bytes per parameter plus the final bytes, at bandwidth."""
    return (12 * built.footprint["params_total"] + built.footprint["bytes_total"]) / rates.bandwidth_bytes_s


# ---- stages ----


def sweep_stage(plan: Plan, name: str, sizing: Sizing, sources: models.Sources) -> dict:
    """The sweep of ``name`` as ``sweep.run_sweep`` runs it: its slices, peak and duration
    (``sources``: ``name`` and its drafter as the command resolved them)."""
    dtype, usable, rates = sizing.dtype, sizing.usable_bytes, sizing.rates
    cfg = sweep.SweepConfig(model=name, batches=plan.batches, tokens=plan.tokens, context=plan.context,
                            dtype=dtype, bits=plan.bits, budget=plan.budget,
                            draft=plan.draft if name in plan.moe else None)
    source = sources.target
    cfg, _ = sweep.timed_config(source, cfg)  # as the sweep will run it
    slices = sweep.plan_layers(source, cfg, usable)
    peak, seconds, parts = 0, 0.0, []
    for layers in slices:
        built = models.build(source, dtype, plan.bits, layers)
        need = sweep.estimate(built, cfg)
        big = max(plan.batches)
        seconds += materialise_seconds(built, rates) + prefill_seconds(built, rates, big, plan.context)
        seconds += sum(grid_point_seconds(forward_seconds(built, rates, b, t, plan.context), plan.budget, t)
                       for b in plan.batches for t in plan.tokens)
        if cfg.second_context:  # the one-token points again at the second context
            seconds += sum(point_seconds(forward_seconds(built, rates, b, min(plan.tokens), cfg.second_context),
                                         plan.budget) for b in plan.batches)
        first = forward_seconds(built, rates, plan.batches[0], plan.tokens[0], plan.context)
        seconds += point_seconds(first, plan.budget)  # the drift check
        peak = max(peak, need["peak_bytes"])
        parts.append({"layers": layers, "peak_bytes": need["peak_bytes"], "phase": need["phase"]})
    models_used = [name]
    if cfg.draft:
        assert sources.draft is not None  # resolved with cfg.draft
        draft_cfg = sweep.draft_config(cfg)
        draft = models.build(sources.draft, dtype, plan.bits)
        need = sweep.estimate(draft, draft_cfg)
        peak = max(peak, need["peak_bytes"])
        seconds += materialise_seconds(draft, rates) + prefill_seconds(draft, rates, max(plan.batches), plan.context)
        seconds += sum(grid_point_seconds(forward_seconds(draft, rates, b, 1, plan.context), plan.budget, 1)
                       for b in plan.batches)
        models_used.append(cfg.draft)
        last = models.build(source, dtype, plan.bits, slices[-1])  # as sweep.measure_chains_with
        together = sweep.chains_bytes(last, draft, cfg)
        if usable is None or together <= usable:
            seconds += _chain_seconds(last, draft, rates, plan, cfg.gamma)
            peak = max(peak, together)
    vocab = source.config["vocab_size"]
    peak = max(peak, memory.rejection_bytes(vocab, max(plan.batches), cfg.gamma))
    seconds += sum(point_seconds(memory.rejection_bytes(vocab, b, cfg.gamma) / rates.bandwidth_bytes_s,
                                 plan.budget) for b in plan.batches)
    # Beside it, the SD loop's empty round: a read of the verify's logits at each batch.
    seconds += sum(point_seconds(memory.logits_bytes(source.config, b, cfg.gamma + 1) / rates.bandwidth_bytes_s,
                                 plan.budget) for b in plan.batches)
    full = int(source.config["num_hidden_layers"])
    return {"stage": f"sweep {name}", "models": models_used, "layers": slices, "layers_full": full,
            "extrapolated": len(slices) > 1, "grid": {"batch": list(plan.batches), "tokens": list(plan.tokens)},
            "context": plan.context, "slices": parts, "peak_bytes": peak, "eta_s": seconds}


def _chain_seconds(target, draft, rates: Rates, plan: Plan, gamma: int) -> float:
    """The drafter's chains after a verify (``draft_chain``): both models prefilled again, then
    each chain timed after an untimed verify of the target (whole, or its larger slice)."""
    big, context = max(plan.batches), plan.context
    seconds = (materialise_seconds(draft, rates) + prefill_seconds(target, rates, big, context)
               + prefill_seconds(draft, rates, big, context))
    return seconds + sum(point_seconds(g * forward_seconds(draft, rates, b, 1, context), plan.budget,
                                       untimed=forward_seconds(target, rates, b, g + 1, context))
                         for b in plan.batches for g in draft_chain.chain_gammas(gamma))


def routing_stage(plan: Plan, name: str, sizing: Sizing, label: str, source: models.ModelSource,
                  prompts: str | None = None, length: int | None = None) -> dict:
    """Routing on random ids, or on a prompt set (one sequence of ``length`` tokens per prompt);
    ``source``: ``name`` as the command resolved it."""
    dtype, usable, rates = sizing.dtype, sizing.usable_bytes, sizing.rates
    cfg = routing.RoutingConfig(model=name, batches=plan.routing_batches, bits=plan.bits)
    if length:
        cfg = replace(cfg, length=length)
    sequences = len(load_prompts(prompts).prompts) if prompts else 2 * max(cfg.batches)
    build = functools.lru_cache(maxsize=None)(lambda layers: models.build(source, dtype, plan.bits, layers))
    built = build(zoo.largest_slice(
        int(source.config["num_hidden_layers"]), zoo.slice_unit(source.config),
        lambda n: memory.routing_estimate(build(n), sequences, cfg.length)["peak_bytes"] <= usable))
    need = memory.routing_estimate(built, sequences, cfg.length)
    seconds = materialise_seconds(built, rates) + forward_seconds(built, rates, sequences, cfg.length, cfg.length)
    return {"stage": label, "models": [name], "layers": [built.layers],
            "layers_full": built.layers_full, "grid": {"batch": list(cfg.batches), "tokens": list(cfg.tokens)},
            "context": cfg.length, "peak_bytes": need["peak_bytes"], "fits": need["peak_bytes"] <= usable,
            "eta_s": seconds}


def spec_stage(plan: Plan, sizing: Sizing, sources: models.Sources) -> dict:
    """Emulated-acceptance SD on the sparser MoE, every configuration to its precision
    (``sources``: target and drafter as the command resolved them)."""
    dtype, usable, rates = sizing.dtype, sizing.usable_bytes, sizing.rates
    target = plan.moe[0]
    assert plan.draft is not None  # a zoo plan always has its drafter model
    cfg = speedup.SpecConfig(target=target, draft=plan.draft, batches=plan.spec_batches, gammas=plan.spec_gammas,
                          alphas=(theory.DEFAULT_ALPHA,), context=plan.context, new_tokens=plan.spec_tokens,
                          repeats=plan.spec_repeats, budget_s=plan.spec_budget_s, bits=plan.bits,
                          stop_when_decided=plan.spec_stop_when_decided)
    t, d, need = speedup.plan_models(cfg, usable, dtype, sources=sources)
    seconds = materialise_seconds(t, rates) + materialise_seconds(d, rates)
    for batch in cfg.batches:
        seconds += _prefills(t, d, rates, batch, cfg.context)
        for alpha in cfg.alphas:
            # the gammas asked for, and one more where the fit recommends another
            for gamma in (*cfg.gammas, max(cfg.gammas)):
                seconds += _configuration_seconds(cfg, *_decodes(t, d, rates, batch, gamma, alpha, cfg))
    return {"stage": f"spec {target}", "models": [target, plan.draft],
            "layers": [t.layers], "layers_full": t.layers_full, "draft_layers": d.layers,
            "grid": {"batch": list(cfg.batches), "gamma": list(cfg.gammas), "alpha": list(cfg.alphas)},
            "context": cfg.context, "peak_bytes": need["peak_bytes"], "eta_s": seconds,
            **({"assumes": SD_STOP_ASSUMED} if cfg.stop_when_decided else {})}


def _configuration_seconds(cfg: speedup.SpecConfig, plain: float, sd: float, prefill: float = 0.0) -> float:
    """One SD configuration as ``speedup.paired`` runs it: a warm-up pair, then pairs (each with a
    prefill where ``prefill``) until the precision is expected to be met (``PAIR_SPREAD``), or
    (a quick run, ``stop_when_decided``) ``repeats`` pairs, assuming the answer is decided by
    then (``SD_STOP_ASSUMED``), at least ``repeats`` and at most the budget; the round's parts
    timed after each pair cost about one more SD run, and so does each sample of them a
    configuration measured to its precision takes after its pairs (``Precision.parts_samples``)."""
    precision = speedup.Precision.of(cfg)
    pairs = (cfg.repeats if cfg.stop_when_decided
             else max(cfg.repeats, math.ceil((1.96 * 1.2533 * PAIR_SPREAD / cfg.precision) ** 2)))
    each = plain + 2 * sd + prefill
    parts_after = max(precision.parts_samples - pairs, 0) * sd
    return plain + sd + min(pairs * each + parts_after, max(cfg.budget_s, cfg.repeats * each))


def _prefills(t, d, rates: Rates, batch: int, context: int) -> float:
    """Both models' prefill (``d`` None: prompt lookup, no drafter model)."""
    return prefill_seconds(t, rates, batch, context) + (0.0 if d is None else prefill_seconds(d, rates, batch, context))


def _decodes(t, d, rates: Rates, batch: int, gamma: int, alpha: float, cfg: speedup.SpecConfig) -> tuple[float, float]:
    """Plain decode and SD of ``cfg.new_tokens`` tokens per sequence: (plain, SD) seconds; ``d``
    None: prompt lookup, whose drafting costs host time only (not counted), or an MTP head, one
    of the target's layers a step (its share of a target step)."""
    plain = cfg.new_tokens * forward_seconds(t, rates, batch, 1, cfg.context)
    rounds = math.ceil(cfg.new_tokens / float(theory.expected_tokens_per_round(alpha, gamma)))
    if d is not None:
        drafting = gamma * forward_seconds(d, rates, batch, 1, cfg.context)
    elif cfg.drafter_kind == "mtp-head":
        drafting = gamma * forward_seconds(t, rates, batch, 1, cfg.context) / t.layers
    else:
        drafting = 0.0
    sd = rounds * (drafting + forward_seconds(t, rates, batch, gamma + 1, cfg.context))
    return plain, sd


def pair_spec_stage(pair: PairPlan, prompt_set: str, sizing: Sizing) -> dict:
    """SD of a real pair on one prompt set, as ``speedup.run_spec`` runs it: the untimed acceptance
    pass (SD after each of its first ``max_prompts`` prompts, plain too at temperature 0 for the
    greedy check), then the timed runs (a prefill of the next prompts for each pair), at every
    temperature, over the prompts' mean length in tokens. Acceptance is unknown before the run:
    PAIR_ALPHA stands in (an MTP head's runs impose theirs, with no acceptance pass). A pair that
    fits only as slices is refused, as the run refuses it."""
    dtype, usable, rates = sizing.dtype, sizing.usable_bytes, sizing.rates
    cfg = pair.spec_config(prompt_set)
    modelless = pair.drafter_kind != "model"  # prompt lookup, or an MTP head on the target
    sources = pair.spec_sources
    ids = speedup.prompt_ids(cfg, sources.target, sources.draft).ids
    assert ids is not None  # the prompts are a set (spec_config), so random ids are refused
    t, d, need = speedup.plan_models(cfg, usable, dtype, context=max(map(len, ids)), sources=sources)
    if t.layers < t.layers_full:
        raise MacMoesdError(f"{pair.target} and its drafter fit only as slices of their layers, which a "
                            "real pair's SD run refuses")
    cfg = replace(cfg, context=round(sum(map(len, ids)) / len(ids)))
    passed = len(ids[: pair.max_prompts]) if cfg.mode == "real" else 0
    alpha = PAIR_ALPHA if cfg.mode == "real" else cfg.alphas[0]
    seconds = materialise_seconds(t, rates) + (0.0 if modelless else materialise_seconds(d, rates))
    for temperature in cfg.temperatures:
        for gamma in cfg.gammas:
            plain, sd = _decodes(t, d, rates, 1, gamma, alpha, cfg)
            seconds += passed * (_prefills(t, d, rates, 1, cfg.context) + sd + (plain if temperature == 0 else 0.0))
        for gamma in (*cfg.gammas, max(cfg.gammas)):  # and the fit's recommendation, if another
            for batch in cfg.batches:
                seconds += _configuration_seconds(cfg, *_decodes(t, d, rates, batch, gamma, alpha, cfg),
                                                  prefill=_prefills(t, d, rates, batch, cfg.context))
    return {"stage": f"spec {pair.target} on {prompt_set}",
            "models": [pair.target_arg] + ([] if modelless else [pair.draft_arg]),
            "layers": [t.layers], "layers_full": t.layers_full, "draft_layers": None if modelless else d.layers,
            "grid": {"batch": list(cfg.batches), "gamma": list(cfg.gammas),
                     "temperature": list(cfg.temperatures)},
            **({"acceptance_prompts": passed, "alpha_assumed": PAIR_ALPHA} if passed else {"alpha_imposed": alpha}),
            "context": cfg.context, "peak_bytes": need["peak_bytes"], "eta_s": seconds,
            **({"assumes": SD_STOP_ASSUMED} if cfg.stop_when_decided else {})}


def roofline_stage(plan: Plan, sizing: Sizing) -> dict:
    cfg, rates = plan.roofline, sizing.rates
    bw, fl, budget = rates.bandwidth_bytes_s, rates.flops, cfg.budget
    seconds = sum(point_seconds(moved * size / bw, budget) for size in cfg.sizes for moved in (1, 2, 3))
    seconds += 4 * point_seconds(cfg.gemv_bytes / bw, budget)
    seconds += len(cfg.dtypes) * point_seconds(2 * cfg.matmul_n ** 3 / fl, budget)
    out, inn = cfg.qmm_shape
    seconds += sum(point_seconds(max(out * inn * 0.6 / bw, 2 * t * out * inn / fl), budget)
                   for _ in (4, 8) for t in cfg.qmm_tokens)
    peak = roofline.memory_estimate(cfg)["peak_bytes"]
    return {"stage": "roofline", "models": [], "grid": {"sizes_bytes": list(cfg.sizes)},
            "peak_bytes": peak, "eta_s": seconds}


def guarded(label: str, models_listed: tuple[str, ...], estimate, *args) -> dict:
    """A stage the guards would refuse is listed as skipped, with their reason; it allocates
    nothing and takes no time."""
    try:
        return estimate(*args)
    except MacMoesdError as err:
        return {"stage": label, "models": list(models_listed), "peak_bytes": 0, "eta_s": 0.0, "skipped": str(err)}


def dry_run(stages: list, bits: int | None, backend: str, chip: str, memory_bytes: int | None,
            usable: memory.Usable, rates: Rates | None) -> dict:
    """Every stage of a run (``pipeline.runner.Stage``, in the run's order) with its peak estimate
    and its duration at ``rates``; the stages without an estimate are listed as not estimated."""
    if rates is None:
        raise BadInput("no bandwidth or FLOPS for this machine: run `mac-moesd roofline` first, "
                       "or give --chip")
    sizing = Sizing(backend, usable.usable_bytes, rates)
    planned = [guarded(s.label, s.models, s.estimate, sizing) for s in stages if s.estimate is not None]
    for s in planned:
        s["fits"] = s["peak_bytes"] <= sizing.usable_bytes
    return {
        "chip": chip, "backend": backend, "dtype": sizing.dtype, "bits": bits,
        "memory_bytes": memory_bytes, "usable_bytes": sizing.usable_bytes, "usable": usable.to_dict(),
        "rates": {"bandwidth_bytes_s": rates.bandwidth_bytes_s, "flops": rates.flops, "source": rates.source},
        "stages": planned, "eta_s": sum(s["eta_s"] for s in planned),
        "not_estimated": [s.label for s in stages if s.estimate is None] + ["report"],
    }
