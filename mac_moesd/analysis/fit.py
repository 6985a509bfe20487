"""Fit MoESD's Algorithm-1 time model to measured T_T(B,t), T_D(B,1), T_rej(B); predict S(B,gamma).

The 10 parameters, plus MagicDec's KV term k_kv*B*L and a cost per sequence k_seq*B, are fitted jointly with scipy's
trust-region-reflective least squares on relative residuals (every point weighs alike, as the
held-out MAPE does), once per expert-load variant (``theory.EXPERT_LOADS``); held-out error picks
the variant the predictions use, refitted on every point. Bounds follow MoESD: bias in
[V_dense*bytes/BW, 5x], k2 in [V_expert*bytes/BW, 5x] (both lower ends halved: BANDWIDTH_SLACK),
draft_bias likewise from the drafter's bytes, lam in [0.2, 1], s in
[1, 2], the rest >= 0. The knee of G is lam * ridge_in_tokens(RP, weight format), RP the measured
ridge for the model's compute dtype (or the chip's published one, said in the output); without
either the knee is fitted in tokens within the measured grid.

Without a drafter sweep only T_T is fitted: predictions carry target efficiency, and speedups
are None until T_D(B,1) is measured.

The expert-read term follows the unique experts the sweep counted at each point, and the
anchored correlation forms fitted to those counts between points (``expert_reads``).

The fit is to synchronous forwards; speedups are predicted with the timing each loop experiences
(``pipelining``): plain decode and drafter steps pipelined, as mlx-lm runs them. The one-row
forward T_T(1,1) is the sweep's own timing of it (``one_row``), not the curve's.

The KV term k_kv*B*L and a cost per sequence k_seq*B are told apart by the sweep's one-token
points timed at a second, shorter context (``kv_points``), fitted with the rest. A sweep without
them has one context only, where the two are the same function of B: k_seq is held at 0 and k_kv
carries both, which overstates the growth with context (on the CPU backend the ``mlx`` variant
fitted 5.5x the cache's bytes over the measured bandwidth) and the output says so.

A sharded sweep (``sweep --parallel``) adds its measured communication term C(n)
(``analysis.cluster``) to T_T, fixed, not fitted; the document then has a ``cluster`` section.
"""

from __future__ import annotations

import inspect
import math
import re
from dataclasses import dataclass, field, replace

import numpy as np
from scipy.optimize import least_squares

from mac_moesd.machine import hardware
from mac_moesd.analysis import break_even, cluster, expert_reads, pipelining, theory
from mac_moesd.analysis.digest import Digest, depth_entries, full_depth_points, second_context_points
from mac_moesd.analysis.one_row import OneRow
from mac_moesd.errors import BadInput, MacMoesdError

__all__ = ["FitInputs", "FitResult", "FittedModel", "VariantFit", "fit", "fit_document",
           "inputs_from_results", "mlx_sort_threshold", "predict", "speedup_predictor", "sweep_plain_step"]

DEFAULT_ALPHAS = (0.5, 0.7, 0.9)
DEFAULT_GAMMAS = tuple(range(1, 9))
DEFAULT_BATCHES = tuple(range(1, 65))
DEFAULT_VERIFY = "gamma+1"  # what the measured loops and mlx-lm feed the target; MoESD writes gamma
HOLDOUT_EVERY = 3  # every third target point is held out (MoESD fitted on every 11th of 228)
MIN_TARGET_TRAIN = 7  # bias, k1, k2, k3, lam, s and k_kv
MIN_SIDE_POINTS = 2  # two parameters each for the drafter and rejection sampling
LAM_BOUNDS = (0.2, 1.0)  # MoESD's bounds on lam, applied to the knee in tokens
NO_DRAFT = "speedups need the drafter step T_D(B,1): rerun the sweep with --draft DRAFT"
NO_REJECT = "speedups need the rejection-sampling step T_rej(B): rerun the sweep with --draft DRAFT"
ONE_CONTEXT_ONLY = ("the model's KV cache cannot be trimmed back to a shorter context (sliding-window, "
                    "chunked or state-space layers), so the sweep timed one context: the KV term k_kv*B*L "
                    "also carries every cost per sequence, and predictions at other contexts overstate its growth")
NO_SECOND_CONTEXT = ("no one-token points at a second context: the KV term k_kv*B*L also carries every "
                     "cost per sequence, so predictions at other contexts overstate its growth; rerun "
                     "the sweep (it times them at a quarter of --context unless --kv-context 0)")
NO_PIPELINED = ("no pipelined timings in this sweep (made before they were recorded): predictions use "
                "synchronous forwards for plain decode and drafter steps too; rerun the sweep to add them")
# The byte bounds' lower end is half of bytes / measured bandwidth: the measured ceiling is an
# estimate (a quick roofline read 4.7 to 8.8 GB/s between runs on one 2-core Linux box), and reads
# of weights still in cache beat it; a bound at the full figure forced k2 and bias up whenever the
# ceiling read low (held-out MAPE 17-118% instead of 4-11% on the same sweep).
BANDWIDTH_SLACK = 0.5
# Variants closer than this in held-out MAPE are not told apart by the grid.
INDISTINCT_MAPE = 0.005

REGIMES = {
    "unique": "each activated expert is read once per forward (MoESD's assumption)",
    "pairs": "each (token, expert) pair is read separately, so a verify window costs about n*K "
             "expert reads and never saturates",
    "mlx": "pairs below mlx-lm's sort threshold on n*K, each unique expert once at and above it",
}


