"""The T_T(B, t) grid: forward time of B sequences of t new tokens each over a KV cache at context L.

The largest batch's cache is prefilled once to the context and every smaller batch runs on a copy
of its rows; after every timed forward a cache is rolled back (trimmed, or restored from a
snapshot for caches that cannot trim, e.g. sliding windows) and its offset checked. Every point of
every batch is timed two ways, in one shuffled schedule (so that drift over the minutes a sweep
takes spreads over all points instead of landing on one batch's): synchronously (one forward,
graph construction included: what a verify forward that must be read back costs) and pipelined (a
chain of forwards, each built while the previous one runs under ``mx.async_eval``, as mlx-lm's
generation loops do: what a decode step costs there; one-token chains are ``Budget.decode_chain``
long, since decoding runs long chains and a chain's fixed cost is spread over its forwards). Also the
drafter's one-token step T_D(B, 1) and rejection sampling T_rej(B). The one-token points are also timed at
a second, shorter context (``kv_points``, from a copy of each batch's cache trimmed back), in the
same schedule, so that the fit can tell the KV cache's growth with context from costs per sequence. Models too big for memory are
measured on slices of N and 2N layers and extrapolated to full depth. On MoE models every point
also records the unique experts and token-expert pairs its forwards ran, under the model's own
routing or a forced one (``routing_control.py``).
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mac_moesd.analysis.depth import extrapolate, second_context_points
from mac_moesd.machine import memory
from mac_moesd.units import human_bytes
from mac_moesd.inputs import models, zoo
from mac_moesd.inputs.cache_kinds import leaf_kind, leaves
from mac_moesd.measure.caches import cache_copy
from mac_moesd.measure.clock import timing
from mac_moesd.measure.experts import routing
from mac_moesd.measure.caches.rolled_cache import PREFILL_CHUNK, RolledBackCache, batch_caches
from mac_moesd.measure.experts.routing_control import SweepRouting, check_against_model, parse_routing
from mac_moesd.errors import BadInput, MacMoesdError
from mac_moesd.progress import Progress
from mac_moesd.results import ResultsStore, keys, parse_point_key, point_key, schema
from mac_moesd.measure.decoding.bookkeeping import bookkeeping_point
from mac_moesd.measure.forward import draft_chain
from mac_moesd.measure.forward.points import PIPELINED_STEPS, forward_point, pipelined_point, reject_point
from mac_moesd.measure.decoding.sd_loop import sample

__all__ = ["SweepConfig", "plan_layers", "resolve_sources", "run_sweep"]

# The second context is the first over this. The KV term's share of a step is small (on the CPU
# backend at L = 64, 0.2-1.2 us per cached token per sequence against 10-35 ms steps), so the
# difference between the two contexts is what identifies it, and a wider gap stands further above
# the timing noise; a trimmed cache can only go shorter.
KV_LEVER = 4


def pipelined_steps(tokens: int, budget: timing.Budget) -> int:
    """Forwards per pipelined sample of a point of ``tokens`` new tokens per sequence: a decode
    step's chain is ``budget.decode_chain`` long; a verify window is pipelined behind one draft
    step only, so its chains stay short."""
    return budget.decode_chain if tokens == 1 else PIPELINED_STEPS


def pipelined_seconds(tokens: int, budget: timing.Budget) -> float:
    """The time budget of a pipelined point of ``tokens`` new tokens per sequence: a decode step's
    chains get ``budget.decode_seconds_factor`` times a point's seconds (``timing.Budget``)."""
    return budget.seconds_per_point * (budget.decode_seconds_factor if tokens == 1 else 1.0)


# How a target model is built: models.build, or a sharded build (measure.cluster.distributed).
Builder = Callable[..., models.Built]


