"""Bandwidth and FMA kernels: Metal sources from ``kernels/*.metal`` on a Mac, MLX ops elsewhere.

Each Metal kernel has a plain-MLX twin computing the same result, and every result is checked
against a reference before its time may count (as STREAM validates its arrays). ``Kernels.build``
compiles, runs and verifies each Metal kernel on its own; one that fails falls back to its twin
(the FMA kernel has none: peak FLOPS then comes from matmul) and the reason is recorded per kernel.

Written against ``mx.fast.metal_kernel`` as MLX generates it (mlx/backend/common/metal_kernel.cpp):
the .metal files are function bodies; an input ``a`` is ``const device float* a``, a 0-d input is
``const constant float& s``; ``a_shape`` (``const constant int*``) and the attributes
``thread_position_in_grid``/``threads_per_grid`` are passed only because the source names them;
``grid`` counts threads (``dispatchThreads``), not threadgroups.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Callable, Sequence

import mlx.core as mx
import numpy as np

from mac_moesd.errors import MacMoesdError
from mac_moesd.results import schema

__all__ = ["KERNEL_DIR", "NAMES", "KernelCheckFailed", "Kernels", "check", "load_source"]

# The top-level kernels/ folder, installed as the data package mac_moesd.metal.
KERNEL_DIR = Path(str(resources.files("mac_moesd.metal")))
THREADGROUP = 256
GRID_THREADS = 256 * 1024  # enough threads in flight to saturate any Apple GPU's memory system
MAX_ELEMENTS = 2**31 - 1  # the kernels index with the int32 a_shape[0] MLX passes
CHECK_CHUNK = 4 * 2**20  # elements compared at a time, so a check adds O(16 MiB), not O(array)

# name -> (input names, output names), as the .metal bodies use them
SIGNATURES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "read": (("a",), ("partial",)),
    "copy": (("a",), ("out",)),
    "triad": (("b", "c", "s"), ("out",)),
    "fma": (("seed", "m", "k", "iterations"), ("out",)),
}
NAMES = tuple(SIGNATURES)


class KernelCheckFailed(MacMoesdError):
    """A kernel's output disagreed with its reference; its timing must not be used."""


def load_source(name: str, folder: Path = KERNEL_DIR) -> str:
    path = folder / f"{name}.metal"
    try:
        return path.read_text()
    except FileNotFoundError:
        raise MacMoesdError(f"Metal source {path} not found") from None


def _as_mx(x) -> mx.array:
    if isinstance(x, mx.array):
        return x
    arr = np.asarray(x)
    return mx.array(arr.astype(np.float32) if arr.dtype == np.float64 else arr)  # no float64 on GPUs


Reference = Callable[[int, int], mx.array]  # the expected values of elements [lo, hi) of the flat output


def check(name: str, got: mx.array | np.ndarray | Sequence[float],
          want: mx.array | np.ndarray | Sequence[float] | Reference, rtol: float = 1e-4) -> None:
    """Raise KernelCheckFailed unless ``got`` matches ``want`` elementwise within ``rtol``.

    Compared on the device in chunks of CHECK_CHUNK elements (``atol`` is ``rtol`` times the
    largest reference value), so a check adds tens of MiB, not copies of the array. ``want`` may
    be a function of (lo, hi) computing the reference a chunk at a time, so it is never whole.
    """
    got = _as_mx(got)
    if callable(want):
        chunk_of = want
    else:
        want = _as_mx(want)
        if got.shape != want.shape:
            raise KernelCheckFailed(f"{name}: output shape {tuple(got.shape)}, expected {tuple(want.shape)}")
        flat_want = want.reshape(-1)
        chunk_of = lambda lo, hi: flat_want[lo:hi]  # noqa: E731
    g = got.reshape(-1)
    n = g.size
    chunks = [(lo, min(lo + CHECK_CHUNK, n)) for lo in range(0, n, CHECK_CHUNK)]
    peak = 0.0
    for lo, hi in chunks:
        peak = max(peak, float(mx.max(mx.abs(chunk_of(lo, hi).astype(mx.float32)))))
    atol = rtol * peak
    bad_total, first = 0, None
    for lo, hi in chunks:
        expected = chunk_of(lo, hi)
        bad = mx.logical_not(mx.isclose(g[lo:hi], expected, rtol=rtol, atol=atol))
        count = int(mx.sum(bad))
        if count and first is None:
            at = int(mx.argmax(bad))
            first = (lo + at, g[lo + at].item(), expected[at].item())
        bad_total += count
    if bad_total:
        assert first is not None
        raise KernelCheckFailed(
            f"{name}: {bad_total} of {n} values wrong "
            f"(first at {first[0]}: {first[1]!r}, expected {first[2]!r})"
        )