def mlx_sort_threshold() -> tuple[int, str]:
    """mlx-lm's SwitchGLU sort threshold on indices.size, read from the installed source."""
    try:
        from mlx_lm.models import switch_layers

        source = inspect.getsource(switch_layers)
    except (ImportError, OSError, TypeError) as err:
        return theory.MLX_SORT_THRESHOLD, f"default (mlx_lm's switch_layers not readable: {err})"
    found = sorted({int(v) for v in re.findall(r"indices\.size\s*>=\s*(\d+)", source)})
    if len(found) != 1:
        return (theory.MLX_SORT_THRESHOLD,
                "default (no single `indices.size >= N` in mlx_lm's switch_layers.py)")
    version = getattr(__import__("mlx_lm"), "__version__", "?")
    return found[0], f"mlx_lm {version} switch_layers.py: indices.size >= {found[0]}"


@dataclass(frozen=True)
class FitInputs:
    model: str
    experts: int
    top_k: int
    weight_format: str
    ridge: float | None  # FLOP/byte for the model's compute dtype; None: knee fitted within the grid
    ridge_source: str
    ridge_tokens: float  # the knee's scale in tokens per forward: knee = lam * ridge_tokens
    bandwidth: float | None  # bytes/s; None: bias and k2 bounded below by 0 only
    bandwidth_source: str
    dense_bytes: float
    expert_bytes: float  # one expert, all MoE layers
    draft_bytes: float | None
    target: list[tuple[int, int, float]]  # (batch, tokens, seconds)
    draft: list[tuple[int, float]]
    reject: list[tuple[int, float]]
    context: int
    draft_model: str | None = None
    extrapolated: bool = False
    verify: str = DEFAULT_VERIFY
    sort_threshold: int = theory.MLX_SORT_THRESHOLD
    sort_threshold_source: str = "default"
    missing: tuple[str, ...] = ()  # what the fit could not use, and what it would take
    platform: str = "this machine"  # chip, backend and MLX versions the sweep ran on
    comm: cluster.CommTerm | None = None  # measured communication per forward (a sharded sweep)
    cluster: dict | None = None  # ranks, backend, hosts, parallel of a sharded sweep
    target_pipelined: tuple[tuple[int, int, float], ...] = ()  # (batch, tokens, seconds per forward)
    draft_pipelined: tuple[tuple[int, float], ...] = ()
    routing: expert_reads.Routing = expert_reads.Routing()  # unique experts per (B, t); uniform default
    kv_points: tuple[tuple[int, int, int, float], ...] = ()  # (batch, tokens, context, seconds) at a second context

    @property
    def drafted(self) -> bool:
        """Whether T_D(B,1) and T_rej(B) were measured, so speedups can be predicted."""
        return bool(self.draft) and bool(self.reject)


@dataclass(frozen=True)
class VariantFit:
    name: str
    params: theory.TimeModel
    k_kv: float  # MagicDec's KV-read term: seconds per cached token per sequence
    bounds: dict[str, tuple[float, float]]
    train: list[dict]
    heldout: list[dict]
    heldout_mape: float | None
    worst: dict | None
    cost: float
    k_seq: float = 0.0  # seconds per sequence that do not grow with context (0: not told apart)
    kv_rows: list[dict] = field(default_factory=list)  # the fit at the second context


@dataclass(frozen=True)
class FitResult:
    variants: list[VariantFit]
    chosen: str
    inputs: FitInputs = field(repr=False)
    pipelining: pipelining.Pipelining = pipelining.Pipelining()

    def variant(self, name: str) -> VariantFit:
        return next(v for v in self.variants if v.name == name)

    @property
    def best(self) -> VariantFit:
        return self.variant(self.chosen)

    @property
    def params(self) -> theory.TimeModel:
        return self.best.params

    @property
    def k_kv(self) -> float:
        return self.best.k_kv

    @property
    def bounds(self) -> dict[str, tuple[float, float]]:
        return self.best.bounds

    @property
    def heldout_mape(self) -> float | None:
        return self.best.heldout_mape

    def model(self, name: str | None = None, timed_one_row: bool = True) -> FittedModel:
        """A variant ready to predict; with ``timed_one_row``, its one-row forward is the sweep's
        timing of it (``one_row``), else the fitted curve's."""
        v = self.variant(name or self.chosen)
        i = self.inputs
        row = OneRow.from_points(i.context, i.target, i.target_pipelined) if timed_one_row else None
        return FittedModel(v.params, v.k_kv, i.experts, i.top_k, i.ridge_tokens, v.name,
                           i.sort_threshold, i.drafted, self.pipelining, i.comm, i.routing, row, v.k_seq)