@dataclass(frozen=True)
class SweepConfig:
    model: str
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    tokens: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 8)
    context: int = 512
    dtype: str | None = None
    bits: int | None = None
    layers: int | None = None  # None: all layers if they fit, else the largest slice that does
    draft: str | None = None
    gamma: int = 4  # draft length whose rejection step T_rej(B) is timed
    budget: timing.Budget = field(default_factory=timing.Budget)
    seed: int = 0
    routing: str = "model"  # model, uniform, correlated:C or trace:FILE (routing_control.py)
    gather: str = "mlx-lm"  # mlx-lm, or sorted: mlx-lm's sorted expert path at every size
    kv_context: int | None = None  # second context of the one-token points; None: context // KV_LEVER, 0: none

    def __post_init__(self):
        for name, values in (("batch", self.batches), ("tokens", self.tokens)):
            if not values or min(values) < 1:
                raise BadInput(f"--{name} values must be >= 1, got {list(values)}")
        if self.context < 1:
            raise BadInput(f"--context must be >= 1, got {self.context}")
        if self.gamma < 1:
            raise BadInput(f"--gamma must be >= 1, got {self.gamma}")
        if self.kv_context is not None and not 0 <= self.kv_context < self.context:
            raise BadInput(f"--kv-context must be in 0..{self.context - 1} (below --context), got {self.kv_context}")

    @property
    def second_context(self) -> int | None:
        """The shorter context the one-token points are also timed at; None when there is none."""
        if self.kv_context is not None:
            return self.kv_context or None
        return self.context // KV_LEVER or None


# ---- memory ----


def estimate(built: models.Built, cfg: SweepConfig) -> dict:
    """Peak memory of measuring one slice (``memory.sweep_estimate``), before allocating it."""
    return memory.sweep_estimate(built, cfg.batches, cfg.tokens, cfg.context, PREFILL_CHUNK,
                                 shortened=cfg.second_context is not None)


def estimate_bytes(built: models.Built, cfg: SweepConfig) -> int:
    return estimate(built, cfg)["peak_bytes"]


def plan_layers(source: models.ModelSource, cfg: SweepConfig, available: int | None,
                build: Builder = models.build) -> list[int]:
    """Which layer counts to measure: [full], or [N, 2N] to extrapolate (N in whole hybrid
    periods, ``zoo.slice_unit``), or refuse."""
    full = int(source.config["num_hidden_layers"])
    unit = zoo.slice_unit(source.config)

    def fits(n: int) -> bool:
        if available is None:
            return True
        return estimate_bytes(build(source, cfg.dtype, cfg.bits, n), cfg) <= available

    if cfg.layers is not None:
        plan = [full] if 2 * cfg.layers > full else [cfg.layers, 2 * cfg.layers]
    elif fits(full) or 2 * unit > full:
        plan = [full]
    else:  # the largest slice N below full whose 2N fits
        below = zoo.smaller_slice(full, unit)
        assert below is not None  # full is at least two units here
        n = zoo.largest_slice(below, unit, lambda n: fits(2 * n))
        plan = [n, 2 * n]
    if available is not None and not fits(plan[-1]):
        need = estimate_bytes(build(source, cfg.dtype, cfg.bits, plan[-1]), cfg)
        raise MacMoesdError(
            f"{source.name} with {plan[-1]} layers needs about {human_bytes(need)} but "
            f"{human_bytes(available)} is usable here; try --layers 1, --bits 4, "
            "a smaller --batch or --context, or a larger --memory-limit"
        )
    return plan


# ---- one model at one slice ----


def routing_for(built: models.Built, cfg: SweepConfig) -> SweepRouting | None:
    """The routing control of an MoE model's grid; None where there is no switch to count."""
    if not built.footprint["experts"] or not routing.switch_modules(built.model):
        return None
    assert built.footprint["top_k"] is not None  # set with experts (zoo.expert_shape)
    return SweepRouting(built.model, parse_routing(cfg.routing), cfg.gather, built.footprint["experts"],
                        built.footprint["top_k"], cfg.seed)


def recorded(kind: str, tokens: int, m: timing.Measurement, budget: timing.Budget, stats: dict) -> dict:
    """A measured point as a sweep entry stores it: a synchronous one (``points``) with what its
    routing counted, a pipelined one (``pipelined_points``) per forward with its chain length."""
    if kind == "pipelined_points":
        steps = pipelined_steps(tokens, budget)
        return {**timing.per_launch(m, steps), "steps": steps}
    return {**m, **stats}


def entry_header(built: models.Built, context: int, routing_label: str = "model",
                 gather: str = "mlx-lm") -> schema.SweepEntry:
    """What a results entry records about the model it measured."""
    return {
        "model": built.source.name, "dtype": built.dtype, "bits": built.bits, "context": context,
        "layers": built.layers, "layers_full": built.layers_full,
        "vocab": built.config["vocab_size"], "footprint": built.footprint,
        "routing": routing_label, "gather": gather,
    }


