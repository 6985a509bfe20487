"""What each command of the command line does, once its options are parsed: one function per
command, returning the document that ``cli.py`` prints. Nothing here prints: warnings go to the
``warn`` callback and progress to a ``Progress`` (both drawn on stderr by the command line)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping

from mac_moesd.analysis import fit, theory
from mac_moesd.analysis.digest import prices_drafter
from mac_moesd.errors import BadInput, MacMoesdError
from mac_moesd.inputs import models
from mac_moesd.machine import blas, hardware, memory, metadata
from mac_moesd.measure.clock import timing
from mac_moesd.measure.experts import routing
from mac_moesd.measure.forward import sweep
from mac_moesd.measure.peaks import roofline
from mac_moesd.measure.sd import speedup
from mac_moesd.pipeline import selftest
from mac_moesd.pipeline import estimate, pair_stages, plans, stages
from mac_moesd.pipeline.runner import Outcome
from mac_moesd.progress import Progress
from mac_moesd.results import ResultsBusy, ResultsStore, WriterLock, load_results, validate, write_atomic

__all__ = ["RunOptions", "RunResult", "budget_from", "check_machine", "cluster_sweep", "compare", "dry_run",
           "fit_results", "info", "open_store", "report", "run", "run_roofline", "run_routing", "run_serving",
           "run_spec", "run_sweep", "stored_predictor", "usable_memory"]

Warn = Callable[[str], None]


def usable_memory(limit_gib: float | None) -> memory.Usable:
    """Usable memory now (the smaller of the ceiling and free memory, less a margin), capped."""
    return memory.usable(memory.limit_bytes(limit_gib))


def open_store(out: Path | None, warn: Warn,
               per_chip: bool = False) -> tuple[hardware.Machine, dict, ResultsStore]:
    """The machine, the run's metadata and the results store in ``out`` (default
    reports/<chip-slug>; with ``per_chip``, ``out``/<chip-slug>)."""
    machine = hardware.detect()
    meta = metadata.collect(machine)
    if meta["blas"]["warning"]:
        warn(meta["blas"]["warning"])
    for message in machine.warnings:
        warn(message)
    folder = (out or Path("reports")) / machine.slug if per_chip or out is None else out
    return machine, meta, ResultsStore(folder / "results.json", meta)


def _stored(document: Mapping[str, Any], meta: dict, store: ResultsStore) -> dict[str, Any]:
    return {**document, "meta": meta, "results_file": str(store.path)}


def info(warn: Warn) -> dict:
    """Chip, backend, memory, published specs and versions."""
    machine = hardware.detect()
    document = machine.to_dict()
    document["usable_memory"] = memory.usable(memory.limit_bytes(None)).to_dict()
    document["blas"] = blas.describe(machine.backend)
    document["versions"] = metadata.versions()
    for message in [document["blas"]["warning"], *machine.warnings]:
        if message:
            warn(message)
    return document


def budget_from(quick: bool, seconds: float | None, decode_chain: int | None = None) -> timing.Budget:
    budget = timing.QUICK if quick else timing.Budget()
    if seconds is not None:
        budget = replace(budget, seconds_per_point=seconds)
    return budget if decode_chain is None else replace(budget, decode_chain=decode_chain)


def run_sweep(cfg: sweep.SweepConfig, out: Path | None, memory_limit_gib: float | None, progress: Progress,
              warn: Warn) -> dict:
    """`mac-moesd sweep` on one machine."""
    usable = usable_memory(memory_limit_gib)
    machine, meta, store = open_store(out, warn)
    with hardware.measuring_stage():
        document = sweep.run_sweep(cfg, store, usable.usable_bytes, progress)
    for message in document["warnings"]:
        warn(message)
    return _stored(document, meta, store)


def cluster_sweep(cfg: sweep.SweepConfig, parallel: str, out: Path | None, memory_limit_gib: float | None,
                  rank_timeout: float | None, progress: Progress, warn: Warn) -> dict | None:
    """The sweep of a model sharded over the ranks of mlx.launch; None on ranks other than 0."""
    from mac_moesd.measure.cluster import distributed

    document = distributed.run_cluster_sweep(cfg, parallel, out, memory.limit_bytes(memory_limit_gib),
                                             rank_timeout or distributed.DEFAULT_TIMEOUT_S, progress)
    if document is not None:
        meta = document["meta"]
        for message in [meta["blas"]["warning"], *meta["warnings"], *document["warnings"]]:
            if message:
                warn(message)
    return document


def run_roofline(quick: bool, sizes_mib: tuple[float, ...] | None, max_size_mib: float | None,
                 memory_limit_gib: float | None, out: Path | None, progress: Progress, warn: Warn) -> dict:
    """`mac-moesd roofline`: the configuration from the options, checked against the memory usable."""
    cfg = roofline.QUICK if quick else roofline.RooflineConfig()
    if sizes_mib:
        if min(sizes_mib) < 1 / 64:
            raise BadInput("--sizes must be at least 1/64 MiB each")
        cfg = replace(cfg, sizes=roofline.sizes_from_mib(sizes_mib))
    cap = None
    if max_size_mib:
        cap = roofline.sizes_from_mib((max_size_mib,))[0]
        cfg = replace(cfg, sizes=tuple(s for s in cfg.sizes if s <= cap) or (cap,))
    usable = usable_memory(memory_limit_gib)
    machine, meta, store = open_store(out, warn)
    roofline.validate(cfg, usable.usable_bytes, cap)
    progress.expect(roofline.progress_steps(cfg))
    memory.start_stage()
    document = roofline.run_roofline(cfg, machine.spec, machine.backend, progress.advance,
                                     usable_bytes=usable.usable_bytes, store=store)
    if document["kernels"]["path"] != "metal":
        warn(document["kernels"]["note"])
    return _stored(document, meta, store)


def run_routing(cfg: routing.RoutingConfig, memory_limit_gib: float | None, out: Path | None, warn: Warn) -> dict:
    """`mac-moesd routing`."""
    usable = usable_memory(memory_limit_gib)
    machine, meta, store = open_store(out, warn)
    with hardware.measuring_stage():
        document = routing.run_routing(cfg, usable.usable_bytes, store)
    return _stored(document, meta, store)


def stored_name(data: dict, model: str | None) -> str | None:
    """``--model`` as the results name it: as given where a sweep has that name, else as the
    argument resolves (a folder's path, a zoo name in other capitals), as the sweep named it."""
    if model is None or any(entry.get("model") == model for entry in data.get("sweeps", {}).values()):
        return model
    try:
        return models.resolve(model).name
    except MacMoesdError:
        return model  # not a model here: the fit says which sweeps the results hold


def fit_results(results: Path, model: str | None, alphas: tuple[float, ...] | None, verify_tokens: str,
                warn: Warn) -> dict:
    """`mac-moesd fit`: the fit of a results file (or its folder), written back into it unless
    another process is writing it or its folder is read-only (then only printed, with why)."""
    path = results / "results.json" if results.is_dir() else results
    lock = busy = None
    if path.exists():
        try:  # before reading: the fit is written back into what was read
            lock = WriterLock.take(path)
        except ResultsBusy as err:
            busy = (f"another mac-moesd process ({err.holder or 'unknown'}) is writing {path}; rerun "
                    "`mac-moesd fit` when it has finished")
        except MacMoesdError as err:  # its folder is read-only
            busy = str(err)
    try:
        data = load_results(path)
        with validate.read_guard(path):
            inputs = fit.inputs_from_results(data, stored_name(data, model), verify_tokens)
        if inputs.ridge is not None and "no roofline" in inputs.ridge_source:
            warn(f"ridge and bandwidth from the {inputs.ridge_source}")
        for what in inputs.missing:
            warn(what)
        with validate.read_guard(path):
            document = fit.fit_document(fit.fit(inputs),
                                        alphas=tuple(sorted(set(fit.DEFAULT_ALPHAS) | set(alphas or ()))))
        if busy is None:
            document = fit.store_fit(data, document["model"], document)
            write_atomic(path, data)
        else:
            warn(f"the fit was not saved: {busy}")
        return document
    finally:
        if lock is not None:
            WriterLock.release(lock)


def stored_predictor(store: ResultsStore, target: str, name: str, warn: Warn, drafter_kind: str = "model",
                     draft: str | None = None):
    """The speedup predictor of the fit of the model ``name`` (``target`` as the user wrote it) in
    ``store`` for a drafter of that kind (``fit.predictor_for``) and, for a drafter model, that
    drafter (``draft``, resolved); None, with a warning saying what to run, when there is none,
    it was made with another drafter's step, or it cannot predict."""
    fitted = store.data.get("fits", {}).get(name)
    if fitted is None:
        warn(f"no fit of {target} in {store.path}: run `mac-moesd fit` for predicted speedups")
        return None
    if not prices_drafter(fitted, draft):
        warn(f"the fit of {target} in {store.path} was made with {fitted['draft_model']}'s step, not {draft}'s, "
             f"so it cannot price these runs (`mac-moesd run --target {target} --draft {draft}` fits with it)")
        return None
    predictor = fit.predictor_for(fitted, drafter_kind)
    if predictor is None:
        warn(f"the fit of {target} in {store.path} cannot predict speedups (no drafter, or made before "
             "the expert-load variants): rerun `mac-moesd sweep --draft` and `mac-moesd fit`")
    return predictor


def run_spec(cfg: speedup.SpecConfig, memory_limit_gib: float | None, out: Path | None, warn: Warn) -> dict:
    """`mac-moesd spec`: measured SD beside the stored fit's prediction."""
    usable = usable_memory(memory_limit_gib)
    machine, meta, store = open_store(out, warn)
    sources = speedup.resolve_sources(cfg)
    name = sources.target.name
    draft = sources.draft.name if sources.draft is not None else None
    predictor = stored_predictor(store, cfg.target, name, warn, cfg.drafter_kind, draft)
    with hardware.measuring_stage():
        document = speedup.run_spec(cfg, predictor, usable.usable_bytes, fit.sweep_plain_step(store.data, name), sources,
                                    store)
    return {**document, "meta": meta}


def run_serving(cfg, out: Path | None, progress: Progress, warn: Warn) -> dict:
    """`mac-moesd serving` (``cfg``: a ``serving_stage.ServingConfig``)."""
    from mac_moesd.pipeline import serving_stage

    machine, meta, store = open_store(out, warn)
    progress.expect(serving_stage.progress_steps(cfg))
    document = serving_stage.run_serving(cfg, store, machine.backend, progress.advance)
    for message in document["notes"]:
        warn(message)
    return _stored(document, meta, store)


@dataclass(frozen=True)
class RunOptions:
    """`mac-moesd run`'s choices, checked against each other by the command line."""

    quick: bool = False
    full: bool = False
    models: tuple[str, ...] = ()  # --models
    target: str | None = None
    drafts: tuple[str, ...] = ()  # --draft: a drafter model, prompt-lookup, mtp-head
    prompt_sets: tuple[str, ...] = plans.PROMPT_SETS
    prompts_given: bool = False  # --prompts was given
    serving: bool = False
    rollback: str = "auto"  # --rollback
    alpha: float = theory.DEFAULT_ALPHA  # --alpha: the acceptance an MTP head's runs impose


@dataclass
class RunResult:
    outcome: Outcome
    store: ResultsStore
    paths: dict[str, Path]


def run(options: RunOptions, out: Path, memory_limit_gib: float | None, progress: Progress, warn: Warn) -> RunResult:
    """`mac-moesd run`: the pair's stages (``--target``, or on a GPU a known pair found cached)
    or the zoo's, then the report."""
    from mac_moesd.pipeline import serving_stage
    from mac_moesd.reporting import report

    limit_bytes = memory.limit_bytes(memory_limit_gib)
    machine, meta, store = open_store(out, warn, per_chip=True)
    serving_cfg = serving_stage.stage_config(options.quick) if options.serving else None
    chosen: list[plans.PairPlan] | None = None
    if options.target:
        chosen = plans.pair_plans(machine.backend, options.quick, options.target, options.drafts,
                                  options.prompt_sets, alpha=options.alpha)
    elif machine.backend == "cpu" and options.prompts_given:
        raise BadInput("--prompts needs --target and --draft here (the cached-pair search runs on a GPU only)")
    elif machine.backend != "cpu" and not options.models and not options.full:
        pair, search = plans.find_default_pair(machine.backend, options.quick,
                                               memory.usable(limit_bytes).usable_bytes, options.prompt_sets)
        chosen = [pair] if pair is not None else None
        store.put("pair_search", "latest", search.to_dict())
        if chosen is None:
            warn("no known MoE/drafter pair in the Hugging Face cache fits here: measuring random-weight "
                 "models (the report says so)")
    if chosen:
        chosen = [replace(plan, base=replace(plan.base, rollback=options.rollback)) for plan in chosen]
        outcome = pair_stages.run_pair(chosen, store, machine, progress, limit_bytes, serving_cfg)
    else:
        plan = plans.default_plan(machine.backend, options.quick, options.full)
        if options.models:
            plan = plans.with_models(plan, options.models)
        plan = replace(plan, rollback=options.rollback)
        outcome = stages.run_all(plan, store, machine, progress, limit_bytes, options.serving)
    progress.note("report")
    paths = report.write_report(store.data, store.path.parent)
    return RunResult(outcome, store, paths)


def _planned_machine(chip: str | None, memory_gib: float | None, memory_limit_gib: float | None,
                     out: Path | None) -> tuple[str, str, int | None, memory.Usable, estimate.Rates | None]:
    """Backend, chip name, RAM, usable memory and rates of the machine a dry run plans for: the
    table's ``chip`` with ``memory_gib`` of RAM, or this one (its RAM as ``memory_gib`` says)."""
    limit_bytes = memory.limit_bytes(memory_limit_gib)
    if chip:
        if memory_gib is None:
            raise BadInput("--chip needs --memory GiB (the Mac's RAM)")
        found = estimate.parse_chip(chip)
        ram = int(memory_gib * memory.GiB)
        usable = memory.usable_from(memory.working_set_bytes(ram), None, limit_bytes,
                                    "working set of a Mac with this RAM (2/3 of it up to 32 GiB, 3/4 above; "
                                    "docs/design.md §5); nothing else assumed running")
        return "metal", f"{found['name']} {found['gpu_cores']}c", ram, usable, estimate.chip_rates(found)
    machine = hardware.detect()
    total = machine.memory_bytes
    if memory_gib is not None:
        total = int(memory_gib * memory.GiB)
        ceiling = memory.working_set_bytes(total) if machine.backend == "metal" else total
        usable = memory.usable_from(ceiling, None, limit_bytes, "--memory")
    else:
        usable = memory.usable(limit_bytes)
    rates = estimate.measured_rates((out or Path("reports")) / machine.slug / "results.json")
    if rates is None and machine.spec is not None:
        rates = estimate.chip_rates(machine.spec)
    return machine.backend, machine.chip, total, usable, rates


def dry_run(options: RunOptions, out: Path | None, memory_limit_gib: float | None, chip: str | None = None,
            memory_gib: float | None = None, cluster: tuple[int, str, float | None] | None = None) -> dict:
    """The plan of ``run`` for this machine, or for ``chip`` with ``memory_gib`` GiB; nothing
    allocated. ``cluster`` (ranks, parallel, link Gb/s): the sharded sweeps over that many such
    machines."""
    from mac_moesd.pipeline import serving_stage

    backend, name, total, usable, rates = _planned_machine(chip, memory_gib, memory_limit_gib, out)
    found: list[plans.PairPlan] | None = None
    if options.target:
        found = plans.pair_plans(backend, options.quick, options.target, options.drafts, options.prompt_sets,
                                 alpha=options.alpha)
    elif not chip and backend != "cpu" and not options.models and not options.full:
        pair, _ = plans.find_default_pair(backend, options.quick, usable.usable_bytes,
                                          options.prompt_sets)  # as `run` would
        found = [pair] if pair is not None else None
    plan = found[0].base if found else plans.default_plan(backend, options.quick, options.full)
    if options.models:
        plan = plans.with_models(plan, options.models)
    if cluster:
        from mac_moesd.pipeline import estimate_cluster

        ranks, parallel, link = cluster
        return estimate_cluster.dry_run_cluster(plan, backend, name, total, usable, rates, ranks, parallel,
                                                link or estimate_cluster.LINK_GBPS)
    if found:
        planned = pair_stages.pair_stages(found, serving_stage.stage_config(options.quick) if options.serving else None)
    else:
        planned = stages.default_stages(plan, options.serving)
    document = estimate.dry_run(planned, plan.bits, backend, name, total, usable, rates)
    if found:
        document["pair"] = {"target": found[0].target, "draft": ", ".join(p.draft for p in found),
                            "found": found[0].found}
    return document


def report(folder: Path | None) -> dict[str, Path]:
    """`mac-moesd report`: the report of FOLDER/results.json (default reports/<this chip's slug>)."""
    from mac_moesd.reporting import report as reporting

    folder = folder or Path("reports") / hardware.detect().slug
    path = folder / "results.json"
    data = load_results(path)
    with validate.read_guard(path):
        return reporting.write_report(data, folder)


def compare(folders: list[Path], reference: bool, out: Path) -> dict:
    """`mac-moesd compare`: the machines side by side, the overlay figures drawn into ``out``."""
    from mac_moesd.reporting import compare as comparing

    document = comparing.compare(folders, reference)
    figures = comparing.draw(document, out)
    document["figures"] = {k: str(v) for k, v in figures.items()}
    for row in document["machines"]:
        row.pop("curves")
    return document


def check_machine(warn: Warn) -> dict:
    """`mac-moesd selftest`: every check, with this machine's description."""
    machine = hardware.detect()
    for message in machine.warnings:
        warn(message)
    outcomes = selftest.run()
    return {"chip": machine.chip, "backend": machine.backend, "os": machine.os,
            "versions": metadata.versions(), "warnings": machine.warnings,
            "passed": all(o.status != "FAIL" for o in outcomes),
            "checks": [o.to_dict() for o in outcomes]}