@dataclass(frozen=True)
class FittedModel:
    """One fitted variant, ready to predict T_T(B,t) at any context and S(B,gamma)."""

    params: theory.TimeModel
    k_kv: float
    experts: int
    top_k: int
    ridge_tokens: float
    loads: str
    sort_threshold: int
    drafted: bool
    pipelining: pipelining.Pipelining = pipelining.Pipelining()
    comm: cluster.CommTerm | None = None  # a sharded forward's measured communication
    routing: expert_reads.Routing = expert_reads.Routing()  # unique experts the routing activates
    one_row: OneRow | None = None  # the sweep's timing of T_T(1,1), which the curve misses
    k_seq: float = 0.0  # seconds per sequence that do not grow with context (theory.kv_time)

    def target(self, batch, tokens, context: int, pipelined: bool = False, comm: bool = True,
               active=None) -> np.ndarray:
        """T_T(B,t) at context L: Algorithm 1 for n = B*t tokens plus MagicDec's k_kv*B*L, plus a
        sharded forward's communication C(n) (``comm=False``: a free link); with ``pipelined``,
        less the graph-building time a pipelined loop hides. The one-row forward (n = 1) is the
        sweep's own timing where it has one, carried from its context to L by the KV term.
        ``active``: the unique experts at those points, where the caller has them already."""
        batch = np.asarray(batch, dtype=float)
        n = batch * np.asarray(tokens, dtype=float)
        link = self.comm.time(n) if comm and self.comm is not None else 0.0
        if active is None:
            active = self.routing.unique(batch, tokens, self.experts, self.top_k)
        kv = theory.kv_time(batch, context, self.k_kv, self.k_seq)
        sync = (self.params.target_time(n, self.experts, self.top_k, self.ridge_tokens, self.loads,
                                        self.sort_threshold, active) + kv + link)
        curve = pipelining.pipelined(sync, self.pipelining.target_s) if pipelined else sync
        if self.one_row is None:
            return curve
        # The timing includes the sweep's own link; a free link takes the measured one off.
        free_link = self.comm.time(n) if not comm and self.comm is not None else 0.0
        here = (self.one_row.seconds(pipelined, self.pipelining.target_s) + kv
                - theory.kv_time(batch, self.one_row.context, self.k_kv, self.k_seq) - free_link)
        return np.where((n == 1) & (here > 0), here, curve)

    def speedup(self, batch, gamma: int, alpha: float, context: int, verify: str = DEFAULT_VERIFY,
                self_draft: bool = False, comm: bool = True) -> np.ndarray:
        """S(B, gamma) at acceptance alpha and context L, each forward timed as the loops run it
        (``pipelining``); a self-draft's step is the target's."""
        sigma = theory.normalised_acceptance(alpha, gamma)
        return theory.speedup(sigma, gamma, *self.step_times(batch, gamma, context, verify, self_draft, comm))

    def step_times(self, batch, gamma: int, context: int, verify: str = DEFAULT_VERIFY,
                   self_draft: bool = False, comm: bool = True) -> tuple[np.ndarray, ...]:
        """(plain step, verify forward, mean draft step, rejection sampling) of a round, each as
        the loops run it; a round costs gamma draft steps + the verify + rejection sampling."""
        if not self.drafted:
            raise MacMoesdError(NO_DRAFT)
        plain = self.target(batch, 1, context, pipelined=True, comm=comm)
        verify_t = self.target(batch, verify_tokens(gamma, verify), context, pipelined=True, comm=comm)
        if self_draft:
            draft = pipelining.draft_step(self.target(batch, 1, context, comm=comm),
                                          self.pipelining.target_s, gamma)
        else:
            draft = pipelining.draft_step(self.params.draft_time(batch, self.ridge_tokens),
                                          self.pipelining.draft_s, gamma)
        return plain, verify_t, draft, self.params.reject_time(batch)

    @classmethod
    def from_document(cls, doc: dict, variant: str | None = None) -> FittedModel:
        """The chosen (or the named) variant of a stored fit document."""
        name = variant or doc["chosen"]
        v = next(x for x in doc["variants"] if x["name"] == name)
        params = {k: (0.0 if val is None else val) for k, val in v["params"].items()}
        comm = doc.get("communication")
        return cls(theory.TimeModel(**params), v["k_kv"], doc["experts"], doc["top_k"],
                   doc["ridge_tokens"], name, doc["sort_threshold"], doc["drafted"],
                   pipelining.Pipelining.from_dict(doc.get("pipelining")),
                   cluster.CommTerm.from_dict(comm) if comm else None,
                   expert_reads.Routing.from_dict(doc.get("routing")),
                   OneRow.from_dict(doc.get("one_row")), v.get("k_seq", 0.0))


# ---- reading a results file ----


def _as_pairs(points: dict) -> list[tuple[int, int, float]]:
    out = []
    for key, m in points.items():
        batch, tokens = (int(v) for v in key.split("x"))
        out.append((batch, tokens, float(m["median_s"])))
    return sorted(out)


