"""`mac-moesd run`: every stage for the default models, resumable, ending in the report.

Stages: roofline, sweeps (each target with the drafter's T_D, and the dense control), routing of
each MoE, the fit, measured SD on the sparser MoE, and the report. Finished stages are kept in
results.json and skipped on a rerun; a sweep resumes point by point. Every document a stage
writes records the thermal pressure before and after the stage (``thermal_pressure``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Callable

from mac_moesd.analysis import fit
from mac_moesd.machine import hardware, memory, thermal
from mac_moesd.measure import roofline, routing, spec, sweep, timing
from mac_moesd.errors import BadInput, MacMoesdError
from mac_moesd.results import ResultsStore

__all__ = ["Outcome", "Plan", "default_plan", "run_all"]


@dataclass(frozen=True)
class Plan:
    moe: tuple[str, ...]  # sparse first
    dense: str | None  # the dense control; None in a pair run
    draft: str
    batches: tuple[int, ...]
    tokens: tuple[int, ...]
    context: int
    bits: int | None
    budget: timing.Budget
    roofline: roofline.RooflineConfig
    spec_batches: tuple[int, ...]
    spec_gammas: tuple[int, ...]
    spec_tokens: int
    spec_repeats: int  # the fewest (plain, SD) pairs per configuration
    routing_batches: tuple[int, ...]
    spec_budget_s: float = 120.0  # seconds per SD configuration to reach its precision

    @property
    def models(self) -> tuple[str, ...]:
        return (*self.moe, self.dense) if self.dense else self.moe


def default_plan(backend: str, quick: bool, full: bool = False) -> Plan:
    """On a GPU the zoo's real dimensions at 4-bit (sliced to fit); on MLX's CPU backend the
    CI-sized models, since a real-dimension forward there takes seconds."""
    if backend == "cpu":
        return Plan(
            moe=("tiny-moe", "tiny-moe-8x2"), dense="tiny-dense", draft="tiny-draft",
            batches=(1, 2, 4, 8), tokens=(1, 2, 3, 4, 6, 8), context=64, bits=None,
            budget=timing.QUICK if quick else timing.Budget(seconds_per_point=1.0),
            roofline=roofline.run_config(backend, quick),
            spec_batches=(1, 2, 4), spec_gammas=(2, 4), spec_tokens=32 if quick else 64,
            spec_repeats=8, routing_batches=(1, 2, 4, 8, 16, 32), spec_budget_s=30.0 if quick else 120.0,
        )
    # --quick fits about 6 minutes on an 8 GB M1 by the dry run's estimate (mac_moesd/plan.py):
    # the sparse MoE only, context 256, batches to 8 and two SD batch sizes; the less sparse MoE,
    # context 512, batch 16-32 and the full SD grid are the default run's.
    moe = ("qwen1.5-moe-a2.7b",) if quick else ("qwen1.5-moe-a2.7b", "mixtral-8x7b")
    if full:
        moe = ("qwen3-30b-a3b", "qwen1.5-moe-a2.7b", "olmoe-1b-7b", "deepseek-v2-lite", "mixtral-8x7b")
    return Plan(
        moe=moe, dense="qwen2.5-3b", draft="qwen2-0.5b",
        batches=(1, 2, 4, 8) if quick else (1, 2, 4, 8, 16, 32),
        tokens=(1, 2, 3, 4, 6, 8), context=256 if quick else 512, bits=4,
        budget=timing.QUICK if quick else timing.Budget(),
        roofline=roofline.run_config(backend, quick),
        spec_batches=(1, 4) if quick else (1, 2, 4, 8), spec_gammas=(2, 4),
        spec_tokens=32 if quick else 64, spec_repeats=8,
        routing_batches=(1, 2, 4, 8, 16, 32), spec_budget_s=30.0 if quick else 120.0,
    )


def with_models(plan: Plan, names: tuple[str, ...]) -> Plan:
    """Replace the default targets: MoE models in the given order, the first dense one as control."""
    from mac_moesd.inputs import models, zoo

    moe, dense = [], []
    for name in names:
        (moe if zoo.expert_shape(models.resolve(name).config) else dense).append(name)
    if not moe:
        raise BadInput("--models needs at least one MoE model")
    return replace(plan, moe=tuple(moe), dense=dense[0] if dense else plan.dense)


Stage = Callable[[str], None]

# What a stage may fail with and still leave the others to run: our own errors (does not fit,
# bad model), MLX's RuntimeError (a Metal command buffer that failed, an allocation refused) and
# MemoryError. Anything else is a bug and goes up.
STAGE_FAILURES = (MacMoesdError, RuntimeError, MemoryError)


@dataclass
class Outcome:
    """Which stages ran and which were skipped (with why), for the exit status and the report, and
    the warnings the stages raised (thermal pressure), for the command to print."""

    ran: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def warn(self, message: str | None) -> None:
        if message and message not in self.warnings:
            self.warnings.append(message)

    @property
    def exit_status(self) -> int:
        """0: every stage ran; 3: some were skipped (report written); 1: nothing was measured."""
        if not self.skipped:
            return 0
        measuring = [s for s in self.ran if s != "fit"]
        return 3 if measuring else 1


def isolated(store: ResultsStore, outcome: Outcome, label: str, work: Callable[[], None]) -> None:
    """Run one stage; a failure is recorded under ``skipped`` with its reason and the run goes on.

    On Metal the wired limit is set for the stage as mlx-lm sets it for generation, and
    MLX's buffer cache is emptied after every stage, so a freed model does not stay resident
    while the next one is built (unified memory is shared with macOS and the user's apps).
    Thermal pressure is read before and after, and recorded in what the stage wrote.
    """
    import mlx.core as mx

    before, seen = thermal.read(), _fingerprints(store.data)
    try:
        with hardware.measuring_stage():
            work()
    except STAGE_FAILURES as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if not isinstance(err, MacMoesdError):
            reason = f"{type(err).__name__}: {reason}"
        outcome.skipped[label] = reason
        store.put("skipped", label, reason)
    else:
        outcome.ran.append(label)
        if store.data.get("skipped", {}).pop(label, None) is not None:
            store.save()  # it ran this time: the earlier reason no longer applies
    finally:
        mx.clear_cache()
    record_thermal(store, outcome, label, seen, before, thermal.read())


# The sections whose entries stages write (results.py), besides the roofline's own document.
DOCUMENT_SECTIONS = ("sweeps", "draft", "reject", "routing", "fits", "spec", "serving")


def _documents(data: dict) -> dict[tuple, dict]:
    """Every stage document in ``data``, by where it is."""
    found = {("roofline",): data["roofline"]} if data.get("roofline") else {}
    for section in DOCUMENT_SECTIONS:
        found.update({(section, key): doc for key, doc in data.get(section, {}).items()})
    return found


def _fingerprints(data: dict) -> dict[tuple, str]:
    """Each stage document as JSON text: a stage wrote the documents whose text it changed (a
    sweep adds points to entries already there)."""
    return {where: json.dumps(doc, default=str) for where, doc in _documents(data).items()}


def record_thermal(store: ResultsStore, outcome: Outcome, label: str, seen: dict[tuple, str],
                   before: thermal.Reading, after: thermal.Reading) -> None:
    """``thermal_pressure`` {before, after} in every document the stage ``label`` wrote (those
    not in ``seen`` as they are now), and a warning when it ran throttled or when macOS did not
    tell its thermal pressure."""
    pressure = thermal.record(before, after)
    written = [doc for where, doc in _documents(store.data).items()
               if seen.get(where) != json.dumps(doc, default=str)]
    for doc in written:
        doc["thermal_pressure"] = pressure
    if written:
        store.save()
    outcome.warn(thermal.warning(label, pressure))
    for reading in (before, after):
        outcome.warn(thermal.unread_warning(reading))


def measure_roofline(plan: Plan, store: ResultsStore, spec_dict: dict | None, backend: str,
                     usable_bytes: int, advance: Callable[[str], None]) -> None:
    """The roofline stage, unless results already hold one; shrunk to fit ``usable_bytes``
    (``roofline.fit_memory``), as it says in its document."""
    if "roofline" in store.data:
        return
    cfg, shrunk = roofline.fit_memory(plan.roofline, usable_bytes)
    memory.start_stage()
    store.data["roofline"] = roofline.run_roofline(cfg, spec_dict, backend, advance,
                                                   usable_bytes=usable_bytes, shrunk=shrunk)
    store.save()


def sweep_config(plan: Plan, name: str) -> sweep.SweepConfig:
    """The sweep of ``name``: an MoE target with the drafter's T_D(B,1), a dense control without."""
    return sweep.SweepConfig(model=name, batches=plan.batches, tokens=plan.tokens, context=plan.context,
                             bits=plan.bits, budget=plan.budget,
                             draft=plan.draft if name in plan.moe else None)


def fit_targets(plan: Plan, store: ResultsStore, outcome: Outcome) -> None:
    """Fit every MoE target whose sweep ran; an error when none did."""
    fitted = []
    for name in plan.moe:
        if f"sweep {name}" in outcome.skipped:
            continue
        inputs = fit.inputs_from_results(store.data, name)
        store.data.setdefault("fits", {})[name] = fit.fit_document(fit.fit(inputs))
        fitted.append(name)
    store.save()
    if not fitted:
        raise MacMoesdError("no MoE sweep finished, so there is nothing to fit")


class StageProgress(sweep.Progress):
    """A sweep's points reported to the run's ``advance`` callback."""

    def __init__(self, advance: Callable[[str], None]):
        self._advance = advance

    def advance(self, label: str) -> None:
        self._advance(label)


def stage_labels(plan: Plan, serving: bool = False) -> list[str]:
    """The stages ``run_all`` runs, in order (the report comes after them)."""
    return ["roofline", *[f"sweep {m}" for m in plan.models], *[f"routing {m}" for m in plan.moe],
            "fit", f"spec {plan.moe[0]}", *(["serving"] if serving else [])]


def run_all(plan: Plan, store: ResultsStore, machine, spec_dict: dict | None,
            stage: Stage = lambda label: None, advance: Callable[[str], None] = lambda label: None,
            memory_limit: int | None = None, serving=None) -> Outcome:
    """Measure every missing stage into ``store`` (each saved as soon as it is done). A stage that
    fails is skipped with its reason; the stages after it still run. Each stage plans within the
    memory usable when it starts, capped by ``memory_limit`` bytes. With ``serving``, a serving
    stage is listed and skipped with why (the default models have random weights)."""
    data = store.data
    outcome = Outcome()

    def usable() -> int:
        return memory.usable(memory_limit).usable_bytes

    def run_stage(label: str, work: Callable[[], None]) -> None:
        stage(label)
        isolated(store, outcome, label, work)

    run_stage("roofline", lambda: measure_roofline(plan, store, spec_dict, machine.backend, usable(), advance))
    for name in plan.models:
        run_stage(f"sweep {name}", lambda cfg=sweep_config(plan, name): sweep.run_sweep(
            cfg, store, usable(), StageProgress(advance)))

    for name in plan.moe:
        def measure_routing(name=name) -> None:
            if any(k.startswith(f"{name}|") for k in data.get("routing", {})):
                return
            cfg = routing.RoutingConfig(model=name, batches=plan.routing_batches, bits=plan.bits)
            document = routing.run_routing(cfg, usable())
            store.put("routing", f"{document['model']}|{document['text']}", document)

        run_stage(f"routing {name}", measure_routing)

    run_stage("fit", lambda: fit_targets(plan, store, outcome))

    target = plan.moe[0]

    def measure_spec() -> None:
        key = f"{target}|{plan.draft}|emulated-acceptance"
        if key in data.get("spec", {}):
            return
        if target not in data.get("fits", {}):
            raise MacMoesdError(f"no fit of {target}, so no predictions to set beside measured SD")
        cfg = spec.SpecConfig(target=target, draft=plan.draft, batches=plan.spec_batches,
                              gammas=plan.spec_gammas, alphas=(0.7,), context=plan.context,
                              new_tokens=plan.spec_tokens, repeats=plan.spec_repeats,
                              budget_s=plan.spec_budget_s, bits=plan.bits)
        document = spec.run_spec(cfg, fit.speedup_predictor(data["fits"][target]), usable(),
                                 fit.sweep_plain_step(data, target))
        store.put("spec", key, document)

    run_stage(f"spec {target}", measure_spec)
    if serving is not None:
        from mac_moesd.measure import serving_stage

        run_stage("serving", serving_stage.random_weights_stage)
    return outcome
