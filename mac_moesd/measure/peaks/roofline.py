"""The roofline of this machine: sustained bandwidth, peak FLOPS, and the ridge between them.

Bandwidth: STREAM-style read, copy and triad over sizes from cache-resident to far past the
system-level cache (bytes counted as STREAM counts them), and the weight-read bandwidth decode
really sees, a matrix-vector product over a large weight matrix (float and quantized). FLOPS:
square matmuls per dtype, the FMA kernel on Metal, and quantized matmul against a realistic weight
matrix as the number of tokens grows, the GEMV-to-GEMM transition that decides where decode turns
compute-bound. Ridge RP = peak FLOPS / sustained bandwidth (LLM-Viewer's roofline model).

GEMV and quantized-matmul launches form a chain (each reads the previous output, as a decode's
layers do) over distinct weight copies of ``distinct_bytes`` in all: one weight re-read K times
in one evaluation would be served from the system-level cache of Pro, Max and Ultra chips (their
quick 4-bit weights fit it), and a cache-speed row would become the chip's "bandwidth". Where the
configured sizes do not fit usable memory, ``fit_memory`` shrinks them and says what it changed.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Hashable, TypeVar

import mlx.core as mx
import numpy as np

from mac_moesd.machine import hardware, memory
from mac_moesd.measure.clock import timing
from mac_moesd.measure.peaks import kernels
from mac_moesd.analysis import theory
from mac_moesd.errors import BadInput
from mac_moesd.results import ResultsStore, schema
from mac_moesd.units import MiB, gib

__all__ = ["RooflineConfig", "fit_memory", "knee_tokens", "progress_steps", "run_config", "run_roofline",
           "weight_copies"]

# The STREAM sizes per array, the one schedule every command reads: the default's go from
# cache-resident to far past the system-level cache; --quick takes three of that range; ``run`` on
# MLX's CPU backend takes the quick sizes and one more far past a CPU's caches.
SIZES = tuple(MiB * s for s in (1, 4, 16, 64, 256, 1024))
QUICK_SIZES = (MiB, 16 * MiB, 128 * MiB)
CPU_SIZES = (*QUICK_SIZES, 512 * MiB)


@dataclass(frozen=True)
class RooflineConfig:
    sizes: tuple[int, ...] = SIZES  # bytes per array
    gemv_bytes: int = 512 * MiB
    matmul_n: int = 4096
    qmm_shape: tuple[int, int] = (4096, 4096)  # (out, in) of the quantized weight
    qmm_tokens: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    dtypes: tuple[str, ...] = ("float32", "float16", "bfloat16")
    plateau_from: int = 256 * MiB  # sizes at or above this count as "far past the caches"
    budget: timing.Budget = field(default_factory=timing.Budget)
    fma_iterations: int = 4096
    min_eval_s: float = timing.MIN_EVAL_S  # K launches per timed eval last at least this
    # GEMV and quantized-matmul weights are copied until the copies hold this much: past the
    # largest system-level cache of an Apple chip (tens of MB on Max and Ultra), so no launch of
    # a chain finds its weight cached. Tests lower it to keep their copies small.
    distinct_bytes: int = 256 * MiB
    min_launch_bytes: int = 2**30  # K launch outputs of one timed eval may hold at least this

    def __post_init__(self):
        if self.qmm_shape[0] != self.qmm_shape[1]:
            raise ValueError("qmm_shape must be square: each launch of a chain reads the previous output")


QUICK = RooflineConfig(
    sizes=QUICK_SIZES,
    gemv_bytes=128 * MiB,
    matmul_n=1024,
    qmm_shape=(2048, 2048),
    qmm_tokens=(1, 4, 16, 64),
    plateau_from=128 * MiB,
    budget=timing.QUICK,
    fma_iterations=1024,
)


def run_config(backend: str, quick: bool) -> RooflineConfig:
    """The roofline ``run`` measures: ``QUICK`` with --quick, else the default, with the CPU sizes
    on MLX's CPU backend."""
    if quick:
        return QUICK
    return RooflineConfig(sizes=CPU_SIZES) if backend == "cpu" else RooflineConfig()


DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
GEMV_COLS = 4096
# The GEMV weights timed: (label, bits), unquantized ones in the dtype their label names.
GEMV_WEIGHTS = (("float32", None), ("float16", None), ("q8", 8), ("q4", 4))
QMM_BITS = (4, 8)  # the quantized matmul curves


def progress_steps(cfg: RooflineConfig) -> int:
    """The steps ``run_roofline`` reports: each STREAM size, GEMV weight, matmul dtype and
    quantized curve."""
    return len(cfg.sizes) + len(GEMV_WEIGHTS) + len(cfg.dtypes) + len(QMM_BITS)


ALIGN = 4 * kernels.READ_ROW  # array sizes are whole rows of the read twin
# What a check holds besides the arrays it compares: a few chunk-sized temporaries (kernels.check).
CHECK_TEMP_BYTES = 8 * kernels.CHECK_CHUNK * 4


def sizes_from_mib(mib: tuple[float, ...]) -> tuple[int, ...]:
    return tuple(max(int(s * MiB) // ALIGN * ALIGN, ALIGN) for s in mib)


def launch_bytes(cfg: RooflineConfig, cap_bytes: int | None = None) -> int:
    """Bytes the K outputs of one timed eval may hold (K is capped to fit): two of the largest
    arrays, and at least ``min_launch_bytes`` (1 GiB) so a 128 MiB copy still gets several
    launches."""
    return max(2 * max(max(cfg.sizes), cap_bytes or 0), cfg.min_launch_bytes)


def gemv_shape(gemv_bytes: int) -> tuple[int, int]:
    """(rows, cols) of the GEMV weight: GEMV_COLS wide, or square below that, and never fewer
    rows than columns, so the first ``cols`` outputs of one launch are the next one's input."""
    side = max(math.isqrt(gemv_bytes // 4) // 64 * 64, 64)
    cols = min(GEMV_COLS, side)
    return max(gemv_bytes // (cols * 4), cols), cols


def copies_needed(copy_bytes: int, floor: int) -> int:
    """How many copies of ``copy_bytes`` hold at least ``floor`` bytes (at least one)."""
    return max(1, -(-floor // copy_bytes))


def quantized_bytes(rows: int, cols: int, bits: int, itemsize: int) -> int:
    """A (rows, cols) weight quantized in groups of 64: packed values plus a scale and a bias
    per group in the source dtype."""
    return rows * cols * bits // 8 + 2 * rows * (cols // 64) * itemsize


def _chained_weights_bytes(rows: int, cols: int, floor: int) -> int:
    """Peak of one weight's chained launches, counted in float32 (the widest source): every
    float copy, or every quantized copy plus the float source being quantized and one
    temporary of its size."""
    source = rows * cols * 4
    floats = copies_needed(source, floor) * source
    quantized = max(copies_needed(q, floor) * q for q in (quantized_bytes(rows, cols, b, 4) for b in (4, 8)))
    return max(floats, quantized + 2 * source)


def peak_bytes(cfg: RooflineConfig, cap_bytes: int | None = None) -> int:
    """The most the roofline holds at once: its largest step, as each function below allocates.

    stream: arrays a and b, then either K launch outputs or one verified output plus chunked
    check temporaries; gemv and quantized matmul: their weight copies (``weight_copies``) and
    the source being quantized; matmul: two n x n float32 operands plus K outputs.
    """
    big = max(max(cfg.sizes), cap_bytes or 0)
    allowance = launch_bytes(cfg, cap_bytes)
    stream = 2 * big + max(allowance, big + CHECK_TEMP_BYTES)
    gemv = _chained_weights_bytes(*gemv_shape(cfg.gemv_bytes), cfg.distinct_bytes)
    out, cols = cfg.qmm_shape
    # every point's input and its chain's two live outputs (all points are timed together)
    qmm = _chained_weights_bytes(out, cols, cfg.distinct_bytes) + 3 * sum(cfg.qmm_tokens) * cols * 4
    matmul = 2 * cfg.matmul_n**2 * 4 + allowance
    return max(stream, gemv, qmm, matmul)


def memory_estimate(cfg: RooflineConfig) -> dict:
    """The roofline stage's estimate (``memory.phases``): its largest step as ``peak_bytes`` (the
    budget ``validate`` enforces) counts it."""
    return memory.phases(roofline={"largest step": peak_bytes(cfg)})


# Shrunk no further: one 64 MiB GEMV launch still lasts far longer than a launch's fixed cost, and
# 256 MiB of launch outputs still give a 4096-square float32 matmul four launches per timed eval.
MIN_GEMV_BYTES = 64 * MiB
MIN_LAUNCH_BYTES = 256 * MiB


def _smaller(cfg: RooflineConfig) -> RooflineConfig | None:
    """One step down in memory, cheapest loss first: a STREAM size above the smallest one at or
    past the plateau; then the launch allowance and the GEMV weight, halved; then STREAM sizes
    below the plateau. None when nothing is left to shrink."""
    past = sorted(s for s in cfg.sizes if s >= cfg.plateau_from)
    if len(past) > 1:
        return replace(cfg, sizes=tuple(s for s in cfg.sizes if s != past[-1]))
    if cfg.min_launch_bytes > MIN_LAUNCH_BYTES:
        return replace(cfg, min_launch_bytes=cfg.min_launch_bytes // 2)
    if cfg.gemv_bytes > MIN_GEMV_BYTES:
        return replace(cfg, gemv_bytes=max(cfg.gemv_bytes // 2, MIN_GEMV_BYTES))
    if len(cfg.sizes) > 1:
        return replace(cfg, sizes=tuple(s for s in cfg.sizes if s != max(cfg.sizes)))
    return None


def _shape_of(cfg: RooflineConfig) -> schema.RooflineShape:
    return {"sizes_bytes": list(cfg.sizes), "gemv_bytes": cfg.gemv_bytes,
            "min_launch_bytes": cfg.min_launch_bytes, "peak_bytes": peak_bytes(cfg)}


def fit_memory(cfg: RooflineConfig, usable_bytes: int | None) -> tuple[RooflineConfig, schema.Shrunk | None]:
    """``cfg`` shrunk (``_smaller``) until its peak fits ``usable_bytes``, and what was shrunk:
    None when it fit as configured, else ``usable_bytes``, ``from`` and ``to`` (STREAM sizes,
    GEMV weight, least launch allowance and peak, in bytes) and ``plateau_reached`` (a STREAM size at
    or past ``plateau_from`` is left). An 8 GB Mac has 3-4 GiB usable, under the default's 4
    GiB peak. Refuses (``validate``) when even the smallest configuration does not fit."""
    shrunk = cfg
    while usable_bytes is not None and peak_bytes(shrunk) > usable_bytes:
        smaller = _smaller(shrunk)
        if smaller is None:
            break
        shrunk = smaller
    validate(shrunk, usable_bytes)
    if shrunk == cfg:
        return cfg, None
    assert usable_bytes is not None  # only a limit shrinks
    what: schema.Shrunk = {"usable_bytes": usable_bytes, "from": _shape_of(cfg), "to": _shape_of(shrunk),
                           "plateau_reached": max(shrunk.sizes) >= cfg.plateau_from}
    return shrunk, what


def validate(cfg: RooflineConfig, available_bytes: int | None, cap_bytes: int | None = None) -> None:
    """Refuse sizes that are nonsense or would not fit (``peak_bytes``)."""
    if not cfg.sizes or min(cfg.sizes) < 16 * 1024 or any(s % ALIGN for s in cfg.sizes):
        raise BadInput(f"--sizes must be at least 1/64 MiB each, in multiples of {ALIGN} bytes")
    need = peak_bytes(cfg, cap_bytes)
    if available_bytes is not None and need > available_bytes:
        raise BadInput(
            f"the largest size needs {gib(need)} (two arrays and the outputs of its "
            f"timed launches) but {gib(available_bytes)} is usable here; lower --max-size"
        )
    if max(max(cfg.sizes), cap_bytes or 0) > 4 * kernels.MAX_ELEMENTS:
        raise BadInput("--sizes above 8 GiB are beyond the kernels' 32-bit element count")


def _gbs(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9


K = TypeVar("K", bound=Hashable)


def timed(cfg: RooflineConfig, rng, points: dict[K, tuple[Callable[..., Any], int]],
          chained: frozenset[K] = frozenset()) -> dict[K, tuple[timing.Measurement, int]]:
    """Calibrate K for each point (``points[key]`` is ``(launch, output bytes per launch)``),
    time them together, per-launch results. Keys in ``chained`` run as a chain of launches
    (``timing.chained``: two buffers live); the others as K independent launches, K capped so
    their outputs fit ``launch_bytes``."""
    cap = launch_bytes(cfg)

    def batch(key):
        return timing.chained if key in chained else timing.launches

    def max_k(key, out):
        return timing.MAX_LAUNCHES if key in chained else max(1, min(timing.MAX_LAUNCHES, cap // max(out, 1)))

    ks = {key: timing.calibrate(fn, max_k(key, out), cfg.min_eval_s, batch(key))
          for key, (fn, out) in points.items()}
    measured = timing.measure({key: batch(key)(fn, ks[key]) for key, (fn, _) in points.items()},
                              cfg.budget, rng)
    return {key: (timing.per_launch(measured[key], ks[key]), ks[key]) for key in points}


def _row(m: timing.Measurement, k: int) -> schema.LaunchTiming:
    return {"median_s": m["median_s"], "cv": m["cv"], "repeats": m["repeats"], "launches": k,
            "eval_median_s": m["median_s"] * k}


def read_output_bytes(path: str, size: int) -> int:
    """Bytes of partial sums one read launch over ``size`` bytes writes: a float per thread of
    the Metal kernel's grid, or a float per ``READ_ROW`` floats of the MLX twin."""
    return kernels.GRID_THREADS * 4 if path == "metal" else size // kernels.READ_ROW


def stream_sweep(k: kernels.Kernels, cfg: RooflineConfig, rng, progress) -> list[schema.SizeRow]:
    """read, copy, triad at every size; each result verified before its time is kept."""
    rows: list[schema.SizeRow] = []
    for size in cfg.sizes:
        n = size // 4
        a = mx.random.uniform(shape=(n,))
        b = mx.random.uniform(shape=(n,))
        mx.eval(a, b)
        verify_stream(k, a, b, 3.0)
        read_out = read_output_bytes(k.paths["read"], size)
        # Read launches are independent (their outputs are small); copy and triad launches form
        # a chain, each reading the previous output, so K full-size outputs are never live at
        # once and a cache-sized array stays cache-sized. Triad's scale 0.5 keeps values bounded.
        # A read moves its array and writes its partial sums, counted too: the Metal kernel's
        # 1 MiB of partials doubles what a 1 MiB read moves (negligible on the plateau).
        ops: dict[str, tuple[Callable[..., mx.array], int, int]] = {
            "read": ((lambda i, a=a: k.read(a)), read_out, size + read_out),
            "copy": ((lambda i, prev, a=a: k.copy(a if prev is None else prev)), size, 2 * size),
            "triad": ((lambda i, prev, a=a, b=b: k.triad(a, b if prev is None else prev, 0.5)), size, 3 * size),
        }
        measured = timed(cfg, rng, {op: (fn, out) for op, (fn, out, _) in ops.items()},
                         chained=frozenset({"copy", "triad"}))
        for op, (_, out, moved) in ops.items():
            m, launches = measured[op]
            live = launches * out if op == "read" or launches == 1 else 2 * out
            rows.append({"op": op, "bytes": size, "moved_bytes": moved, **_row(m, launches),
                         "live_output_bytes": live, "gbs": _gbs(moved, m["median_s"])})
        progress(f"stream {size // MiB} MiB")
        del a, b, ops  # free this size's arrays before the next size allocates
    return rows


def verify_stream(k: kernels.Kernels, a, b, s: float) -> None:
    """STREAM's validation: every kernel's output against a reference on the same arrays, on the
    device a chunk at a time (one output array at most, never a host copy of the inputs)."""
    partials = np.asarray(k.read(a), dtype=np.float64)  # per thread or per row: small
    kernels.check("read", [partials.sum()], [kernels.exact_sum(a)], rtol=1e-5)
    del partials
    kernels.check("copy", k.copy(a), a, rtol=0.0)
    kernels.check("triad", k.triad(a, b, s),
                  lambda lo, hi: kernels.triad_twin(a[lo:hi], b[lo:hi], s))


def weight_copies(make: Callable[..., tuple[mx.array, ...]], floor: int) -> list[tuple[mx.array, ...]]:
    """Copies of a weight, each ``make()`` (new random values, evaluated one at a time so only
    one float source lives), until they hold at least ``floor`` bytes in all."""
    copies: list[tuple[mx.array, ...]] = []
    total = 0
    while not copies or total < floor:
        arrays = tuple(make())
        mx.eval(*arrays)
        copies.append(arrays)
        total += sum(a.nbytes for a in arrays)
    return copies


def _stochastic(rows: int, cols: int, dtype: mx.Dtype) -> mx.array:
    """A weight whose rows sum to about 1 (uniform in [0, 2/cols)): a chain of launches keeps
    its values near the input's scale, never overflowing nor decaying to denormals."""
    return mx.random.uniform(0.0, 2.0 / cols, (rows, cols), dtype=dtype)


def _chain(launch: Callable[..., mx.array], copies: list[tuple[mx.array, ...]], first: mx.array) -> Callable:
    """``timing.chained``'s step: launch ``launch(x, *copy)`` on the next copy in turn (the turn
    carries over between evaluations, so a short chain does not start on the copies the last
    one left cached), fed the previous output's first columns."""
    turn = itertools.count()
    cols = first.shape[-1]

    def step(i, prev):
        x = first if prev is None else prev[..., :cols]
        return launch(x, *copies[next(turn) % len(copies)])

    return step


def _copies_row(copies: list[tuple[mx.array, ...]]) -> schema.GemvRow:
    one = sum(a.nbytes for a in copies[0])
    return {"bytes": one, "copies": len(copies), "distinct_bytes": one * len(copies)}


def gemv_bandwidth(cfg: RooflineConfig, compute_dtype, rng, progress) -> dict[str, schema.GemvRow]:
    """Weight-read bandwidth of x @ W.T for one token: what a decode step streams, timed as a
    chain of launches over distinct weight copies (``weight_copies``). Quantized weights are
    quantized from ``compute_dtype``, the dtype models run in, so scales, biases and the
    activation keep it (a float32 source would time the float32 kernel on a GPU)."""
    out: dict[str, schema.GemvRow] = {}
    rows, cols = gemv_shape(cfg.gemv_bytes)
    for label, bits in GEMV_WEIGHTS:
        dtype = DTYPES[label] if bits is None else compute_dtype
        x = mx.random.uniform(0.5, 1.5, (1, cols), dtype=dtype)
        launch: Callable[..., mx.array]
        if bits is None:
            copies = weight_copies(lambda dtype=dtype: (_stochastic(rows, cols, dtype),), cfg.distinct_bytes)
            launch = lambda x, w: x @ w.T  # noqa: E731
        else:
            copies = weight_copies(lambda dtype=dtype, bits=bits: mx.quantize(
                _stochastic(rows, cols, dtype), group_size=64, bits=bits), cfg.distinct_bytes)
            launch = lambda x, wq, s, b, bits=bits: mx.quantized_matmul(  # noqa: E731
                x, wq, s, b, transpose=True, group_size=64, bits=bits)
        mx.eval(x)
        step = _chain(launch, copies, x)
        m, launches = timed(cfg, rng, {label: (step, rows * x.itemsize)}, chained=frozenset({label}))[label]
        row = _copies_row(copies)
        out[label] = {**row, "dtype": str(dtype).removeprefix("mlx.core."), **_row(m, launches),
                      "gbs": _gbs(row["bytes"], m["median_s"])}
        progress(f"gemv {label}")
        del copies, step
    return out


def matmul_flops(cfg: RooflineConfig, rng, progress) -> dict[str, schema.MatmulRow]:
    out: dict[str, schema.MatmulRow] = {}
    n = cfg.matmul_n
    for name in cfg.dtypes:
        a = mx.random.normal((n, n), dtype=DTYPES[name])
        b = mx.random.normal((n, n), dtype=DTYPES[name])
        mx.eval(a, b)
        m, launches = timed(cfg, rng, {name: (lambda i, a=a, b=b: a @ b, a.nbytes)})[name]
        out[name] = {"n": n, **_row(m, launches), "tflops": 2 * n**3 / m["median_s"] / 1e12}
        progress(f"matmul {name}")
    return out


def fma_flops(k: kernels.Kernels, cfg: RooflineConfig, rng) -> schema.FmaRow | None:
    """FP32 FMA throughput from the Metal kernel (verified on a sample of threads)."""
    seed = mx.arange(kernels.GRID_THREADS, dtype=mx.float32) * 1e-6
    m_, k_ = 0.999, 1e-4
    out = k.fma(seed, m_, k_, cfg.fma_iterations)
    if out is None:
        return None
    sample = 256
    want = kernels.fma_reference(np.array(seed[:sample]), m_, k_, cfg.fma_iterations)
    kernels.check("fma", out[:sample], want, rtol=1e-3)
    launch = lambda i: k.fma(seed, m_, k_, cfg.fma_iterations)  # noqa: E731
    m, launches = timed(cfg, rng, {"fma": (launch, seed.nbytes)})["fma"]
    flop = kernels.GRID_THREADS * cfg.fma_iterations * 4 * 4 * 2
    return {**_row(m, launches), "tflops": flop / m["median_s"] / 1e12}


def qmm_curve(cfg: RooflineConfig, dtype, rng, progress) -> list[schema.QmmRow]:
    """Quantized matmul time against tokens t: flat while weight-bound, linear once compute-bound.
    Each point is a chain of launches over distinct weight copies (``weight_copies``), quantized
    from ``dtype`` (the models' dtype), so the input is not promoted."""
    rows_out, cols = cfg.qmm_shape
    rows: list[schema.QmmRow] = []
    for bits in QMM_BITS:
        copies = weight_copies(lambda bits=bits: mx.quantize(
            _stochastic(rows_out, cols, dtype), group_size=64, bits=bits), cfg.distinct_bytes)
        launch = lambda x, wq, s, b, bits=bits: mx.quantized_matmul(  # noqa: E731
            x, wq, s, b, transpose=True, group_size=64, bits=bits)
        points = {}
        for t in cfg.qmm_tokens:
            x = mx.random.uniform(0.5, 1.5, (t, cols), dtype=dtype)
            mx.eval(x)
            points[t] = (_chain(launch, copies, x), t * rows_out * x.itemsize)
        measured = timed(cfg, rng, points, chained=frozenset(points))
        copied = _copies_row(copies)
        for t in cfg.qmm_tokens:
            m, launches = measured[t]
            rows.append({"bits": bits, "tokens": t, "dtype": str(dtype).removeprefix("mlx.core."),
                         **_row(m, launches), "tflops": 2 * t * rows_out * cols / m["median_s"] / 1e12,
                         "weight_bytes": copied["bytes"], "copies": copied["copies"],
                         "distinct_bytes": copied["distinct_bytes"]})
        progress(f"quantized matmul {bits}-bit")
        del copies, points
    return rows


def knee_tokens(tokens: list[int], seconds: list[float]) -> float | None:
    """Where compute time equals weight-streaming time: T(1) over the slope of the last points.

    The slope is a least-squares line through the three largest t (the compute-bound tail).
    """
    if len(tokens) < 3:
        return None
    t = np.asarray(tokens[-3:], dtype=float)
    y = np.asarray(seconds[-3:], dtype=float)
    slope = np.polyfit(t, y, 1)[0]
    if slope <= 0:
        return None
    return float(seconds[0] / slope)


def _plateau(rows: list[schema.SizeRow], op: str, plateau_from: int) -> float:
    big = [r["gbs"] for r in rows if r["op"] == op and r["bytes"] >= plateau_from]
    if not big:
        big = [max((r for r in rows if r["op"] == op), key=lambda r: r["bytes"])["gbs"]]
    return float(np.median(big))


def ceiling_of(bandwidth: dict[str, float], gemv: dict[str, schema.GemvRow], plateau_from: int) -> str:
    """Which bandwidth is the ceiling: the largest of the rows that streamed past the caches,
    the STREAM plateaus and the GEMV rows whose weight copies add up to ``plateau_from``."""
    past = {k: v for k, v in bandwidth.items()
            if not k.startswith("gemv_") or gemv[k.removeprefix("gemv_")]["distinct_bytes"] >= plateau_from}
    return max(past, key=past.__getitem__)


def run_roofline(
    cfg: RooflineConfig, spec: schema.ChipSpec | None, backend: str, progress=lambda label: None, seed: int = 0,
    usable_bytes: int | None = None, shrunk: schema.Shrunk | None = None, store: ResultsStore | None = None,
) -> schema.Roofline:
    """Measure everything and return the roofline document of docs/design.md §7.4, saved into
    ``store`` where one is given; its memory entry is the estimate beside the measured peak
    (``memory.record``) and the wired limit, and ``shrunk`` what ``fit_memory`` changed to fit
    (None: ran as configured)."""
    rng = random.Random(seed)
    mx.random.seed(seed)
    compute_dtype = mx.float16 if backend != "cpu" else mx.float32
    with hardware.measuring_stage() as stage:
        k = kernels.Kernels.build()
        sweep_rows = stream_sweep(k, cfg, rng, progress)
        gemv = gemv_bandwidth(cfg, compute_dtype, rng, progress)
        matmul = matmul_flops(cfg, rng, progress)
        fma = fma_flops(k, cfg, rng)
        curve = qmm_curve(cfg, compute_dtype, rng, progress)

    bandwidth = {op: _plateau(sweep_rows, op, cfg.plateau_from) for op in ("read", "copy", "triad")}
    bandwidth.update({f"gemv_{label}": row["gbs"] for label, row in gemv.items()})
    ceiling_source = ceiling_of(bandwidth, gemv, cfg.plateau_from)
    ceiling = bandwidth[ceiling_source]
    flops = {name: row["tflops"] for name, row in matmul.items()}
    if fma:
        flops["fma_float32"] = fma["tflops"]
    ridge_by_dtype = {name: tf * 1e12 / (ceiling * 1e9) for name, tf in flops.items()}
    main_dtype = "float16" if compute_dtype == mx.float16 else "float32"
    ridge = ridge_by_dtype[main_dtype]
    knees = {}
    for bits in QMM_BITS:
        rows = [r for r in curve if r["bits"] == bits]
        knees[str(bits)] = knee_tokens([r["tokens"] for r in rows], [r["median_s"] for r in rows])
    document: schema.Roofline = {
        "backend": backend,
        "kernels": k.describe(),
        "compute_dtype": main_dtype,
        "memory": {**memory.record(memory_estimate(cfg), usable_bytes), **stage},
        "shrunk": shrunk,
        "distinct_bytes": cfg.distinct_bytes,
        "bandwidth_gbs": bandwidth,
        "bandwidth_ceiling_gbs": ceiling,
        "bandwidth_ceiling_source": ceiling_source,
        "flops_tflops": flops,
        "ridge_dtype": main_dtype,
        "ridge_flop_per_byte": ridge,
        "ridge_by_dtype": ridge_by_dtype,
        "ridge_tokens": {fmt: theory.ridge_in_tokens(ridge, fmt) for fmt in ("fp16", "8bit", "4bit")},
        "qmm_knee_tokens": knees,
        "size_sweep": sweep_rows,
        "gemv": gemv,
        "matmul": matmul,
        "fma": fma,
        "qmm_curve": curve,
        "spec": spec,
        "fraction_of_spec": _against_spec(spec, ceiling, flops.get("fma_float32", flops.get("float32"))),
    }
    if store is not None:
        store.put_section("roofline", document)
    return document


def _against_spec(spec: schema.ChipSpec | None, bandwidth_gbs: float,
                  fp32_tflops: float | None) -> schema.FractionOfSpec | None:
    if not spec:
        return None
    out: schema.FractionOfSpec = {"bandwidth": bandwidth_gbs * 1e9 / spec["bandwidth_bytes_s"]}
    spec_flops = spec.get("fp32_flops")
    if spec_flops and fp32_tflops:
        out["fp32_flops"] = fp32_tflops * 1e12 / spec_flops
    return out