def inputs_from_results(data: dict, model: str | None = None, verify: str = DEFAULT_VERIFY,
                        draft_model: str | None = None) -> FitInputs:
    """Everything the fit needs from one results file; what is missing is named, not fatal,
    unless the target sweep itself is. The drafter step is ``draft_model``'s when named, else
    the first measured at the target's context (a file may hold several runs' drafters)."""
    views = [m for m in Digest(data).models if m.experts and (model is None or m.name == model)]
    if not views:
        which = f" of {model}" if model else ""
        raise MacMoesdError(f"no MoE sweep{which} in the results: run `mac-moesd sweep MODEL` first")
    view = views[0]
    name, full, footprint = view.name, view.full, view.footprint
    points, extrapolated = full_depth_points(view.entries)
    target = _as_pairs(points)
    counts = {(b, t): float(points[f"{b}x{t}"]["unique_experts"]) for b, t, _ in target
              if points[f"{b}x{t}"].get("unique_experts") is not None}
    target_pipelined = _as_pairs(full_depth_points(view.entries, "pipelined_points")[0])
    kv_points = _second_context(view.entries)
    missing = []

    drafts = [d for d in data.get("draft", {}).values() if d.get("points")
              and (draft_model is None or d["model"] == draft_model)]
    drafts.sort(key=lambda d: d.get("context") != full["context"])  # same context first
    draft = drafts[0] if drafts else None
    if draft is None:
        missing.append(NO_DRAFT)
    vocab = full.get("vocab") or None
    rejects = [e for e in data.get("reject", {}).values()
               if vocab in (None, e.get("vocab")) and e.get("points")]
    if draft is not None and not rejects:
        missing.append(NO_REJECT)

    fmt = view.weight_format
    ridge, ridge_source, bandwidth, bandwidth_source = _roofline_or_spec(data, full["dtype"])
    shape = data.get("meta", {}).get("cluster")
    # A sharded footprint is the largest rank's; a pipeline's stages stream theirs in turn.
    stages = shape["ranks"] if shape and shape["parallel"] == "pipeline" else 1
    if ridge is not None:
        ridge_tokens = theory.ridge_in_tokens(ridge, fmt)
    else:
        ridge_tokens = float(max(b * t for b, t, _ in target))
        ridge_source = (f"{ridge_source}: knee fitted in tokens within the measured grid "
                        f"(n = B*t up to {ridge_tokens:g})")
        missing.append("no roofline and no published FLOPS for this chip: the knee is fitted within "
                       "the grid; run `mac-moesd roofline` to anchor it")
    if bandwidth is None:
        missing.append("no measured or published bandwidth: bias and k2 are bounded below by 0 only")
    if not target_pipelined:
        missing.append(NO_PIPELINED)
    if not kv_points:
        untrimmable = any(e.get("kv_untrimmable") for e in depth_entries(view.entries))
        missing.append(ONE_CONTEXT_ONLY if untrimmable else NO_SECOND_CONTEXT)
    if not view.as_run:
        missing.append(f"only a what-if sweep of {name} was found (routing {view.routing}, gather "
                       f"{view.gather}): the fit describes that, not generation as mlx-lm runs it; "
                       "rerun `mac-moesd sweep` without --routing/--gather")
    if full.get("gather") == "sorted":
        threshold, threshold_source = 0, "the sweep forced mlx-lm's sorted gather at every size"
    else:
        threshold, threshold_source = mlx_sort_threshold()
        swept = data.get("meta", {}).get("versions", {}).get("mlx_lm")
        if swept and f"mlx_lm {swept} " not in threshold_source:
            threshold_source += f"; the sweep ran mlx-lm {swept}"
    return FitInputs(
        model=name,
        experts=footprint["experts"],
        top_k=footprint["top_k"],
        weight_format=fmt,
        ridge=ridge,
        ridge_source=ridge_source,
        ridge_tokens=ridge_tokens,
        bandwidth=bandwidth,
        bandwidth_source=bandwidth_source,
        dense_bytes=footprint["bytes_dense_streamed"] * stages,
        expert_bytes=footprint["bytes_per_expert"] * stages,
        draft_bytes=draft["footprint"]["bytes_dense_streamed"] if draft else None,
        target=target,
        draft=[(b, s) for b, _, s in _as_pairs(draft["points"])] if draft and rejects else [],
        reject=[(b, s) for b, _, s in _as_pairs(rejects[0]["points"])] if draft and rejects else [],
        context=full["context"],
        draft_model=draft["model"] if draft else None,
        extrapolated=extrapolated,
        verify=verify,
        sort_threshold=threshold,
        sort_threshold_source=threshold_source,
        missing=tuple(missing),
        platform=_platform(data.get("meta", {})),
        comm=cluster.comm_term(data, name),
        cluster=shape,
        target_pipelined=tuple(target_pipelined),
        draft_pipelined=tuple((b, s) for b, _, s in _as_pairs(draft.get("pipelined_points", {})))
        if draft and rejects else (),
        routing=expert_reads.fit_routing(counts, footprint["experts"], footprint["top_k"]),
        kv_points=kv_points,
    )


def _second_context(entries: list[dict]) -> tuple[tuple[int, int, int, float], ...]:
    """The one-token points timed at the sweep's second context beside its grid, at full depth;
    none where the sweep timed none (or its slices were timed at different second contexts)."""
    context, points = second_context_points(entries)
    return tuple((b, t, context, s) for b, t, s in _as_pairs(points))


def _platform(meta: dict) -> str:
    versions = meta.get("versions", {})
    return (f"{meta.get('chip', 'this machine')} ({meta.get('backend', '?')} backend) with MLX "
            f"{versions.get('mlx', '?')} and mlx-lm {versions.get('mlx_lm', '?')}")


def _roofline_or_spec(data: dict, dtype: str) -> tuple[float | None, str, float | None, str]:
    """(ridge FLOP/byte for ``dtype`` compute, its source, bandwidth bytes/s, its source)."""
    roof = data.get("roofline")
    if roof:
        bandwidth = roof["bandwidth_ceiling_gbs"] * 1e9
        bw_source = f"measured ({roof['bandwidth_ceiling_source']})"
        by_dtype = roof.get("ridge_by_dtype") or {}
        if dtype in by_dtype:
            return by_dtype[dtype], f"measured roofline ({dtype} matmul peak)", bandwidth, bw_source
        return (roof["ridge_flop_per_byte"], f"measured roofline ({roof['ridge_dtype']} peak; no {dtype} "
                "matmul measured)", bandwidth, bw_source)
    meta = data.get("meta", {})
    spec = hardware.lookup_spec(meta.get("chip", ""), meta.get("gpu_cores"))
    if spec is None:
        return None, "no roofline and no published spec", None, "none (no roofline, no published spec)"
    where = f"published spec of {spec.name} (no roofline measured)"
    if spec.ridge_flop_per_byte is None:
        return None, f"{where} without FLOPS", spec.bandwidth_bytes_s, where
    note = "" if dtype == "float32" else f"; Apple publishes FP32 only, taken as the {dtype} peak too"
    return spec.ridge_flop_per_byte, f"{where}, FP32 peak{note}", spec.bandwidth_bytes_s, where


# ---- the fit ----