def entry_key(built: models.Built, context: int, routing_key: str = "model", gather: str = "mlx-lm") -> str:
    """Sweeps under a forced routing or gather get keys of their own (the defaults keep the
    keys of earlier files, which resume as before)."""
    weight_format = f"q{built.bits}" if built.bits else built.dtype
    return keys.sweep_key(built.source.name, weight_format, context, built.layers, routing_key, gather)


def measure_grid(
    built: models.Built,
    cfg: SweepConfig,
    tokens: tuple[int, ...],
    entry: dict,
    save: Callable[[], None],
    progress: Progress,
    rng: random.Random,
    check_drift: bool = False,
) -> bool:
    """Measure the missing (B, t) points of ``entry``, synchronous (``entry["points"]``) and
    pipelined (``entry["pipelined_points"]``), the one-token points at the second context
    (``entry["kv_points"]``, per context) and with ``check_drift`` the drift check, all on one
    prefill: the largest batch's cache, and copies of its rows for the smaller batches (trimmed
    copies for the second context). True if anything ran. MoE models run under ``cfg.routing``
    and ``cfg.gather`` throughout."""
    control = routing_for(built, cfg)
    with control.installed() if control else contextlib.nullcontext():
        return _measure_grid(built, cfg, tokens, entry, save, progress, rng, check_drift, control)


def _measure_grid(built, cfg, tokens, entry, save, progress, rng, check_drift, control) -> bool:
    vocab = built.config["vocab_size"]
    big = max(cfg.batches)
    parent = None
    entry.setdefault("pipelined_points", {})
    kinds = ("points", "pipelined_points")
    short = kv_context_of(cfg, entry)
    kv_tokens = min(tokens)

    def cache_for(batch: int) -> RolledBackCache:
        nonlocal parent
        if parent is None:
            parent = RolledBackCache(built.model, big, cfg.context, vocab, also_at=short)
        return parent if batch == big else parent.rows(batch)

    # Every missing point of every batch goes into one shuffled schedule: a batch's points timed
    # in a block of their own would each see the machine in a different state (a shared or
    # warming machine drifts by 10% or more over minutes), and the fit would read that drift as
    # a difference between batches. Caches: the largest batch's prefill, then copies of its rows.
    todo = [(kind, b, t) for b in cfg.batches for t in tokens for kind in kinds
            if point_key(b, t) not in entry[kind]]
    for b in cfg.batches:
        for t in tokens:
            if all(point_key(b, t) in entry[kind] for kind in kinds):
                progress.advance(f"{built.source.name} layers={built.layers} B={b} t={t} (kept)")
    kv_todo = [b for b in cfg.batches if short is not None
               and not all(point_key(b, kv_tokens) in entry[k][str(short)] for k in KV_KINDS)]
    # Short copies first: each is made from the prefill's rows before the batches' own caches exist.
    shorts = {b: cache_for(big).shortened(b, short) for b in kv_todo} if short is not None else {}
    if any(c is None for c in shorts.values()):  # a cache ``can_shorten`` misjudged: one context only
        entry.update(kv_context=None, kv_untrimmable=True)
        kv_todo, shorts = [], {}
    # A second-context point is compared with its twin at the first context: the two are timed
    # together, fed the same ids, and the twin is timed again for it (the grid's own point may be
    # from an earlier session: a resumed sweep, a file made before second contexts were timed).
    todo += [(kind, b, kv_tokens) for b in kv_todo for kind in KV_KINDS]
    caches = batch_caches(cache_for(big), {b for k, b, _ in todo if k != "kv_points"}) if todo else {}
    twin_ids = {b: mx.random.randint(0, vocab, (b, kv_tokens)) for b in kv_todo}

    def point(kind: str, b: int, t: int) -> timing.Point:
        if kind == "points":
            return forward_point(built.model, caches[b], b, t, vocab, control)
        if kind in KV_KINDS:
            cache = shorts[b] if kind == "kv_points" else caches[b]
            assert cache is not None  # shorts holds no None past the check above
            return forward_point(built.model, cache, b, t, vocab, control, twin_ids[b])
        chain = pipelined_point(built.model, caches[b], b, t, vocab, control, pipelined_steps(t, cfg.budget))
        return replace(chain, seconds=pipelined_seconds(t, cfg.budget))

    points = {key: point(*key) for key in todo}

    def done(key, m):
        kind, batch, t = key
        if kind in KV_KINDS:  # what its routing ran is the grid point's, recorded there
            entry[kind][str(short)][point_key(batch, t)] = recorded(kind, t, m, cfg.budget, {})
        else:
            entry[kind][point_key(batch, t)] = recorded(kind, t, m, cfg.budget,
                                                        control.stats[(batch, t)] if control else {})
        save()
        if kind in kinds and all(point_key(batch, t) in entry[k] for k in kinds):
            progress.advance(f"{built.source.name} layers={built.layers} B={batch} t={t}")

    # A shape's timings are compared with each other (the graph-build time pipelining hides; the
    # KV cache's growth between the two contexts), so they are taken back to back.
    timing.measure(points, cfg.budget, rng, on_done=done, group=lambda key: key[1:])
    del caches, shorts, points
    ran = parent is not None
    if check_drift and (ran or "drift" not in entry):
        entry["drift"] = measure_drift(built, cfg, entry, rng, cache_for(cfg.batches[0]), control)
        ran = True
    return ran