def exact_sum(a: mx.array) -> float:
    """sum(a) in float64, a chunk at a time (the reference for the read kernel's partials)."""
    flat = a.reshape(-1)
    return float(sum(np.asarray(flat[lo:lo + CHECK_CHUNK], dtype=np.float64).sum()
                     for lo in range(0, flat.size, CHECK_CHUNK)))


def require_float32(name: str, *arrays: mx.array) -> None:
    """The Metal kernels read ``float`` through float4 pointers: anything else is misread."""
    for a in arrays:
        if a.dtype != mx.float32:
            raise MacMoesdError(f"{name} kernel: input must be float32 (the Metal kernels read float), got {a.dtype}")
        if a.ndim != 1 or a.size % 4 or a.size > MAX_ELEMENTS:
            raise MacMoesdError(
                f"{name} kernel: input must be 1-D with a multiple of 4 elements, at most "
                f"{MAX_ELEMENTS}; got shape {tuple(a.shape)}"
            )


# ---- the MLX twins (any backend) ----


READ_ROW = 1024  # the twin reduces rows of this many floats: a float32 running sum over
# 2^28 values stops growing at 2^24, while 1024-float partials stay exact enough to verify


def read_twin(a: mx.array) -> mx.array:
    """Shape (a.size / READ_ROW,) float32: partial sums whose total is the sum of ``a``."""
    return mx.sum(a.reshape(-1, READ_ROW), axis=1)


def copy_twin(a: mx.array) -> mx.array:
    """Same shape as ``a``: a copy in a new buffer (``a + 0`` reads and writes each element)."""
    return a + 0


def triad_twin(b: mx.array, c: mx.array, s: mx.array | float) -> mx.array:
    """Same shape as ``b``: b + s*c."""
    return b + s * c


def fma_reference(seed: np.ndarray, m: float, k: float, iterations: int) -> np.ndarray:
    """What the FMA kernel stores for each thread's seed (numpy, float32)."""
    base = seed.astype(np.float32)[:, None] + np.arange(4, dtype=np.float32)
    chains = [base + np.float32(off) for off in (0.0, 0.25, 0.5, 0.75)]
    m32, k32 = np.float32(m), np.float32(k)
    for _ in range(iterations):
        chains = [x * m32 + k32 for x in chains]
    return sum(chains[1:], start=chains[0]).sum(axis=1)


# ---- the Metal kernels ----


def _make_metal(name: str, folder: Path):
    inputs, outputs = SIGNATURES[name]
    return mx.fast.metal_kernel(
        name=f"mac_moesd_{name}",
        input_names=list(inputs),
        output_names=list(outputs),
        source=load_source(name, folder),
        ensure_row_contiguous=True,
    )


PROBE_ELEMENTS = 64 * THREADGROUP  # small, but more than one float4 per probe thread of the copy


def _probe(k: Kernels, name: str) -> None:
    """Run one kernel on a small input and verify it against its twin or reference."""
    a = mx.random.uniform(shape=(PROBE_ELEMENTS,), key=mx.random.key(1))
    b = mx.random.uniform(shape=(PROBE_ELEMENTS,), key=mx.random.key(2))
    if name == "read":
        total = np.asarray(k.read(a), dtype=np.float64).sum()
        check("read", [total], [exact_sum(a)], rtol=1e-5)
    elif name == "copy":
        check("copy", k.copy(a), a, rtol=0.0)
    elif name == "triad":
        check("triad", k.triad(a, b, 3.0), lambda lo, hi: triad_twin(a[lo:hi], b[lo:hi], 3.0))
    else:
        seed = mx.arange(THREADGROUP, dtype=mx.float32) * 1e-3
        out = k.fma(seed, 0.999, 1e-4, 16)
        assert out is not None  # paths["fma"] is "metal" while it is probed
        check("fma", out, fma_reference(np.array(seed), 0.999, 1e-4, 16), rtol=1e-4)