def bounds_for(inputs: FitInputs, loads: str = "unique") -> dict[str, tuple[float, float]]:
    inf = math.inf

    def from_bytes(nbytes: float | None) -> tuple[float, float]:
        if inputs.bandwidth is None or nbytes is None:
            return (0.0, inf)
        nominal = nbytes / inputs.bandwidth
        return (nominal * BANDWIDTH_SLACK, 5 * nominal)

    # Within the grid (no ridge known) the knee may sit anywhere from one token to the largest n.
    lam = LAM_BOUNDS if inputs.ridge is not None else (1.0 / inputs.ridge_tokens, 1.0)
    return {
        "bias": from_bytes(inputs.dense_bytes), "k1": (0.0, inf), "k2": from_bytes(inputs.expert_bytes),
        "k3": (0.0, 0.0) if loads == "pairs" else (0.0, inf),
        "lam": lam, "s": (1.0, 2.0),
        # Without a drafter sweep the side terms are held at 0 (equal bounds: not fitted).
        "draft_bias": from_bytes(inputs.draft_bytes) if inputs.drafted else (0.0, 0.0),
        "draft_k": (0.0, inf) if inputs.drafted else (0.0, 0.0),
        "reject_bias": (0.0, inf) if inputs.drafted else (0.0, 0.0),
        "reject_k": (0.0, inf) if inputs.drafted else (0.0, 0.0),
    }


def split(points: list, every: int = HOLDOUT_EVERY) -> tuple[list, list]:
    """Every ``every``-th point (from the second) is held out; the rest train."""
    held = [p for i, p in enumerate(points) if i % every == 1]
    train = [p for i, p in enumerate(points) if i % every != 1]
    return train, held


def _check_enough(inputs: FitInputs, train: list) -> None:
    short = []
    if len(train) < MIN_TARGET_TRAIN:
        need = next(n for n in range(1, 1000) if len(split(list(range(n)))[0]) >= MIN_TARGET_TRAIN)
        short.append(f"{need - len(inputs.target)} more T_T(B,t) points (have {len(inputs.target)}, "
                     f"need {need} with every {HOLDOUT_EVERY}rd held out)")
    if inputs.drafted and len({b for b, _ in inputs.draft}) < MIN_SIDE_POINTS:
        short.append(f"T_D at {MIN_SIDE_POINTS - len(inputs.draft)} more batch sizes")
    if inputs.drafted and len({b for b, _ in inputs.reject}) < MIN_SIDE_POINTS:
        short.append(f"T_rej at {MIN_SIDE_POINTS - len(inputs.reject)} more batch sizes")
    if short:
        raise BadInput("too few points to fit the time model: need " + "; ".join(short))


def _initial(bounds: dict[str, tuple[float, float]], inputs: FitInputs) -> np.ndarray:
    t1 = min(s for b, t, s in inputs.target if b * t == min(bb * tt for bb, tt, _ in inputs.target))

    def above(name: str, fallback: float) -> float:
        low = bounds[name][0]
        return low * 1.5 if low > 0 else fallback

    guess = {
        "bias": above("bias", t1 * 0.5), "k1": t1 * 0.1, "k2": above("k2", t1 * 0.05), "k3": t1 * 0.1,
        "lam": 0.5, "s": 1.05,
        "draft_bias": above("draft_bias", min((s for _, s in inputs.draft), default=0.0) * 0.5),
        "draft_k": min((s for _, s in inputs.draft), default=0.0) * 0.1,
        "reject_bias": min((s for _, s in inputs.reject), default=0.0) * 0.5,
        "reject_k": min((s for _, s in inputs.reject), default=0.0) * 0.1,
    }
    lo = np.array([bounds[n][0] for n in theory.TimeModel.names()])
    hi = np.array([bounds[n][1] for n in theory.TimeModel.names()])
    x0 = np.array([guess[n] for n in theory.TimeModel.names()])
    return np.clip(x0, lo, hi)


def fit_variant(inputs: FitInputs, loads: str) -> VariantFit:
    """Algorithm 1 with the expert-load term of ``loads``; parameters with equal bounds are held.

    Scored on the held-out points of a fit to the others, then refitted on every point: the
    held-out error is the procedure's, the parameters use all the data. The points at the second
    context train both fits; the held-out error stays at the sweep's own context."""
    train, held = split(inputs.target)
    _check_enough(inputs, train)
    scored = _solve(inputs, loads, train)
    held_rows = _rows(inputs, loads, scored, held)
    fitted = _solve(inputs, loads, inputs.target)
    mape = float(np.mean([abs(r["error"]) for r in held_rows])) if held_rows else None
    worst = max(held_rows, key=lambda r: abs(r["error"])) if held_rows else None
    return VariantFit(loads, fitted.params, fitted.k_kv, bounds_for(inputs, loads),
                      _rows(inputs, loads, fitted, inputs.target), held_rows, mape, worst, fitted.cost,
                      fitted.k_seq, _rows(inputs, loads, fitted, inputs.kv_points))


@dataclass(frozen=True)
class _Solved:
    params: theory.TimeModel
    k_kv: float
    k_seq: float
    cost: float


def _target_time(inputs: FitInputs, loads: str, solved, batch, tokens, context=None, active=None):
    """The fitted T_T at the sweep's points: the routing's own unique experts (``active``, where
    already counted up), the sweep's context (or the points' own) and a sharded sweep's measured
    communication (``FittedModel.target``, synchronous)."""
    fitted = FittedModel(solved.params, solved.k_kv, inputs.experts, inputs.top_k, inputs.ridge_tokens, loads,
                         inputs.sort_threshold, inputs.drafted, comm=inputs.comm, routing=inputs.routing,
                         k_seq=solved.k_seq)
    return fitted.target(batch, tokens, inputs.context if context is None else context, active=active)


def _rows(inputs: FitInputs, loads: str, solved, points) -> list[dict]:
    """Fitted against measured at ``points``: (batch, tokens, seconds) at the sweep's context, or
    (batch, tokens, context, seconds) at their own, which the rows then record."""
    out = []
    for *shape, s in points:
        b, t, context = (*shape, None) if len(shape) == 2 else shape
        pred = float(_target_time(inputs, loads, solved, b, t, context))
        row = {"batch": b, "tokens": t, "measured_s": s, "predicted_s": pred, "error": pred / s - 1}
        out.append(row if context is None else {**row, "context": context})
    return out