KV_KINDS = ("kv_points", "kv_twins")  # a second-context point, and its twin timed beside it


def kv_context_of(cfg: SweepConfig, entry: dict) -> int | None:
    """The second context to time ``entry``'s one-token points at now (None: none), which becomes
    the one the fit uses. ``entry["kv_points"]`` and ``entry["kv_twins"]`` hold points per second
    context; those of an earlier one are kept but no longer used."""
    short = cfg.second_context
    for kind in KV_KINDS:
        entry.setdefault(kind, {})
    if short is None or entry.get("kv_untrimmable"):
        return None
    for kind in KV_KINDS:
        if entry.get("kv_context") != short or str(short) not in entry[kind]:
            entry[kind][str(short)] = {}
    entry["kv_context"] = short
    return short


def can_shorten(model, context: int) -> bool:
    """Whether one prefill to ``context`` also gives a shorter context: a cache of plain KV layers
    is trimmed back to it (plain, quantized and concatenating ones can; a chunked one past its
    chunk cannot: ``cache_copy.can_shorten``); one with windows or recurrent states is copied as
    the prefill passes it (``RolledBackCache``'s ``also_at``)."""
    caches = make_prompt_cache(model)
    if any(leaf_kind(leaf) != "kv" for leaf in leaves(caches)):
        return True
    return all(cache_copy.can_shorten(c, context) for c in caches)


UNTRIMMABLE = ("{model}'s KV cache cannot be trimmed back to a shorter context (a chunked cache past its "
               "chunk), so its one-token points are timed at one context only")


def timed_config(source: models.ModelSource, cfg: SweepConfig) -> tuple[SweepConfig, str | None]:
    """``cfg`` as it can be timed: without a second context where the model's cache cannot trim
    back (decided from the whole model, so every rank of a sharded sweep decides alike), and why."""
    if cfg.second_context is None:
        return cfg, None
    whole = models.build(source, cfg.dtype, cfg.bits, seed=cfg.seed).model  # lazy: nothing allocated
    if can_shorten(whole, cfg.context):
        return cfg, None
    return replace(cfg, kv_context=0), UNTRIMMABLE.format(model=source.name)


def measure_drift(built: models.Built, cfg: SweepConfig, entry: dict, rng,
                  cache: RolledBackCache, control: SweepRouting | None = None) -> dict | None:
    """Re-measure the first point after the grid; compare with its first measurement."""
    key = point_key(cfg.batches[0], cfg.tokens[0])
    if key not in entry["points"]:
        return None
    vocab = built.config["vocab_size"]
    point = forward_point(built.model, cache, cfg.batches[0], cfg.tokens[0], vocab, control)
    after = timing.measure({key: point}, cfg.budget, rng)[key]
    return {"point": key, **timing.drift(entry["points"][key], after)}


# ---- the whole sweep ----


