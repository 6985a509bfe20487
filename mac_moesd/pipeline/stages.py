"""`mac-moesd run`: the stages for the default models, as a list handed to the runner.

Stages: roofline, sweeps (each target with the drafter's T_D, and the dense control), routing of
each MoE, the fit, measured SD on the sparser MoE (and, with ``--serving``, a serving stage that
random weights skip with why); the report comes after them. Finished stages are kept in
results.json and skipped on a rerun (``Stage.done``); a sweep resumes point by point. Every
document a stage writes records the thermal pressure before and after the stage
(``runner.isolated``).
"""

from __future__ import annotations

from typing import Mapping

from mac_moesd.analysis import fit, theory
from mac_moesd.errors import MacMoesdError
from mac_moesd.inputs import models
from mac_moesd.machine import memory
from mac_moesd.measure.experts import routing
from mac_moesd.measure.forward import sweep
from mac_moesd.measure.peaks import roofline
from mac_moesd.measure.sd import speedup
from mac_moesd.pipeline import estimate
from mac_moesd.pipeline.plans import Plan, resolve_plan
from mac_moesd.pipeline.runner import Context, Outcome, Stage, run_stages
from mac_moesd.progress import Progress
from mac_moesd.results import ResultsStore, keys

__all__ = ["default_stages", "roofline_stage", "run_all", "sweep_config"]

Resolved = Mapping[str, models.ModelSource]  # a plan's models by argument, as resolve_plan found them


def roofline_stage(plan: Plan) -> Stage:
    """The roofline, shrunk to fit the memory usable (``roofline.fit_memory``), as it says in its
    document; kept when results already hold one."""
    def work(ctx: Context) -> None:
        cfg, shrunk = roofline.fit_memory(plan.roofline, ctx.usable_bytes)
        memory.start_stage()
        roofline.run_roofline(cfg, ctx.chip_spec, ctx.backend, ctx.progress.advance,
                              usable_bytes=ctx.usable_bytes, shrunk=shrunk, store=ctx.store)

    # run_roofline sets the device state itself, to record it in its document
    return Stage("roofline", work, done=lambda data: "roofline" in data,
                 estimate=lambda sizing: estimate.roofline_stage(plan, sizing), device_state=False)


def sweep_config(plan: Plan, name: str) -> sweep.SweepConfig:
    """The sweep of ``name``: an MoE target with the drafter's T_D(B,1), a dense control without."""
    return sweep.SweepConfig(model=name, batches=plan.batches, tokens=plan.tokens, context=plan.context,
                             bits=plan.bits, budget=plan.budget,
                             draft=plan.draft if name in plan.moe else None)


def _sweep(plan: Plan, name: str, resolved: Resolved) -> Stage:
    cfg = sweep_config(plan, name)
    sources = models.Sources(resolved[name], resolved[cfg.draft] if cfg.draft else None)
    return Stage(f"sweep {name}",
                 lambda ctx: sweep.run_sweep(cfg, ctx.store, ctx.usable_bytes, ctx.progress, sources=sources),
                 estimate=lambda sizing: estimate.sweep_stage(plan, name, sizing, sources), models=(name,))


def _routing(plan: Plan, name: str, resolved: Resolved) -> Stage:
    """Routing of random ids through ``name``, kept once any routing of it is in the results."""
    def work(ctx: Context) -> None:
        cfg = routing.RoutingConfig(model=name, batches=plan.routing_batches, bits=plan.bits)
        routing.run_routing(cfg, ctx.usable_bytes, ctx.store, resolved[name])

    label, stored_as = f"routing {name}", resolved[name].name  # results are keyed by the resolved name
    return Stage(label, work, done=lambda data: any(keys.routing_key_model(k) == stored_as
                                                    for k in data.get("routing", {})),
                 estimate=lambda sizing: estimate.routing_stage(plan, name, sizing, label, resolved[name]),
                 models=(name,))


