"""`mac-moesd run --target MODEL --draft MODEL`: the whole pipeline on the user's own pair.

The target and drafter run with their weights as stored (quantized or not). Stages: the roofline,
routing of the target on each prompt set with its own tokenizer (a trace of the captured indices
saved beside the results), the target's T_T(B,t) sweep replaying those traces (so the grid reads
the experts the prompts make the target read, as the SD runs do) with the drafter's T_D(B,1),
the fit, and SD measured in real mode per prompt set at temperatures 0 and 1: batch 1 with
mlx-lm's ``speculative_generate_step``, larger batches with the suite's loop driven by the
drafter. The report then gives the verdict for this pair. Resumable and isolated stage by stage,
as `run`.

Without --target, a GPU run first looks in the Hugging Face cache for a known pair
(``inputs/pairs.py``) that fits in memory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np

from mac_moesd import run as runner
from mac_moesd.analysis import fit
from mac_moesd.errors import BadInput, MacMoesdError
from mac_moesd.inputs import models, pairs, zoo
from mac_moesd.inputs.prompts import load_prompts
from mac_moesd.machine import memory
from mac_moesd.measure import routing, routing_control, routing_trace, spec, sweep
from mac_moesd.results import ResultsStore

__all__ = ["PairPlan", "as_swept", "find_default_pair", "pair_plan", "run_pair", "stage_labels", "sweep_routing"]

PROMPT_SETS = ("code", "chat")
TEMPERATURES = (0.0, 1.0)
QUICK_PROMPTS = 10


@dataclass(frozen=True)
class PairPlan:
    """A run of one target/drafter pair: the grids of ``base`` (its ``moe`` is the target argument
    alone, no dense control), the prompt sets and temperatures SD and routing run on. ``target``
    and ``draft`` are the models' names as results and the report key them."""

    base: runner.Plan
    target: str
    draft: str
    prompt_sets: tuple[str, ...] = PROMPT_SETS
    temperatures: tuple[float, ...] = TEMPERATURES
    routing_length: int = 16  # tokens per routed sequence, one per prompt: prompts are short
    found: str = "given on the command line"
    max_prompts: int | None = None  # prompts per set the acceptance pass decodes (None: all)

    @property
    def target_arg(self) -> str:
        return self.base.moe[0]

    @property
    def draft_arg(self) -> str:
        return self.base.draft


def pair_plan(backend: str, quick: bool, target: str, draft: str,
              prompt_sets: tuple[str, ...] = PROMPT_SETS, found: str = "given on the command line") -> PairPlan:
    """The default run's grids and budgets for this backend, on ``target`` with ``draft``, weights
    as stored (no quantization of our own). Refuses, before anything is built, a model without
    weights, a target that is not an MoE model and a prompt set that cannot be read. (Embedding
    tables padded to different sizes under one tokenizer are fine; the SD stage checks that both
    models tokenise the prompts alike.)"""
    target_source, draft_source = models.resolve(target), models.resolve(draft)
    for option, source in (("--target", target_source), ("--draft", draft_source)):
        if not source.has_weights:
            raise BadInput(f"{option} {source.name} has no weights here (no *.safetensors): a pair run "
                           "measures trained weights; `run --models` measures random-weight models")
    if zoo.expert_shape(target_source.config) is None:
        raise BadInput(f"--target {target} is not an MoE model (its config names no experts)")
    for prompt_set in prompt_sets:
        load_prompts(prompt_set)  # a missing or empty FILE is refused before anything runs
    base = runner.default_plan(backend, quick)
    base = replace(base, moe=(target,), dense=None, draft=draft, bits=None,
                   routing_batches=tuple(b for b in base.routing_batches if b <= 16))
    # --quick: the untimed acceptance pass decodes the first 10 prompts of each set (a third of
    # a built-in set); the timed runs still cycle through all of them.
    return PairPlan(base, target_source.name, draft_source.name, tuple(prompt_sets), found=found,
                    max_prompts=QUICK_PROMPTS if quick else None)


def stage_labels(plan: PairPlan, serving: bool = False) -> list[str]:
    """The stages ``run_pair`` runs, in order (the report comes after them)."""
    return (["roofline"] + [f"routing {plan.target} on {p}" for p in plan.prompt_sets]
            + [f"sweep {plan.target}", "fit"]
            + [f"spec {plan.target} on {p}" for p in plan.prompt_sets]
            + ([f"serving {plan.target}"] if serving else []))


