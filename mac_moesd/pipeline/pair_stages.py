"""`mac-moesd run --target MODEL --draft MODEL`: the whole pipeline on the user's own pair, as a
list of stages handed to the runner.

The target and drafter run with their weights as stored (quantized or not). Stages: the roofline,
routing of the target on each prompt set with its own tokenizer (a trace of the captured indices
saved beside the results), the target's T_T(B,t) sweep replaying those traces (so the grid reads
the experts the prompts make the target read, as the SD runs do) with the drafter's T_D(B,1),
the fit, and SD measured in real mode per prompt set at temperatures 0 and 1: batch 1 with
mlx-lm's ``speculative_generate_step``, larger batches with the suite's loop driven by the
drafter (and, with ``--serving``, mlx_lm.server on the pair). The report then gives the verdict
for this pair. Resumable and isolated stage by stage, as `run` (``runner.run_stages``).

Without --target, a GPU run first looks in the Hugging Face cache for a known pair
(``plans.find_default_pair``) that fits in memory.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from mac_moesd.analysis import fit
from mac_moesd.errors import BadInput, MacMoesdError
from mac_moesd.inputs import models
from mac_moesd.measure.experts import routing, routing_control, routing_trace
from mac_moesd.measure.forward import sweep
from mac_moesd.measure.sd import speedup
from mac_moesd.pipeline import estimate
from mac_moesd.pipeline.plans import PairPlan
from mac_moesd.pipeline.runner import Context, Outcome, Stage, run_stages
from mac_moesd.pipeline.stages import roofline_stage, sweep_config
from mac_moesd.progress import Progress
from mac_moesd.results import ResultsStore, keys, pair_key, pair_spec_key

__all__ = ["as_swept", "pair_stages", "run_pair", "sweep_routing"]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "pair"


def trace_path(folder: Path, target: str, prompt_set: str) -> Path:
    """Where the routing trace of ``target`` on ``prompt_set`` is saved, beside results.json."""
    return folder / "traces" / f"{_slug(target)}-{_slug(Path(prompt_set).stem)}.npz"


def prompts_trace_path(folder: Path, target: str, prompt_sets: list[str]) -> Path:
    """Where the interleaved trace of several prompt sets is saved ('+' is never in a slug, so it
    cannot be one set's trace)."""
    sets = "+".join(_slug(Path(p).stem) for p in prompt_sets)
    return folder / "traces" / f"{_slug(target)}-{sets}.npz"


def prompts_trace(store: ResultsStore, plan: PairPlan) -> tuple[Path, list[str]] | None:
    """The trace the pair's sweep replays, and the prompt sets in it; None when no routing stage
    saved one.

    One sweep and one fit serve every prompt set's SD runs, so the sweep replays all the sets'
    traces, interleaved (``routing_trace.interleave``): each set weighs alike in the grid, a
    batch's sequences mix the sets, and a batch up to the sets' prompts together replays a
    different prompt in every sequence (60 with the built-in sets: no default batch repeats a
    text). A lone set's trace is replayed as saved. The interleaved file is rewritten only when
    its indices change (a rerun finds the same file, so the same digest and the same results
    entry; a set routed since then makes a new one, measured as a new entry)."""
    routed = store.data.get("routing", {})
    docs = {p: routed.get(keys.routing_key(plan.target, keys.prompt_set_text(p))) or {} for p in plan.prompt_sets}
    saved = {p: Path(d["trace"]) for p, d in docs.items() if d.get("trace") and Path(d["trace"]).exists()}
    if len(saved) < 2:
        return next(((path, [p]) for p, path in saved.items()), None)
    sets, traces = list(saved), [routing_trace.load_trace(path) for path in saved.values()]
    indices = routing_trace.interleave(traces)
    path = prompts_trace_path(store.path.parent, plan.target, sets)
    if not (path.exists() and np.array_equal(routing_trace.load_trace(path).indices, indices)):
        routing_trace.save_trace(path, indices, traces[0].experts, traces[0].top_k, traces[0].model,
                                 f"prompt sets {', '.join(sets)}, interleaved",
                                 ", ".join(sorted({docs[p]["token_ids"] for p in sets})))
    return path, sets


def sweep_routing(store: ResultsStore, plan: PairPlan, drafters: tuple[str, ...] = ()) -> dict:
    """The routing the pair's sweep runs under, recorded in the pair's entry as ``sweep_routing``:
    ``routing`` (as ``sweep --routing`` takes it), ``key`` (as the sweep's results key names it),
    and for a trace the file (relative to the results), the prompt sets in it, its sequences and
    length and the most spans of one sequence the largest batch replays; for the model's own
    routing of random ids, ``why`` the prompts' routing could not be replayed. ``drafters``: the
    run's other drafters, whose entries share it."""
    batch, window = max(plan.base.batches), max(plan.base.tokens)
    found = prompts_trace(store, plan)
    record: dict[str, Any]
    if found is None:
        record = {"routing": "model", "key": "model",
                  "why": "no routing trace of the prompts is saved: their routing stages were skipped"}
    else:
        path, sets = found
        mode = routing_control.parse_routing(f"trace:{path}")
        trace = mode.trace
        assert trace is not None  # a trace: mode always loads its file
        if batch > routing_control.trace_capacity(trace, window):
            record = {"routing": "model", "key": "model",
                      "why": f"the prompts' trace holds {trace.sequences} sequences of {trace.length} tokens, "
                             f"too few for {batch} sequences of {window}"}
        else:
            record = {"routing": mode.label, "key": mode.key, "trace": f"traces/{path.name}",
                      "prompt_sets": sets, "sequences": trace.sequences, "length": trace.length,
                      "spans_per_sequence": routing_control.spans_per_sequence(trace, batch)}
    for draft in (plan.draft, *drafters):  # every drafter of the run shares the sweep
        store.data["pairs"][pair_key(plan.target, draft)]["sweep_routing"] = record
    store.save()
    return record


def as_swept(data: dict, plan: PairPlan) -> dict:
    """``data`` with only the target's sweeps under the routing this run's sweep used, for the fit
    and the SD stage: a sweep of an earlier run under another routing stays in the file (and
    the report) but would otherwise be found first. Unchanged where no routing is recorded."""
    record = data.get("pairs", {}).get(pair_key(plan.target, plan.draft), {}).get("sweep_routing")
    if record is None:
        return data
    def kept(key: str, entry: dict) -> bool:
        return entry["model"] != plan.target or keys.sweep_key_variant(key) == (record["key"], "mlx-lm")

    return {**data, "sweeps": {k: e for k, e in data.get("sweeps", {}).items() if kept(k, e)}}


def record_pair(store: ResultsStore, plan: PairPlan) -> None:
    """What this pair run measures, for the report's first lines (before any stage runs)."""
    stored = {"target": models.stored_format(plan.sources.target)}
    draft = plan.spec_sources.draft
    if draft is not None:
        stored["draft"] = models.stored_format(draft)
    store.put("pairs", pair_key(plan.target, plan.draft), {
        "target": plan.target, "draft": plan.draft, "drafter_kind": plan.drafter_kind,
        "target_arg": plan.target_arg, "draft_arg": plan.draft_arg, "found": plan.found,
        "prompt_sets": list(plan.prompt_sets), "temperatures": list(plan.temperatures),
        "acceptance_prompts": plan.max_prompts,
        "stored": stored,
        "context": plan.base.context, "spec_batches": list(plan.base.spec_batches),
        "spec_gammas": list(plan.base.spec_gammas),
    })


def _routing(plan: PairPlan, prompt_set: str) -> Stage:
    """Routing of the target on one prompt set, its trace saved beside the results."""
    key = keys.routing_key(plan.target, keys.prompt_set_text(prompt_set))
    label = f"routing {plan.target} on {prompt_set}"

    def work(ctx: Context) -> None:
        trace = trace_path(ctx.store.path.parent, plan.target, prompt_set)
        trace.parent.mkdir(exist_ok=True)
        cfg = routing.RoutingConfig(model=plan.target_arg, prompts=prompt_set, save_trace=trace,
                                    batches=plan.base.routing_batches, length=plan.routing_length)
        routing.run_routing(cfg, ctx.usable_bytes, ctx.store, plan.sources.target)

    return Stage(label, work, done=lambda data: key in data.get("routing", {}),
                 estimate=lambda sizing: estimate.routing_stage(plan.base, plan.target_arg, sizing, label,
                                                                plan.sources.target, prompt_set,
                                                                plan.routing_length),
                 models=(plan.target_arg,))


def _sweep(plan: PairPlan, drafters: tuple[str, ...] = ()) -> Stage:
    """The target's sweep under the prompts' routing (``sweep_routing``), with the drafter model's
    step where the run has one."""
    label = f"sweep {plan.target}"

    def work(ctx: Context) -> None:
        record = sweep_routing(ctx.store, plan, drafters)
        cfg = replace(sweep_config(plan.base, plan.target_arg), routing=record["routing"])
        sweep.run_sweep(cfg, ctx.store, ctx.usable_bytes, ctx.progress, sources=plan.sources)

    return Stage(label, work, models=(plan.target_arg,),
                 estimate=lambda sizing: {**estimate.sweep_stage(plan.base, plan.target_arg, sizing, plan.sources),
                                         "stage": label})


def fit_target(plan: PairPlan, store: ResultsStore) -> None:
    """The fit of the target's sweep with the run's drafter model's step (none: prompt lookup alone)."""
    inputs = fit.inputs_from_results(as_swept(store.data, plan), plan.target, draft_model=plan.draft_model,
                                     context=plan.base.context)
    fit.store_fit(store.data, plan.target, fit.fit_document(fit.fit(inputs)))
    store.save()


def _spec(plan: PairPlan, prompt_set: str) -> Stage:
    """SD on one prompt set, beside the fit's predictions: with the drafter's own tokens, or an
    MTP head's with acceptance imposed (``keys.PAIR_MODES``)."""
    kind = plan.drafter_kind
    key = pair_spec_key(plan.target, plan.draft, kind, prompt_set)

    def work(ctx: Context) -> None:
        data = ctx.store.data
        fitted = data.get("fits", {}).get(plan.target)
        if fitted is None:
            raise MacMoesdError(f"no fit of {plan.target}, so no predictions to set beside measured SD")
        speedup.require_valid(speedup.run_spec(plan.spec_config(prompt_set), fit.predictor_for(fitted, kind),
                                               ctx.usable_bytes, fit.sweep_plain_step(as_swept(data, plan), plan.target, plan.base.context),
                                               plan.spec_sources, ctx.store))

    label = f"spec {plan.target} on {prompt_set}" + {"prompt-lookup": " by prompt lookup",
                                                      "mtp-head": " by an MTP head"}.get(kind, "")
    return Stage(label, work, done=lambda data: speedup.stored_and_valid(data, key),
                 estimate=lambda sizing: {**estimate.pair_spec_stage(plan, prompt_set, sizing), "stage": label},
                 models=(plan.target_arg,) + ((plan.draft_arg,) if kind == "model" else ()))


def _serving(plan: PairPlan, template) -> Stage:
    """mlx_lm.server on the pair (``template``: the stage's ``serving_stage.ServingConfig``), kept
    once a complete serving document of the pair is in the results."""
    from mac_moesd.pipeline import serving_stage

    key = pair_key(plan.target, plan.draft)
    return Stage(f"serving {plan.target}",
                 lambda ctx: serving_stage.pair_stage(template, plan.target_arg, plan.draft_arg, plan.prompt_sets,
                                                      ctx.store, ctx.backend, ctx.progress.advance,
                                                      plan.spec_sources),
                 done=lambda data: bool(data.get("serving", {}).get(key, {}).get("complete")),
                 estimate=lambda sizing: serving_stage.dry_run_stage(
                     template, plan.target_arg, plan.draft_arg, plan.prompt_sets, sizing.backend,
                     sizing.rates.bandwidth_bytes_s, plan.spec_sources),
                 models=(plan.target_arg, plan.draft_arg))


def pair_stages(plans: PairPlan | list[PairPlan], serving=None) -> list[Stage]:
    """The stages of a pair run, in order (the report comes after them): of one target with one
    or several drafters (``plans``, one per drafter, sharing grids), the routing, sweep and fit
    once, SD per drafter and prompt set. ``serving``: the ``serving_stage.ServingConfig`` of a
    last stage measuring mlx_lm.server with the drafter model."""
    plans = [plans] if isinstance(plans, PairPlan) else plans
    first, others = plans[0], tuple(p.draft for p in plans[1:])
    served = [p for p in plans if p.drafter_kind == "model"]
    if serving and not served:
        raise BadInput("--serving measures mlx_lm.server with a drafter model (it has no prompt lookup): "
                       "name a drafter model in --draft too")
    return [roofline_stage(first.base), *[_routing(first, p) for p in first.prompt_sets], _sweep(first, others),
            Stage("fit", lambda ctx: fit_target(first, ctx.store)),
            *[_spec(plan, p) for plan in plans for p in plan.prompt_sets],
            *([_serving(served[0], serving)] if serving else [])]


def run_pair(plans: PairPlan | list[PairPlan], store: ResultsStore, machine, progress: Progress = Progress(), memory_limit_bytes: int | None = None, serving=None) -> Outcome:
    """Measure every missing stage of the pair run into ``store`` (``runner.run_stages``), after
    recording what it measures (one ``pairs`` entry per drafter)."""
    plans = [plans] if isinstance(plans, PairPlan) else plans
    stages = pair_stages(plans, serving)  # refuses what cannot run before anything is recorded
    for plan in plans:
        plan.sources.claim(store)  # another model of the same name is refused before any write
    for plan in plans:
        record_pair(store, plan)
    ctx = Context(store, machine.backend, machine.spec, Outcome(), progress)
    return run_stages(stages, ctx, memory_limit_bytes)