def run_sweep(
    cfg: SweepConfig,
    store: ResultsStore,
    available_bytes: int | None,
    progress: Progress = Progress(),
    build: Builder = models.build,
    sources: models.Sources | None = None,
) -> dict:
    """Measure (resuming what ``store`` has) and return the sweep document of docs/design.md §7.5.
    ``build`` builds the target (the drafter is always built whole); ``sources`` are the target
    and drafter as the command resolved them (None: resolved here)."""
    rng = random.Random(cfg.seed)
    sources = sources or resolve_sources(cfg)
    source = validate(cfg, sources)
    sources.claim(store)
    cfg, one_context = timed_config(source, cfg)
    mode = parse_routing(cfg.routing)
    plan = plan_layers(source, cfg, available_bytes, build)
    grid = len(cfg.batches) * len(cfg.tokens)
    progress.expect(grid * len(plan) + len(cfg.batches) * (3 if cfg.draft else 1))
    entries, footprint_full = [], None
    for layers in plan:
        memory.start_stage()
        built = build(source, cfg.dtype, cfg.bits, layers, seed=cfg.seed)
        footprint_full = footprint_full or build(source, cfg.dtype, cfg.bits).footprint
        entry = store.entry("sweeps", entry_key(built, cfg.context, mode.key, cfg.gather),
                            entry_header(built, cfg.context, mode.label, cfg.gather))
        if one_context:
            entry["kv_untrimmable"] = True
        need = estimate(built, cfg)
        built.materialise()
        if measure_grid(built, cfg, cfg.tokens, entry, store.save, progress, rng, check_drift=True):
            entry["memory"] = memory.record(need, available_bytes)
        store.save()
        if sources.draft is not None and layers == plan[-1]:  # the whole target, or its larger slice
            why_not = "a sharded sweep does not time them" if build is not models.build else None
            measure_chains_with(built, entry, cfg, sources.draft, store, available_bytes, progress, rng, why_not)
        entries.append(entry)
        del built
        memory.release()
    document = sweep_document(cfg, source, plan, entries, footprint_full)
    document.update(routing=mode.label, gather=cfg.gather)
    if mode.trace is not None:
        t = mode.trace
        document["routing_trace"] = {"model": t.model, "text": t.text, "digest": t.digest, "layers": t.layers,
                                     "sequences": t.sequences, "length": t.length}
    if cfg.draft:
        assert sources.draft is not None  # resolved with cfg.draft
        document["draft"] = {**measure_draft(cfg, sources.draft, store, available_bytes, progress, rng),
                             **chains_document(entries, sources.draft.name)}
    document["reject"] = measure_reject(cfg, source, store, progress, rng, available_bytes)
    return document


def resolve_sources(cfg: SweepConfig) -> models.Sources:
    """``cfg``'s model and drafter as found on this machine."""
    return models.Sources(models.resolve(cfg.model), models.resolve(cfg.draft) if cfg.draft else None)


def validate(cfg: SweepConfig, sources: models.Sources | None = None) -> models.ModelSource:
    """Check the model and its limits before anything is opened or allocated; the target's source."""
    sources = sources or resolve_sources(cfg)
    source = sources.target
    check_context(source, cfg)
    full = int(source.config["num_hidden_layers"])
    if cfg.layers is not None and not 1 <= cfg.layers <= full:
        raise BadInput(f"--layers must be in 1..{full} for {source.name}, got {cfg.layers}")
    if sources.draft is not None:
        check_context(sources.draft, cfg)
    check_against_model(parse_routing(cfg.routing), cfg.gather, zoo.expert_shape(source.config),
                        source.name, cfg.batches, cfg.tokens)
    return source


def check_context(source: models.ModelSource, cfg: SweepConfig) -> None:
    limit = source.config.get("max_position_embeddings")
    if limit and cfg.context + max(cfg.tokens) > limit:
        raise BadInput(
            f"--context {cfg.context} plus {max(cfg.tokens)} new tokens exceeds "
            f"{source.name}'s maximum of {limit} positions"
        )


def draft_config(cfg: SweepConfig) -> SweepConfig:
    """The drafter's part of a sweep: its one-token step, whole, as mlx-lm runs it (the what-ifs
    and the second context concern the target)."""
    assert cfg.draft is not None  # callers run the drafter's part only with a drafter
    return replace(cfg, model=cfg.draft, tokens=(1,), layers=None, routing="model", gather="mlx-lm", kv_context=0)