def _solve(inputs: FitInputs, loads: str, points: list) -> _Solved:
    """Least squares on relative residuals of ``points``, the points at the second context and
    the drafter and rejection steps. k_seq is free only where a second context separates it."""
    bounds = bounds_for(inputs, loads)
    names = theory.TimeModel.names()
    seq_hi = np.inf if inputs.kv_points else 0.0
    lo_all = np.append([bounds[n][0] for n in names], [0.0, 0.0])
    hi_all = np.append([bounds[n][1] for n in names], [np.inf, seq_hi])
    if np.any(lo_all > hi_all):
        raise MacMoesdError("inconsistent bounds: check the bandwidth and byte counts")
    free = lo_all < hi_all
    R = inputs.ridge_tokens
    rows = [(b, t, inputs.context, s) for b, t, s in points] + list(inputs.kv_points)
    tb, tt, tl, ty = (np.array(column, dtype=float) for column in zip(*rows))
    active = inputs.routing.unique(tb, tt, inputs.experts, inputs.top_k)  # fixed: counted once
    db = np.array([b for b, _ in inputs.draft], dtype=float)
    dy = np.array([s for _, s in inputs.draft])
    rb = np.array([b for b, _ in inputs.reject], dtype=float)
    ry = np.array([s for _, s in inputs.reject])

    def full_vector(x):
        out = lo_all.copy()
        out[free] = x
        return out

    def solved(v) -> _Solved:
        return _Solved(theory.TimeModel.from_vector(v[:-2]), float(v[-2]), float(v[-1]), 0.0)

    def residuals(x):
        fitted = solved(full_vector(x))
        m = fitted.params
        return np.concatenate([
            _target_time(inputs, loads, fitted, tb, tt, tl, active) / ty - 1,
            m.draft_time(db, R) / dy - 1,
            m.reject_time(rb) / ry - 1,
        ])

    x0 = np.append(_initial(bounds, inputs), [0.0, 0.0])
    lam_i, s_i = names.index("lam"), names.index("s")
    lam_lo, lam_hi = bounds["lam"]
    # Multi-start over the two shape parameters: G's knee makes the cost non-convex.
    best = None
    for lam_frac in (0.1, 0.5, 0.95):
        for s in (1.01, 1.2, 1.6):
            start = x0.copy()
            start[lam_i], start[s_i] = lam_lo + lam_frac * (lam_hi - lam_lo), s
            res = least_squares(residuals, start[free], bounds=(lo_all[free], hi_all[free]),
                                method="trf", x_scale="jac")
            if best is None or res.cost < best.cost:
                best = res
    return replace(solved(full_vector(best.x)), cost=float(best.cost))


def fit(inputs: FitInputs, variants: tuple[str, ...] = theory.EXPERT_LOADS) -> FitResult:
    """Every expert-load variant; the lowest held-out MAPE is chosen (ties go to the earlier,
    MoESD's ``unique`` first)."""
    fitted = [fit_variant(inputs, name) for name in variants]
    scored = [v for v in fitted if v.heldout_mape is not None]
    chosen = min(scored, key=lambda v: v.heldout_mape) if scored else fitted[0]
    result = FitResult(fitted, chosen.name, inputs)
    return replace(result, pipelining=measure_pipelining(result))


def measure_pipelining(result: FitResult) -> pipelining.Pipelining:
    """The seconds per forward pipelining hides, from the points timed both ways, and how well
    the fitted T_T less that figure matches the pipelined points."""
    i = result.inputs
    # From the one-token points: their chains are as long as decoding's (``Budget.decode_chain``)
    # and their forwards the shortest, so the figure's noise the smallest; a grid without t = 1
    # takes every point.
    pipelined = {(b, t): s for b, t, s in i.target_pipelined}
    decode = {k: s for k, s in pipelined.items() if k[1] == 1}
    target_s, target_n = pipelining.hidden_seconds({(b, t): s for b, t, s in i.target}, decode or pipelined)
    draft_s, draft_n = pipelining.hidden_seconds(dict(i.draft), dict(i.draft_pipelined))
    found = pipelining.Pipelining(target_s, draft_s, target_n, draft_n)
    if not target_n:
        return found
    model = replace(result.model(timed_one_row=False), pipelining=found)
    errors = [float(model.target(b, t, i.context, pipelined=True)) / s - 1 for b, t, s in i.target_pipelined]
    return replace(found, target_mape=float(np.mean(np.abs(errors))))


# ---- predictions ----


def verify_tokens(gamma: int, verify: str) -> int:
    return gamma + 1 if verify == "gamma+1" else gamma


def predict(
    model: FittedModel,
    context: int,
    batches=DEFAULT_BATCHES,
    gammas=DEFAULT_GAMMAS,
    alphas=DEFAULT_ALPHAS,
    verify: str = DEFAULT_VERIFY,
) -> list[dict]:
    """S(B, gamma) and target efficiency for every batch, draft length and acceptance rate.

    ``speedup`` is None when the drafter was not measured.
    """
    b = np.asarray(batches, dtype=float)
    plain = model.target(b, 1, context)
    rows = []
    for gamma in gammas:
        efficiency = theory.target_efficiency(plain, model.target(b, verify_tokens(gamma, verify), context))
        steps = (np.broadcast_to(x, b.shape) for x in model.step_times(b, gamma, context, verify)) \
            if model.drafted else None
        parts = list(zip(*steps)) if steps is not None else [None] * len(batches)
        for alpha in alphas:
            s = (model.speedup(b, gamma, alpha, context, verify) if model.drafted
                 else [None] * len(batches))
            rows += [{"batch": int(bb), "gamma": gamma, "alpha": alpha,
                      "speedup": None if v is None else float(v), "target_efficiency": float(e),
                      **_break_even(p, gamma, alpha)}
                     for bb, v, e, p in zip(batches, s, efficiency, parts)]
    return rows