def fits_in_memory(plan: runner.Plan, usable_bytes: int) -> Callable[[str, str], str | None]:
    """A check for ``pairs.find_cached_pair``: None when target and drafter, built lazily at full
    depth, fit the SD stage's peak (``memory.spec_estimate``) in ``usable_bytes``, else why not."""
    def check(target: str, draft: str) -> str | None:
        try:
            cfg = spec.SpecConfig(target=target, draft=draft, batches=plan.spec_batches,
                                  gammas=plan.spec_gammas, mode="real", context=plan.context,
                                  new_tokens=plan.spec_tokens, repeats=plan.spec_repeats)
            built_target = models.build(models.resolve(target))
            built_draft = models.build(models.resolve(draft))
        except (MacMoesdError, OSError, ValueError) as err:
            return f"cannot be opened: {err}"
        need = spec.estimate(cfg, built_target, built_draft)["peak_bytes"]
        if need > usable_bytes:
            return (f"needs about {memory.human(need)} for SD at full depth; "
                    f"{memory.human(usable_bytes)} is usable here")
        return None

    return check


def find_default_pair(backend: str, quick: bool, usable_bytes: int,
                      prompt_sets: tuple[str, ...] = PROMPT_SETS) -> tuple[PairPlan | None, pairs.Search]:
    """On a GPU backend, the plan for the first known pair cached and fitting in memory."""
    base = runner.default_plan(backend, quick)
    search = pairs.find_cached_pair(fits_in_memory(base, usable_bytes))
    if search.pair is None:
        return None, search
    plan = pair_plan(backend, quick, search.pair.target, search.pair.draft, prompt_sets,
                     found=f"found in the Hugging Face cache at {search.cache}")
    return plan, search


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
    docs = {p: routed.get(f"{plan.target}|{routing.prompts_label(p)}") or {} for p in plan.prompt_sets}
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


def sweep_routing(store: ResultsStore, plan: PairPlan) -> dict:
    """The routing the pair's sweep runs under, recorded in the pair's entry as ``sweep_routing``:
    ``routing`` (as ``sweep --routing`` takes it), ``key`` (as the sweep's results key names it),
    and for a trace the file (relative to the results), the prompt sets in it, its sequences and
    length and the most spans of one sequence the largest batch replays; for the model's own
    routing of random ids, ``why`` the prompts' routing could not be replayed."""
    batch, window = max(plan.base.batches), max(plan.base.tokens)
    found = prompts_trace(store, plan)
    if found is None:
        record = {"routing": "model", "key": "model",
                  "why": "no routing trace of the prompts is saved: their routing stages were skipped"}
    else:
        path, sets = found
        mode = routing_control.parse_routing(f"trace:{path}")
        trace = mode.trace
        if batch > routing_control.trace_capacity(trace, window):
            record = {"routing": "model", "key": "model",
                      "why": f"the prompts' trace holds {trace.sequences} sequences of {trace.length} tokens, "
                             f"too few for {batch} sequences of {window}"}
        else:
            record = {"routing": mode.label, "key": mode.key, "trace": f"traces/{path.name}",
                      "prompt_sets": sets, "sequences": trace.sequences, "length": trace.length,
                      "spans_per_sequence": routing_control.spans_per_sequence(trace, batch)}
    store.data["pairs"][f"{plan.target}|{plan.draft}"]["sweep_routing"] = record
    store.save()
    return record


def as_swept(data: dict, plan: PairPlan) -> dict:
    """``data`` with only the target's sweeps under the routing this run's sweep used, for the fit
    and the SD stage: a sweep of an earlier run under another routing stays in the file (and
    the report) but would otherwise be found first. Unchanged where no routing is recorded."""
    record = data.get("pairs", {}).get(f"{plan.target}|{plan.draft}", {}).get("sweep_routing")
    if record is None:
        return data
    wanted = "" if record["key"] == "model" else record["key"]

    def kept(key: str, entry: dict) -> bool:
        return entry["model"] != plan.target or ("|gather=" not in key and key.partition("|routing=")[2] == wanted)

    return {**data, "sweeps": {k: e for k, e in data.get("sweeps", {}).items() if kept(k, e)}}