def measure_chains_with(target: models.Built, entry: dict, cfg: SweepConfig, source: models.ModelSource,
                        store: ResultsStore, available_bytes: int | None, progress: Progress,
                        rng: random.Random, why_not: str | None = None) -> None:
    """The drafter's chains after the target's verify (``draft_chain``), timed while the target
    (whole, or the larger slice of a target too big for memory) is still built, into its sweep
    ``entry`` by drafter; skipped, and why said there, where the caller says so (``why_not``: a
    sharded target, whose ranks would have to agree on the memory check) or the two models
    would not fit together. Chains kept from an earlier run stay."""
    record = keys.chains_of(entry, source.name)
    todo = draft_chain.missing(record, cfg.batches, cfg.gamma)
    for b in sorted(set(cfg.batches) - {b for b, _ in todo}):
        progress.advance(f"{source.name} chain after the target B={b} (kept)")
    if not todo:
        record.pop("skipped", None)  # an earlier run's reason, for chains this run did not need
        return
    draft_cfg = draft_config(cfg)
    built = models.build(source, draft_cfg.dtype, draft_cfg.bits, seed=cfg.seed)
    need = chains_bytes(target, built, cfg)
    if why_not is None and available_bytes is not None and need > available_bytes:
        why_not = (f"the target and {source.name} together need about {human_bytes(need)}, "
                   f"{human_bytes(available_bytes)} is usable")
    if why_not:
        record["skipped"] = why_not
        for b in sorted({b for b, _ in todo}):
            progress.advance(f"{source.name} chain after the target B={b} (skipped: {why_not})")
        store.save()
        return
    record.pop("skipped", None)
    built.materialise()
    draft_chain.measure_chains(target, built, todo, cfg.context, record, cfg.budget, store.save, progress, rng)
    store.save()
    del built


def chains_bytes(target: models.Built, draft: models.Built, cfg: SweepConfig) -> int:
    """Peak memory of timing the drafter's chains: both models, the target verifying gamma + 1
    tokens (which its grid may not reach), the drafter stepping."""
    verifying = replace(cfg, tokens=tuple(sorted({*cfg.tokens, cfg.gamma + 1})))
    return estimate_bytes(target, verifying) + estimate_bytes(draft, draft_config(cfg))


def chains_document(entries: list[dict], drafter: str) -> dict:
    """What the sweep document's ``draft`` says of the drafter's chains: ``chain_points`` rows,
    ``chains_after_layers`` (the target's layers they followed) or ``chains_skipped``."""
    record, layers = keys.chain_record(entries, drafter)
    return {"chain_points": draft_chain.chain_rows(record),
            **({"chains_after_layers": layers} if record["points"] else {}),
            **({"chains_skipped": record["skipped"]} if record.get("skipped") else {})}


def measure_draft(cfg, source: models.ModelSource, store, available_bytes, progress, rng) -> dict:
    """T_D(B, 1): the drafter's one-token step at every batch size (full depth, never sliced)."""
    draft_cfg = draft_config(cfg)
    check_context(source, draft_cfg)
    plan = plan_layers(source, draft_cfg, available_bytes)
    if len(plan) > 1:
        raise MacMoesdError(f"drafter {source.name} does not fit in memory")
    memory.start_stage()
    built = models.build(source, draft_cfg.dtype, draft_cfg.bits, seed=cfg.seed)
    header = {**entry_header(built, cfg.context), "role": "draft"}
    entry = store.entry("draft", entry_key(built, cfg.context), header)
    need = estimate(built, draft_cfg)
    built.materialise()
    if measure_grid(built, draft_cfg, (1,), entry, store.save, progress, rng):
        entry["memory"] = memory.record(need, available_bytes)
    store.save()
    del built
    memory.release()
    return {**header, "points": points_list(entry["points"], entry.get("pipelined_points")), "memory": entry.get("memory")}


