"""Bandwidth and FMA kernels: Metal sources from ``kernels/*.metal`` on a Mac, MLX ops elsewhere.

Each Metal kernel has a plain-MLX twin computing the same result, and every result is checked
against a reference before its time may count (as STREAM validates its arrays). The factory
returns None where Metal is missing or a kernel does not compile; callers then use the twin and
record which path ran.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import mlx.core as mx
import numpy as np

from mac_moesd.errors import MacMoesdError

__all__ = ["KERNEL_DIR", "KernelCheckFailed", "Kernels", "check", "load_source"]

# The top-level kernels/ folder, installed as the data package mac_moesd.metal.
KERNEL_DIR = Path(str(resources.files("mac_moesd.metal")))
THREADGROUP = 256
GRID_THREADS = 256 * 1024  # enough threads in flight to saturate any Apple GPU's memory system

# name -> (input names, output names), as the .metal bodies use them
SIGNATURES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "read": (("a",), ("partial",)),
    "copy": (("a",), ("out",)),
    "triad": (("b", "c", "s"), ("out",)),
    "fma": (("seed", "m", "k", "iterations"), ("out",)),
}


class KernelCheckFailed(MacMoesdError):
    """A kernel's output disagreed with its reference; its timing must not be used."""


def load_source(name: str, folder: Path = KERNEL_DIR) -> str:
    path = folder / f"{name}.metal"
    try:
        return path.read_text()
    except FileNotFoundError:
        raise MacMoesdError(f"Metal source {path} not found") from None


def check(name: str, got: mx.array | np.ndarray, want: mx.array | np.ndarray, rtol: float = 1e-4) -> None:
    """Raise KernelCheckFailed unless ``got`` matches ``want`` elementwise within ``rtol``."""
    got_np, want_np = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    if got_np.shape != want_np.shape:
        raise KernelCheckFailed(f"{name}: output shape {got_np.shape}, expected {want_np.shape}")
    bad = ~np.isclose(got_np, want_np, rtol=rtol, atol=rtol * np.abs(want_np).max(initial=0.0))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise KernelCheckFailed(
            f"{name}: {int(bad.sum())} of {bad.size} values wrong "
            f"(first at {i}: {got_np.flat[i]!r}, expected {want_np.flat[i]!r})"
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


def triad_twin(b: mx.array, c: mx.array, s: float) -> mx.array:
    """Same shape as ``b``: b + s*c."""
    return b + s * c


def fma_reference(seed: np.ndarray, m: float, k: float, iterations: int) -> np.ndarray:
    """What the FMA kernel stores for each thread's seed (numpy, float32)."""
    base = seed.astype(np.float32)[:, None] + np.arange(4, dtype=np.float32)
    chains = [base + np.float32(off) for off in (0.0, 0.25, 0.5, 0.75)]
    m32, k32 = np.float32(m), np.float32(k)
    for _ in range(iterations):
        chains = [x * m32 + k32 for x in chains]
    return sum(chains).sum(axis=1)


# ---- the Metal kernels ----


def _make_metal(name: str, folder: Path):
    inputs, outputs = SIGNATURES[name]
    return mx.fast.metal_kernel(
        name=f"mac_moesd_{name}",
        input_names=list(inputs),
        output_names=list(outputs),
        source=load_source(name, folder),
    )


@dataclass
class Kernels:
    """The four kernels on this machine: ``path`` is "metal" or "mlx", ``reason`` says why."""

    path: str
    reason: str
    _metal: dict

    @classmethod
    def build(cls, folder: Path = KERNEL_DIR) -> Kernels:
        if not mx.metal.is_available():
            return cls("mlx", "no Metal device: MLX-op fallback", {})
        try:
            built = {name: _make_metal(name, folder) for name in SIGNATURES}
            probe = mx.arange(4 * THREADGROUP, dtype=mx.float32)
            check("read", mx.sum(cls("metal", "", built).read(probe)), mx.sum(probe))
        except Exception as err:  # compile or dispatch failure: say so and use the twins
            return cls("mlx", f"Metal kernels unavailable ({err}): MLX-op fallback", {})
        return cls("metal", f"Metal kernels from {folder}", built)

    def _run(self, name, inputs, shape, **launch):
        out = self._metal[name](
            inputs=inputs,
            grid=(launch.get("threads", GRID_THREADS), 1, 1),
            threadgroup=(THREADGROUP, 1, 1),
            output_shapes=[shape],
            output_dtypes=[mx.float32],
        )
        return out[0]

    def read(self, a: mx.array) -> mx.array:
        """Partial sums whose total is sum(a): one per thread on Metal, per row with the twin."""
        if self.path != "metal":
            return read_twin(a)
        return self._run("read", [a], (GRID_THREADS,))

    def copy(self, a: mx.array) -> mx.array:
        if self.path != "metal":
            return copy_twin(a)
        return self._run("copy", [a], a.shape)

    def triad(self, b: mx.array, c: mx.array, s: float) -> mx.array:
        if self.path != "metal":
            return triad_twin(b, c, s)
        return self._run("triad", [b, c, mx.array(s, dtype=mx.float32)], b.shape)

    def fma(self, seed: mx.array, m: float, k: float, iterations: int) -> mx.array | None:
        """One float32 per thread; None off Metal (peak FLOPS then comes from matmul)."""
        if self.path != "metal":
            return None
        scalars = [mx.array(m, dtype=mx.float32), mx.array(k, dtype=mx.float32),
                   mx.array(iterations, dtype=mx.int32)]
        return self._run("fma", [seed, *scalars], seed.shape, threads=seed.size)