def record_pair(store: ResultsStore, plan: PairPlan) -> None:
    """What this pair run measures, for the report's first lines (before any stage runs)."""
    store.put("pairs", f"{plan.target}|{plan.draft}", {
        "target": plan.target, "draft": plan.draft,
        "target_arg": plan.target_arg, "draft_arg": plan.draft_arg, "found": plan.found,
        "prompt_sets": list(plan.prompt_sets), "temperatures": list(plan.temperatures),
        "acceptance_prompts": plan.max_prompts,
        "stored": {"target": models.stored_format(models.resolve(plan.target_arg)),
                   "draft": models.stored_format(models.resolve(plan.draft_arg))},
        "context": plan.base.context, "spec_batches": list(plan.base.spec_batches),
        "spec_gammas": list(plan.base.spec_gammas),
    })


def fit_target(plan: PairPlan, store: ResultsStore) -> None:
    """The fit of the target's sweep with this pair's drafter step."""
    inputs = fit.inputs_from_results(as_swept(store.data, plan), plan.target, draft_model=plan.draft)
    store.data.setdefault("fits", {})[plan.target] = fit.fit_document(fit.fit(inputs))
    store.save()


def run_pair(plan: PairPlan, store: ResultsStore, machine, spec_dict: dict | None,
             stage: runner.Stage = lambda label: None, advance: Callable[[str], None] = lambda label: None,
             memory_limit: int | None = None, serving=None) -> runner.Outcome:
    """Measure every missing stage of the pair into ``store``; a stage that fails is skipped with
    its reason and the stages after it still run (``run.isolated``). ``serving``: the
    ``serving_stage.ServingConfig`` of a last stage measuring mlx_lm.server on the pair."""
    base, data, outcome = plan.base, store.data, runner.Outcome()
    record_pair(store, plan)

    def usable() -> int:
        return memory.usable(memory_limit).usable_bytes

    def run_stage(label: str, work: Callable[[], None]) -> None:
        stage(label)
        runner.isolated(store, outcome, label, work)

    run_stage("roofline", lambda: runner.measure_roofline(base, store, spec_dict, machine.backend,
                                                          usable(), advance))
    for prompt_set in plan.prompt_sets:
        def measure_routing(prompt_set=prompt_set) -> None:
            key = f"{plan.target}|{routing.prompts_label(prompt_set)}"
            if key in data.get("routing", {}):
                return
            trace = trace_path(store.path.parent, plan.target, prompt_set)
            trace.parent.mkdir(exist_ok=True)
            cfg = routing.RoutingConfig(model=plan.target_arg, prompts=prompt_set, save_trace=trace,
                                        batches=base.routing_batches, length=plan.routing_length)
            store.put("routing", key, routing.run_routing(cfg, usable()))

        run_stage(f"routing {plan.target} on {prompt_set}", measure_routing)

    def measure_sweep() -> None:
        cfg = replace(runner.sweep_config(base, plan.target_arg), routing=sweep_routing(store, plan)["routing"])
        sweep.run_sweep(cfg, store, usable(), runner.StageProgress(advance))

    run_stage(f"sweep {plan.target}", measure_sweep)
    run_stage("fit", lambda: fit_target(plan, store))

    for prompt_set in plan.prompt_sets:
        def measure_spec(prompt_set=prompt_set) -> None:
            key = f"{plan.target}|{plan.draft}|real|{prompt_set}"
            if key in data.get("spec", {}):
                return
            fitted = data.get("fits", {}).get(plan.target)
            if fitted is None:
                raise MacMoesdError(f"no fit of {plan.target}, so no predictions to set beside measured SD")
            cfg = spec.SpecConfig(target=plan.target_arg, draft=plan.draft_arg, batches=base.spec_batches,
                                  gammas=base.spec_gammas, mode="real", context=base.context,
                                  new_tokens=base.spec_tokens, repeats=base.spec_repeats,
                                  budget_s=base.spec_budget_s, prompts=prompt_set,
                                  temperatures=plan.temperatures, max_prompts=plan.max_prompts)
            store.put("spec", key, spec.run_spec(cfg, fit.speedup_predictor(fitted), usable(),
                                                 fit.sweep_plain_step(as_swept(data, plan), plan.target)))

        run_stage(f"spec {plan.target} on {prompt_set}", measure_spec)
    if serving is not None:
        from mac_moesd.measure import serving_stage

        run_stage(f"serving {plan.target}", lambda: serving_stage.pair_stage(
            serving, plan.target_arg, plan.draft_arg, plan.prompt_sets, store, machine.backend, advance))
    return outcome