def measure_reject(cfg, source, store, progress, rng, available_bytes: int | None = None) -> dict:
    """T_rej(B): rejection sampling over the vocabulary for B x (gamma+1) positions; and, beside
    it, the SD loop's own work a round at the same shapes (``bookkeeping``: an empty round),
    recorded as ``bookkeeping_points`` for the fit's per-round term."""
    vocab = source.config["vocab_size"]
    entry = store.entry("reject", keys.reject_key(vocab, cfg.gamma), {"vocab": vocab, "gamma": cfg.gamma})
    kept = entry.setdefault("bookkeeping_points", {})
    todo = [b for b in cfg.batches if point_key(b, cfg.gamma + 1) not in entry["points"]]
    for b in set(cfg.batches) - set(todo):
        progress.advance(f"rejection sampling B={b} (kept)")
    memory.start_stage()
    need = reject_estimate(vocab, cfg)
    points = {("reject", b): reject_point(b, cfg.gamma, vocab) for b in todo}
    points.update({("bookkeeping", b): bookkeeping_point(b, cfg.gamma, vocab, "real",
                                                         lambda logits: sample(logits, 0.0))
                   for b in cfg.batches if point_key(b, cfg.gamma + 1) not in kept})

    def done(which, m):
        kind, b = which
        (entry["points"] if kind == "reject" else kept)[point_key(b, cfg.gamma + 1)] = m
        store.save()
        if kind == "reject":
            progress.advance(f"rejection sampling B={b}")

    timing.measure(points, cfg.budget, rng, on_done=done)
    if todo:
        entry["memory"] = memory.record(need, available_bytes)
        store.save()
    del points
    memory.release()
    return {**entry, "points": points_list(entry["points"]), "bookkeeping_points": points_list(kept)}


def reject_estimate(vocab: int, cfg: SweepConfig) -> dict:
    return memory.phases(reject={"rejection": memory.rejection_bytes(vocab, max(cfg.batches), cfg.gamma)})


def points_list(points: dict, pipelined: dict | None = None) -> list[dict]:
    """Rows of {batch, tokens, median_s, ...}; each with its pipelined timing when measured."""
    out = []
    for key, m in points.items():
        batch, tokens = parse_point_key(key)
        row: dict[str, Any] = {"batch": batch, "tokens": tokens}
        row.update({k: v for k, v in m.items() if k != "samples_s"})
        if pipelined and key in pipelined:
            row["pipelined"] = {k: v for k, v in pipelined[key].items() if k != "samples_s"}
        out.append(row)
    return sorted(out, key=lambda r: (r["batch"], r["tokens"]))


def full_depth(entries: list[dict], plan: list[int], kind: str = "points") -> dict:
    """One kind of points (``points`` or ``pipelined_points``) at full depth: measured, or
    extrapolated from the (n, 2n) slices."""
    if len(plan) == 1:
        return dict(entries[0].get(kind, {}))
    small, large = ({"points": e.get(kind, {})} for e in entries)
    return extrapolate(small, large, plan[0], entries[0]["layers_full"])


def sweep_document(cfg, source, plan, entries, footprint_full) -> dict:
    wanted = {point_key(b, t) for b in cfg.batches for t in cfg.tokens}
    points = {k: v for k, v in full_depth(entries, plan).items() if k in wanted}
    pipelined = full_depth(entries, plan, "pipelined_points")
    kv_context, kv_points = second_context_points(entries)
    extrapolated = len(plan) > 1
    warnings = []
    for entry in entries:
        label = f"{source.name} ({entry['layers']} layers)"
        measured = [m for k, m in entry["points"].items() if k in wanted]
        warnings += timing.grid_warnings(label, measured)
        drift = entry.get("drift")
        if drift and drift["flagged"]:
            warnings.append(
                f"{label}: reference point {drift['point']} moved {drift['change']:+.1%} between "
                "start and end (thermal throttling or background load); rerun plugged in with "
                "other apps closed"
            )
    if any(e.get("kv_untrimmable") for e in entries):
        warnings.append(UNTRIMMABLE.format(model=source.name) + ": the fit cannot tell the KV term from "
                        "costs per sequence")
    return {
        "model": source.name,
        "points": points_list(points, pipelined),
        "context": cfg.context,
        "kv_points": {"context": kv_context, "points": points_list(kv_points)} if kv_points else None,
        "layers_measured": plan,
        "layers_full": entries[0]["layers_full"],
        "extrapolated": extrapolated,
        "dtype": entries[0]["dtype"],
        "bits": entries[0]["bits"],
        "footprint": footprint_full,
        "slices": [
            {"layers": e["layers"], "points": points_list({k: v for k, v in e["points"].items() if k in wanted},
                                                          e.get("pipelined_points")),
             "drift": e.get("drift"), "memory": e.get("memory")}
            for e in entries
        ],
        "warnings": warnings,
    }