def fit_targets(plan: Plan, resolved: Resolved, store: ResultsStore, outcome: Outcome) -> None:
    """Fit every MoE target whose sweep ran, under the name its sweep is stored by (a folder's
    or a zoo model's own name, not the argument that named it); an error when none did."""
    fitted = []
    draft_model = resolved[plan.draft].name if plan.draft else None
    for name in plan.moe:
        if f"sweep {name}" in outcome.skipped:
            continue
        model = resolved[name].name
        # This run's sweep and drafter, not whichever an earlier run into the same folder stored first.
        inputs = fit.inputs_from_results(store.data, model, draft_model=draft_model, context=plan.context)
        fit.store_fit(store.data, model, fit.fit_document(fit.fit(inputs)))
        fitted.append(model)
    store.save()
    if not fitted:
        raise MacMoesdError("no MoE sweep finished, so there is nothing to fit")


def _spec(plan: Plan, resolved: Resolved) -> Stage:
    """Emulated-acceptance SD on the sparser MoE, beside the fit's predictions."""
    target, draft = plan.moe[0], plan.draft
    assert draft is not None  # a zoo plan always has its drafter model
    sources = models.Sources(resolved[target], resolved[draft])
    pair = (sources.target.name, resolved[draft].name, "emulated-acceptance")

    def done(data: dict) -> bool:
        """SD of the pair is stored, valid: on random ids, or on the prompts a model with weights
        decodes (the key says which)."""
        return any(keys.spec_key_parts(key)[:3] == pair and speedup.stored_and_valid(data, key)
                   for key in data.get("spec", {}))

    def work(ctx: Context) -> None:
        data, fitted = ctx.store.data, sources.target.name  # fits are stored by the resolved name
        if fitted not in data.get("fits", {}):
            raise MacMoesdError(f"no fit of {target}, so no predictions to set beside measured SD")
        cfg = speedup.SpecConfig(target=target, draft=draft, batches=plan.spec_batches,
                              gammas=plan.spec_gammas, alphas=(theory.DEFAULT_ALPHA,), context=plan.context,
                              new_tokens=plan.spec_tokens, repeats=plan.spec_repeats,
                              budget_s=plan.spec_budget_s, bits=plan.bits, rollback=plan.rollback,
                              stop_when_decided=plan.spec_stop_when_decided)
        speedup.require_valid(speedup.run_spec(cfg, fit.speedup_predictor(data["fits"][fitted]), ctx.usable_bytes,
                                               fit.sweep_plain_step(data, fitted, plan.context), sources, ctx.store))

    return Stage(f"spec {target}", work, done=done,
                 estimate=lambda sizing: estimate.spec_stage(plan, sizing, sources), models=(target, draft))


def _random_weights_serving() -> Stage:
    """Listed so the report says why it is missing: the zoo's models have random weights."""
    from mac_moesd.pipeline import serving_stage

    return Stage("serving", lambda ctx: serving_stage.random_weights_stage(),
                 estimate=lambda sizing: serving_stage.random_weights_stage())


def default_stages(plan: Plan, serving: bool = False) -> list[Stage]:
    """The stages of `run` on ``plan``, in order (the report comes after them); its models are
    resolved here, once, and every stage measures those."""
    resolved = resolve_plan(plan)
    return [roofline_stage(plan), *[_sweep(plan, m, resolved) for m in plan.models],
            *[_routing(plan, m, resolved) for m in plan.moe],
            Stage("fit", lambda ctx: fit_targets(plan, resolved, ctx.store, ctx.outcome)), _spec(plan, resolved),
            *([_random_weights_serving()] if serving else [])]


def run_all(plan: Plan, store: ResultsStore, machine, progress: Progress = Progress(), memory_limit_bytes: int | None = None, serving: bool = False) -> Outcome:
    """Measure every missing stage of ``plan`` into ``store`` (``runner.run_stages``); with
    ``serving``, a serving stage is listed and skipped with why (the default models have random
    weights)."""
    stages = default_stages(plan, serving)
    for source in resolve_plan(plan).values():  # another model of the same name: refused before any write
        source.claim(store)
    ctx = Context(store, machine.backend, machine.spec, Outcome(), progress)
    return run_stages(stages, ctx, memory_limit_bytes)