def _break_even(parts, gamma: int, alpha: float) -> dict:
    """A prediction row's break-even acceptance and drafter cost (``break_even``) from its round's
    step times (plain, verify, draft step, reject); None without a drafter."""
    if parts is None:
        return {"break_even_alpha": None, "break_even_draft_ratio": None}
    plain, verify_s, draft, reject = (float(x) for x in parts)
    return {"break_even_alpha": break_even.break_even_alpha(plain, verify_s, draft, reject, gamma),
            "break_even_draft_ratio": break_even.break_even_draft_ratio(plain, verify_s, reject, gamma, alpha)}


def peaks(predictions: list[dict]) -> list[dict]:
    """For each (gamma, alpha): the batch of peak speedup and the batches within peak/sqrt(2)."""
    out = []
    keys = sorted({(p["gamma"], p["alpha"]) for p in predictions if p["speedup"] is not None})
    for gamma, alpha in keys:
        rows = [p for p in predictions if p["gamma"] == gamma and p["alpha"] == alpha]
        top = max(rows, key=lambda p: p["speedup"])
        window = [p["batch"] for p in rows if p["speedup"] >= top["speedup"] / math.sqrt(2)]
        out.append({"gamma": gamma, "alpha": alpha, "peak_batch": top["batch"],
                    "peak_speedup": top["speedup"], "window": [min(window), max(window)]})
    return out