@dataclass
class Kernels:
    """The four kernels on this machine; ``paths[name]`` is "metal" or "mlx", ``reasons`` say why."""

    paths: dict[str, str]
    reasons: dict[str, str]
    _metal: dict = field(default_factory=dict, repr=False)
    _triad_fused: Callable = field(init=False, repr=False)

    def __post_init__(self):
        # fused so triad moves 3 arrays, as STREAM counts; s is an array so no value recompiles
        self._triad_fused = mx.compile(triad_twin)

    @property
    def path(self) -> str:
        """"metal" when every kernel runs its Metal source, "mlx" when none does, else "mixed"."""
        kinds = set(self.paths.values())
        return kinds.pop() if len(kinds) == 1 else "mixed"

    @property
    def reason(self) -> str:
        """One line: the bandwidth kernels' shared reason, or each kernel's own."""
        if len({self.reasons[n] for n in NAMES if n != "fma"}) == 1 and self.paths["fma"] == self.paths["read"]:
            return self.reasons["read"]
        return "; ".join(f"{name}: {self.reasons[name]}" for name in NAMES)

    def describe(self) -> schema.KernelPaths:
        return {"path": self.path, "note": self.reason,
                "per_kernel": {n: {"path": self.paths[n], "reason": self.reasons[n]} for n in NAMES}}

    @classmethod
    def build(cls, folder: Path = KERNEL_DIR) -> Kernels:
        """Compile, run and verify each Metal kernel; each one that fails falls back on its own."""
        if not mx.metal.is_available():
            why = {n: "no Metal device: MLX-op fallback" for n in NAMES}
            why["fma"] = "no Metal device: peak FLOPS from matmul"
            return cls({n: "mlx" for n in NAMES}, why)
        built = cls({n: "mlx" for n in NAMES}, {n: "" for n in NAMES})
        for name in NAMES:
            try:
                built._metal[name] = _make_metal(name, folder)
                built.paths[name] = "metal"
                _probe(built, name)
                built.reasons[name] = f"Metal kernel from {folder}"
            except Exception as err:  # compile, dispatch or verification failure: use the twin
                built._metal.pop(name, None)
                built.paths[name] = "mlx"
                fallback = "no fallback, FLOPS from matmul" if name == "fma" else "MLX-op fallback"
                built.reasons[name] = f"Metal kernel failed ({err}): {fallback}"
        return built

    def _run(self, name, inputs, shape, threads=GRID_THREADS):
        out = self._metal[name](
            inputs=inputs,
            grid=(threads, 1, 1),
            threadgroup=(THREADGROUP, 1, 1),
            output_shapes=[shape],
            output_dtypes=[mx.float32],
        )
        return out[0]

    def read(self, a: mx.array) -> mx.array:
        """Partial sums whose total is sum(a): one per thread on Metal, per row with the twin."""
        require_float32("read", a)
        if self.paths["read"] != "metal":
            return read_twin(a)
        return self._run("read", [a], (GRID_THREADS,))

    def copy(self, a: mx.array) -> mx.array:
        require_float32("copy", a)
        if self.paths["copy"] != "metal":
            return copy_twin(a)
        return self._run("copy", [a], a.shape)

    def triad(self, b: mx.array, c: mx.array, s: float | mx.array) -> mx.array:
        """b + s*c; ``s`` may be a 0-d float32 array (distinct launches get distinct scalars)."""
        require_float32("triad", b, c)
        s = s if isinstance(s, mx.array) else mx.array(s, dtype=mx.float32)
        if self.paths["triad"] != "metal":
            return self._triad_fused(b, c, s)
        return self._run("triad", [b, c, s.astype(mx.float32)], b.shape)

    def fma(self, seed: mx.array, m: float, k: float, iterations: int) -> mx.array | None:
        """One float32 per thread; None without the Metal kernel (peak FLOPS then comes from matmul)."""
        if self.paths["fma"] != "metal":
            return None
        if seed.dtype != mx.float32 or seed.ndim != 1:
            raise MacMoesdError(f"fma kernel: seed must be 1-D float32, got {seed.dtype} {tuple(seed.shape)}")
        scalars = [mx.array(m, dtype=mx.float32), mx.array(k, dtype=mx.float32),
                   mx.array(iterations, dtype=mx.int32)]
        return self._run("fma", [seed, *scalars], seed.shape, threads=seed.size)
