"""The roofline of this machine: sustained bandwidth, peak FLOPS, and the ridge between them.

Bandwidth: STREAM-style read, copy and triad over sizes from cache-resident to far past the
system-level cache (bytes counted as STREAM counts them), and the weight-read bandwidth decode
really sees, a matrix-vector product over a large weight matrix (float and quantized). FLOPS:
square matmuls per dtype, the FMA kernel on Metal, and quantized matmul against a realistic weight
matrix as the number of tokens grows, the GEMV-to-GEMM transition that decides where decode turns
compute-bound. Ridge RP = peak FLOPS / sustained bandwidth (LLM-Viewer's roofline model).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from mac_moesd import kernels, theory, timing
from mac_moesd.errors import BadInput

__all__ = ["RooflineConfig", "knee_tokens", "run_roofline"]

MiB = 2**20


@dataclass(frozen=True)
class RooflineConfig:
    sizes: tuple[int, ...] = tuple(MiB * s for s in (1, 4, 16, 64, 256, 1024))  # bytes per array
    gemv_bytes: int = 512 * MiB
    matmul_n: int = 4096
    qmm_shape: tuple[int, int] = (4096, 4096)  # (out, in) of the quantized weight
    qmm_tokens: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    dtypes: tuple[str, ...] = ("float32", "float16", "bfloat16")
    plateau_from: int = 256 * MiB  # sizes at or above this count as "far past the caches"
    budget: timing.Budget = field(default_factory=timing.Budget)
    fma_iterations: int = 4096


QUICK = RooflineConfig(
    sizes=(MiB, 16 * MiB, 128 * MiB),
    gemv_bytes=128 * MiB,
    matmul_n=1024,
    qmm_shape=(2048, 2048),
    qmm_tokens=(1, 4, 16, 64),
    plateau_from=128 * MiB,
    budget=timing.QUICK,
    fma_iterations=1024,
)

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


ALIGN = 4 * kernels.READ_ROW  # array sizes are whole rows of the read twin


def sizes_from_mib(mib: tuple[float, ...]) -> tuple[int, ...]:
    return tuple(max(int(s * MiB) // ALIGN * ALIGN, ALIGN) for s in mib)


def validate(cfg: RooflineConfig, available_bytes: int | None, cap_bytes: int | None = None) -> None:
    """Refuse sizes that are nonsense or would not fit (triad holds four arrays at once)."""
    if not cfg.sizes or min(cfg.sizes) < 16 * 1024 or any(s % ALIGN for s in cfg.sizes):
        raise BadInput(f"--sizes must be at least 1/64 MiB each, in multiples of {ALIGN} bytes")
    need = 4 * max(max(cfg.sizes), cap_bytes or 0)
    if available_bytes is not None and need > available_bytes:
        raise BadInput(
            f"the largest size needs {need / 2**30:.1f} GiB (four arrays) but "
            f"{available_bytes / 2**30:.1f} GiB is usable here; lower --max-size"
        )


def _gbs(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9


def stream_sweep(k: kernels.Kernels, cfg: RooflineConfig, rng, progress) -> list[dict]:
    """read, copy, triad at every size; each result verified before its time is kept."""
    rows = []
    triad_twin = mx.compile(kernels.triad_twin)  # fused: 3 arrays moved, as STREAM counts
    for size in cfg.sizes:
        n = size // 4
        a = mx.random.uniform(shape=(n,))
        b = mx.random.uniform(shape=(n,))
        mx.eval(a, b)
        s = 3.0
        ops = {
            "read": (lambda: k.read(a), size),
            "copy": (lambda: k.copy(a), 2 * size),
            "triad": (lambda: k.triad(a, b, s) if k.path == "metal" else triad_twin(a, b, s), 3 * size),
        }
        verify_stream(k, a, b, s, triad_twin)
        measured = timing.measure({op: timing.Point(fn) for op, (fn, _) in ops.items()}, cfg.budget, rng)
        for op, (_, moved) in ops.items():
            m = measured[op]
            rows.append({"op": op, "bytes": size, "moved_bytes": moved, "median_s": m.median_s,
                         "cv": m.cv, "repeats": m.repeats, "gbs": _gbs(moved, m.median_s)})
        progress(f"stream {size // MiB} MiB")
        del a, b
    return rows


def verify_stream(k: kernels.Kernels, a, b, s, triad_twin) -> None:
    """STREAM's validation: every kernel's output against numpy on the same arrays."""
    a_np, b_np = np.array(a), np.array(b)
    partials = np.asarray(k.read(a), dtype=np.float64)
    kernels.check("read", partials.sum(), a_np.astype(np.float64).sum(), rtol=1e-5)
    kernels.check("copy", k.copy(a), a_np)
    triad = k.triad(a, b, s) if k.path == "metal" else triad_twin(a, b, s)
    kernels.check("triad", triad, a_np + np.float32(s) * b_np)


def gemv_bandwidth(cfg: RooflineConfig, rng, progress) -> dict[str, dict]:
    """Weight-read bandwidth of x @ W.T for one token: what a decode step streams."""
    cols = 4096
    out = {}
    for label, dtype, bits in (("float32", mx.float32, None), ("float16", mx.float16, None),
                               ("q8", mx.float32, 8), ("q4", mx.float32, 4)):
        rows = max(cfg.gemv_bytes // (cols * 4), 64)
        w = mx.random.normal((rows, cols)).astype(dtype)
        x = mx.random.normal((1, cols)).astype(dtype)
        if bits is None:
            mx.eval(w, x)
            fn, nbytes = (lambda w=w, x=x: x @ w.T), w.nbytes
        else:
            wq, scales, biases = mx.quantize(w, group_size=64, bits=bits)
            mx.eval(wq, scales, biases, x)
            del w
            fn = lambda wq=wq, s=scales, b=biases, x=x, bits=bits: mx.quantized_matmul(  # noqa: E731
                x, wq, s, b, transpose=True, group_size=64, bits=bits)
            nbytes = wq.nbytes + scales.nbytes + biases.nbytes
        m = timing.measure({label: timing.Point(fn)}, cfg.budget, rng)[label]
        out[label] = {"bytes": nbytes, "median_s": m.median_s, "cv": m.cv, "repeats": m.repeats,
                      "gbs": _gbs(nbytes, m.median_s)}
        progress(f"gemv {label}")
    return out


def matmul_flops(cfg: RooflineConfig, rng, progress) -> dict[str, dict]:
    out = {}
    n = cfg.matmul_n
    for name in cfg.dtypes:
        a = mx.random.normal((n, n)).astype(DTYPES[name])
        b = mx.random.normal((n, n)).astype(DTYPES[name])
        mx.eval(a, b)
        m = timing.measure({name: timing.Point(lambda a=a, b=b: a @ b)}, cfg.budget, rng)[name]
        out[name] = {"n": n, "median_s": m.median_s, "cv": m.cv, "repeats": m.repeats,
                     "tflops": 2 * n**3 / m.median_s / 1e12}
        progress(f"matmul {name}")
    return out


def fma_flops(k: kernels.Kernels, cfg: RooflineConfig, rng) -> dict | None:
    """FP32 FMA throughput from the Metal kernel (verified on a sample of threads)."""
    seed = mx.arange(kernels.GRID_THREADS, dtype=mx.float32) * 1e-6
    m_, k_ = 0.999, 1e-4
    out = k.fma(seed, m_, k_, cfg.fma_iterations)
    if out is None:
        return None
    sample = 256
    want = kernels.fma_reference(np.array(seed[:sample]), m_, k_, cfg.fma_iterations)
    kernels.check("fma", np.array(out[:sample]), want, rtol=1e-3)
    run = timing.Point(lambda: k.fma(seed, m_, k_, cfg.fma_iterations))
    m = timing.measure({"fma": run}, cfg.budget, rng)["fma"]
    flop = kernels.GRID_THREADS * cfg.fma_iterations * 4 * 4 * 2
    return {"median_s": m.median_s, "cv": m.cv, "repeats": m.repeats, "tflops": flop / m.median_s / 1e12}


def qmm_curve(cfg: RooflineConfig, dtype, rng, progress) -> list[dict]:
    """Quantized matmul time against tokens t: flat while weight-bound, linear once compute-bound."""
    rows_out, cols = cfg.qmm_shape
    w = mx.random.normal((rows_out, cols))
    rows = []
    for bits in (4, 8):
        wq, scales, biases = mx.quantize(w, group_size=64, bits=bits)
        mx.eval(wq, scales, biases)
        points = {}
        for t in cfg.qmm_tokens:
            x = mx.random.normal((t, cols)).astype(dtype)
            mx.eval(x)
            points[t] = timing.Point(lambda x=x, wq=wq, s=scales, b=biases, bits=bits:
                                     mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=64, bits=bits))
        measured = timing.measure(points, cfg.budget, rng)
        for t in cfg.qmm_tokens:
            m = measured[t]
            rows.append({"bits": bits, "tokens": t, "median_s": m.median_s, "cv": m.cv,
                         "repeats": m.repeats, "tflops": 2 * t * rows_out * cols / m.median_s / 1e12,
                         "weight_bytes": wq.nbytes + scales.nbytes + biases.nbytes})
        progress(f"quantized matmul {bits}-bit")
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


def _plateau(rows: list[dict], op: str, plateau_from: int) -> float:
    big = [r["gbs"] for r in rows if r["op"] == op and r["bytes"] >= plateau_from]
    if not big:
        big = [max((r for r in rows if r["op"] == op), key=lambda r: r["bytes"])["gbs"]]
    return float(np.median(big))


def run_roofline(
    cfg: RooflineConfig, spec: dict | None, backend: str, progress=lambda label: None, seed: int = 0
) -> dict:
    """Measure everything and return the roofline document of DESIGN.md section 3."""
    rng = random.Random(seed)
    mx.random.seed(seed)
    k = kernels.Kernels.build()
    compute_dtype = mx.float16 if backend != "cpu" else mx.float32
    sweep_rows = stream_sweep(k, cfg, rng, progress)
    gemv = gemv_bandwidth(cfg, rng, progress)
    matmul = matmul_flops(cfg, rng, progress)
    fma = fma_flops(k, cfg, rng)
    curve = qmm_curve(cfg, compute_dtype, rng, progress)

    bandwidth = {op: _plateau(sweep_rows, op, cfg.plateau_from) for op in ("read", "copy", "triad")}
    bandwidth.update({f"gemv_{label}": row["gbs"] for label, row in gemv.items()})
    ceiling_source = max(bandwidth, key=bandwidth.get)
    ceiling = bandwidth[ceiling_source]
    flops = {name: row["tflops"] for name, row in matmul.items()}
    if fma:
        flops["fma_float32"] = fma["tflops"]
    ridge_by_dtype = {name: tf * 1e12 / (ceiling * 1e9) for name, tf in flops.items()}
    main_dtype = "float16" if compute_dtype == mx.float16 else "float32"
    ridge = ridge_by_dtype[main_dtype]
    knees = {}
    for bits in (4, 8):
        rows = [r for r in curve if r["bits"] == bits]
        knees[str(bits)] = knee_tokens([r["tokens"] for r in rows], [r["median_s"] for r in rows])
    document = {
        "backend": backend,
        "kernels": {"path": k.path, "note": k.reason},
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
    return document


def _against_spec(spec: dict | None, bandwidth_gbs: float, fp32_tflops: float | None) -> dict | None:
    if not spec:
        return None
    out = {"bandwidth": bandwidth_gbs * 1e9 / spec["bandwidth_bytes_s"]}
    if spec.get("fp32_flops") and fp32_tflops:
        out["fp32_flops"] = fp32_tflops * 1e12 / spec["fp32_flops"]
    return out