def sparsity_sweep(model: FittedModel, context: int, gamma=4, alpha=0.7, batches=DEFAULT_BATCHES,
                   verify=DEFAULT_VERIFY) -> list[dict]:
    """The same fitted model with K changed (as MoESD edits num_experts_per_tok).

    Acceptance is held at ``alpha`` for every K, which is what MoESD's rescaling of raw speedups
    by sigma_K0 / sigma_K achieves for measured runs.
    """
    if not model.drafted:
        return []
    E, K = model.experts, model.top_k
    ks = sorted({k for k in (1, 2, K // 2, K, 2 * K, 4 * K) if 1 <= k <= E})
    out = []
    for k in ks:
        # The counted experts and the timed one-row forward were for the model's own K; another
        # K takes the fitted routing form and the curve.
        changed = replace(model, top_k=k, routing=model.routing if k == K else model.routing.form_only(),
                          one_row=model.one_row if k == K else None)
        rows = predict(changed, context, batches, (gamma,), (alpha,), verify)
        top = max(rows, key=lambda p: p["speedup"])
        out.append({"top_k": k, "rho": k / E, "peak_batch": top["batch"], "peak_speedup": top["speedup"],
                    "speedup_batch1": rows[0]["speedup"]})
    return out


def paper_comparison(result: FitResult, alphas=DEFAULT_ALPHAS, gammas=DEFAULT_GAMMAS) -> list[dict]:
    """Batch-1 speedups: the prediction (the chosen variant with the timed one-row forward,
    gamma+1 verify tokens, as the loops run), MoESD's ``unique`` curve with the same verify, and
    ``unique`` with the paper's gamma verify tokens."""
    if not result.inputs.drafted:
        return []
    L = result.inputs.context
    chosen, unique = result.model(), result.model("unique", timed_one_row=False)
    return [{"gamma": g, "alpha": a,
             "chosen": float(chosen.speedup(1, g, a, L, "gamma+1")[()]),
             "unique": float(unique.speedup(1, g, a, L, "gamma+1")[()]),
             "unique_paper_verify": float(unique.speedup(1, g, a, L, "gamma")[()])}
            for g in gammas for a in alphas]


def regime(result: FitResult) -> str:
    """One sentence: which expert-load regime the held-out error says this chip follows."""
    ordered = sorted((v for v in result.variants if v.heldout_mape is not None), key=lambda v: v.heldout_mape)
    if not ordered:
        return f"no held-out points: `{result.chosen}` kept by default"
    best = ordered[0]
    text = f"On {result.inputs.platform}, `{best.name}` fits best on held-out points: {REGIMES[best.name]}"
    if len(ordered) > 1 and ordered[1].heldout_mape - best.heldout_mape < INDISTINCT_MAPE:
        text += (f"; `{ordered[1].name}` is within {INDISTINCT_MAPE * 100:.1f} points of held-out MAPE, "
                 "so this grid does not tell them apart")
    return text + "."


def _params_doc(v: VariantFit, drafted: bool) -> dict[str, float | None]:
    side = ("draft_bias", "draft_k", "reject_bias", "reject_k")
    return {k: (None if (not drafted and k in side) else val) for k, val in v.params.to_dict().items()}


def fit_document(result: FitResult, alphas=DEFAULT_ALPHAS) -> dict:
    i = result.inputs
    best = result.best
    chosen = result.model()
    predictions = predict(chosen, i.context, alphas=alphas, verify=i.verify)
    sorted_from = (math.ceil(i.sort_threshold / i.top_k) if i.sort_threshold > 0 else 1)
    return {
        "model": i.model,
        "draft_model": i.draft_model,
        "drafted": i.drafted,
        "experts": i.experts,
        "top_k": i.top_k,
        "context": i.context,
        "weight_format": i.weight_format,
        "ridge_flop_per_byte": i.ridge,
        "ridge_source": i.ridge_source,
        "ridge_tokens": i.ridge_tokens,
        "knee_tokens": best.params.knee(i.ridge_tokens),
        "bandwidth_bytes_s": i.bandwidth,
        "bandwidth_source": i.bandwidth_source,
        "verify_tokens": i.verify,
        "extrapolated": i.extrapolated,
        "sort_threshold": i.sort_threshold,
        "sort_threshold_source": i.sort_threshold_source,
        "sorted_from_tokens": sorted_from,
        "chosen": result.chosen,
        "regime": regime(result),
        "variants": [{"name": v.name, "heldout_mape": v.heldout_mape, "params": _params_doc(v, i.drafted),
                      "k_kv": v.k_kv, "k_seq": v.k_seq, "knee_tokens": v.params.knee(i.ridge_tokens),
                      "worst_point": v.worst}
                     for v in result.variants],
        "missing": list(i.missing),
        "pipelining": result.pipelining.to_dict(),
        "routing": i.routing.to_dict(),
        "one_row": chosen.one_row.to_dict() if chosen.one_row else None,
        "params": _params_doc(best, i.drafted),
        "k_kv": best.k_kv,
        "k_seq": best.k_seq,
        "kv": kv_section(result),
        "bounds": {k: [lo, hi if math.isfinite(hi) else None] for k, (lo, hi) in best.bounds.items()},
        "train_points": best.train,
        "heldout_points": best.heldout,
        "heldout_mape": best.heldout_mape,
        "worst_point": best.worst,
        "predictions": predictions,
        "peaks": peaks(predictions),
        "sparsity": sparsity_sweep(chosen, i.context, verify=i.verify),
        "paper_comparison": paper_comparison(result, alphas),
        "communication": i.comm.to_dict() if i.comm is not None else None,
        "cluster": cluster_section(chosen, i),
    }


def kv_section(result: FitResult) -> dict:
    """How the KV term was identified: the two contexts, and the chosen fit at the second one."""
    i, best = result.inputs, result.best
    return {"context": i.context, "second_context": i.kv_points[0][2] if i.kv_points else None,
            "separated": bool(i.kv_points), "k_kv": best.k_kv, "k_seq": best.k_seq,
            "mape": float(np.mean([abs(r["error"]) for r in best.kv_rows])) if best.kv_rows else None,
            "points": best.kv_rows}


def cluster_section(model: FittedModel, inputs: FitInputs) -> dict | None:
    """Predicted SD on the cluster the sweep ran on, with and without its communication."""
    if inputs.comm is None or inputs.cluster is None:
        return None
    L, verify = inputs.context, inputs.verify

    def target(batch, tokens):
        return model.target(batch, tokens, L, pipelined=True)

    def speedup(batch, gamma, alpha, with_comm):
        if not model.drafted:
            return None
        return float(model.speedup(batch, gamma, alpha, L, verify, comm=with_comm)[()])

    return {**inputs.cluster, "verify_tokens": verify,
            "rows": cluster.cluster_rows(target, model.comm, speedup, lambda g: verify_tokens(g, verify))}


def decoding_context(prompt: float, new_tokens: int) -> float:
    """The context an SD run's forwards see on average: its prompt, plus half the tokens it
    decodes (the cache grows by every one)."""
    return prompt + new_tokens / 2


def run_context(run: dict, doc: dict) -> float:
    """``decoding_context`` of one row of a stored spec document."""
    return decoding_context(run["context"] if "context" in run else doc["context"], doc.get("new_tokens", 0))


def run_alpha(run: dict) -> float | None:
    """The acceptance a timed SD run realised (alpha solved from its mean accepted draft tokens per
    round), else its imposed alpha: a prediction set beside a measured speedup must use the
    acceptance that speedup came from (emulated draws scatter around the imposed alpha: 0.59
    realised for 0.70 in a 3-run, 32-token batch-1 check)."""
    realised = run.get("measured_alpha")
    return realised if realised is not None else run.get("alpha")


def run_prediction(predictor, run: dict, doc: dict) -> float | None:
    """A timed SD run's speedup as ``predictor`` (``speedup_predictor``) gives it at the run's
    realised alpha and context, or the fitted model's as stored with the run when there is no
    predictor or alpha (runs made before ``predicted_by`` stored the model's as
    ``predicted_speedup``)."""
    alpha = run_alpha(run)
    if predictor is None or alpha is None:
        return (run.get("predicted_by") or {}).get("model", run["predicted_speedup"])
    return predictor(run["batch"], run["gamma"], alpha, run["mode"] == "self-draft", run_context(run, doc))


def sweep_plain_step(data: dict, model: str):
    """A function batch -> the sweep's pipelined T_T(B,1) of ``model`` at full depth (seconds),
    or None where the sweep did not time it; None when the results hold no sweep of ``model``."""
    views = [m for m in Digest(data).models if m.name == model]
    if not views:
        return None
    points, _ = full_depth_points(views[0].entries, "pipelined_points")

    def step(batch: int) -> float | None:
        point = points.get(f"{batch}x1")
        return float(point["median_s"]) if point else None

    return step


def speedup_predictor(fit_doc: dict, verify: str = DEFAULT_VERIFY):
    """A function (batch, gamma, alpha, self_draft, context) -> predicted S from a stored fit
    document's chosen variant, or None when the fit had no drafter to predict speedups with.

    The KV term is taken at the context passed in (the SD run's own), not the fit's.
    """
    if not fit_doc.get("drafted") or "chosen" not in fit_doc:
        return None
    model = FittedModel.from_document(fit_doc)

    def predict_one(batch: int, gamma: int, alpha: float, self_draft: bool, context: int) -> float:
        return float(model.speedup(batch, gamma, alpha, context, verify, self_draft)[()])

    return predict_one
