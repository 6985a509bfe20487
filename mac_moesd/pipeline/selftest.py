"""`mac-moesd selftest`: under a minute, on this machine's backend, the checks a first run relies on.

Each check is a function that returns a one-line detail when it passes and raises when it fails;
``run`` times them and turns each into a PASS, FAIL or SKIP record. The tests call the same
functions, so what a Mac user runs first is what the suite tests.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np

from mac_moesd.measure.clock import timing
from mac_moesd.measure.peaks import kernels
from mac_moesd.errors import MacMoesdError

__all__ = ["CHECKS", "Outcome", "SelftestFailed", "Skipped", "run"]

CHECK_ELEMENTS = 2 * 2**20  # 8 MiB of float32: two float4 per Metal thread, so the grid stride runs
LINEAR_LOW, LINEAR_HIGH = 1.4, 2.8  # 2K launches against K: 2x, loosely (shared CPUs, other apps)


class SelftestFailed(MacMoesdError):
    """A self-test check found something wrong."""


class Skipped(Exception):
    """A check that does not apply on this machine (e.g. a Metal kernel without Metal)."""


@dataclass(frozen=True)
class Outcome:
    check: str
    status: str  # "PASS", "FAIL" or "SKIP"
    detail: str
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


def _inputs(n: int = CHECK_ELEMENTS) -> tuple[mx.array, mx.array]:
    a = mx.random.uniform(shape=(n,), key=mx.random.key(11))
    b = mx.random.uniform(shape=(n,), key=mx.random.key(12))
    mx.eval(a, b)
    return a, b


def check_kernel(name: str, k: kernels.Kernels | None = None) -> str:
    """The kernel ``name`` as built here (Metal, or its twin) against an independent reference."""
    k = k or kernels.Kernels.build()
    a, b = _inputs()
    if name == "read":
        total = np.asarray(k.read(a), dtype=np.float64).sum()
        kernels.check("read", np.array([total]), np.array([kernels.exact_sum(a)]), rtol=1e-5)
    elif name == "copy":
        kernels.check("copy", k.copy(a), a, rtol=0.0)
    elif name == "triad":
        s = 3.0
        want = a.astype(mx.float32) + mx.array(s, dtype=mx.float32) * b  # unfused, unlike the twin
        kernels.check("triad", k.triad(a, b, s), want)
    elif name == "fma":
        seed = mx.arange(kernels.GRID_THREADS, dtype=mx.float32) * 1e-6
        out = k.fma(seed, 0.999, 1e-4, 64)
        if out is None:
            raise Skipped(k.reasons["fma"])
        kernels.check("fma", out[:256], kernels.fma_reference(np.array(seed[:256]), 0.999, 1e-4, 64), rtol=1e-3)
    else:
        raise ValueError(f"no kernel {name!r}")
    return f"{k.paths[name]} path agrees with its reference ({k.reasons[name]})"


def launch_scaling(launch: Callable[[int], object], k: int, samples: int = 7) -> float:
    """Time of 2K launches over time of K launches (fastest of ``samples`` evals each)."""
    one, two = timing.launches(launch, k), timing.launches(launch, 2 * k)
    timing.time_once(one)
    t1 = min(timing.time_once(one) for _ in range(samples))
    t2 = min(timing.time_once(two) for _ in range(samples))
    return t2 / t1


def check_launch_scaling(k: kernels.Kernels | None = None, launch: Callable[[int], object] | None = None) -> str:
    """K launches per eval cost K times one: calibrated K, then 2K takes about twice as long
    (were identical launches merged, it would take as long). ``launch`` defaults to the read
    kernel over 8 MiB."""
    if launch is None:
        kern = k or kernels.Kernels.build()
        a, _ = _inputs()
        launch = lambda i: kern.read(a)  # noqa: E731
    count = timing.calibrate(launch, max_k=256)
    ratio = launch_scaling(launch, count)
    if not LINEAR_LOW <= ratio <= LINEAR_HIGH:
        raise SelftestFailed(f"{2 * count} launches took {ratio:.2f}x the time of {count}, "
                             f"expected about 2x (within {LINEAR_LOW}-{LINEAR_HIGH})")
    return f"K={count} read launches per eval; 2K/K time ratio {ratio:.2f} (expected ~2)"


def check_memory_guard() -> str:
    """The sweep's memory guard on tiny-moe: a tiny budget refuses or slices, a generous one
    measures full depth."""
    from mac_moesd.measure.forward import sweep

    cfg = sweep.SweepConfig(model="tiny-moe", batches=(1,), tokens=(1,), context=32)
    source = sweep.validate(cfg)
    full = int(source.config["num_hidden_layers"])
    generous = sweep.plan_layers(source, cfg, 2**40)
    if generous != [full]:
        raise SelftestFailed(f"with 1 TiB usable the plan is {generous}, expected [{full}]")
    try:
        tiny = sweep.plan_layers(source, cfg, 2**20)
    except MacMoesdError as err:
        return f"1 TiB: all {full} layers; 1 MiB: refused ({str(err).split(';')[0]})"
    if max(tiny) >= full:
        raise SelftestFailed(f"with 1 MiB usable the plan is {tiny}: it neither refuses nor slices")
    return f"1 TiB: all {full} layers; 1 MiB: sliced to {tiny}"


def check_results_roundtrip() -> str:
    """A results file written atomically reads back equal, with no temporary file left over."""
    from mac_moesd.results import SCHEMA, load_results, write_atomic

    document = {"schema": SCHEMA, "meta": {"chip": "selftest"},
                "points": {"1x1": {"median_s": 1.25e-3, "repeats": 5}}}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "sub" / "results.json"
        write_atomic(path, document)
        write_atomic(path, document)  # replaces, never appends
        back = load_results(path)
        leftovers = [p.name for p in path.parent.iterdir() if p != path]
    if back != document:
        raise SelftestFailed(f"read back {back!r}, wrote {document!r}")
    if leftovers:
        raise SelftestFailed(f"temporary files left behind: {leftovers}")
    return "write_atomic then load_results returns the same document"


def check_mlx_lm() -> str:
    """The installed mlx-lm against the tested range, and each private name the suite reaches
    through ``mlxlm_compat``: a missing one with a local twin is named; one without fails the
    check, naming the stages that will be skipped."""
    from mac_moesd import mlxlm_compat

    version = mlxlm_compat.installed_version()
    where = "in" if mlxlm_compat.in_tested_range(version) else "outside"
    missing = mlxlm_compat.missing_names()
    parts = [f"mlx-lm {version} is {where} the tested range {mlxlm_compat.TESTED_RANGE}"]
    parts += [f"{p.name} is gone: a local twin stands in" for p in missing if p.twin]
    gone = [f"{p.name} is gone or changed: {p.used_by} will be skipped" for p in missing if not p.twin]
    if gone:
        raise SelftestFailed("; ".join(parts + gone))
    if not missing:
        parts.append("every private name the suite uses is as tested" if where == "in" else
                     "every private name the suite uses is present, but this version is untested")
    return "; ".join(parts)


CHECKS: dict[str, Callable[[kernels.Kernels], str]] = {
    **{f"kernel {name}": partial(check_kernel, name) for name in kernels.NAMES},
    "K-launch timing is linear": lambda k: check_launch_scaling(k),
    "memory guard": lambda k: check_memory_guard(),
    "results round trip": lambda k: check_results_roundtrip(),
    "mlx-lm version": lambda k: check_mlx_lm(),
}


def run(checks: dict[str, Callable[[kernels.Kernels], str]] = CHECKS) -> list[Outcome]:
    """Every check, each caught on its own, in order."""
    k = kernels.Kernels.build()
    out = []
    for name, check in checks.items():
        start = time.perf_counter()
        try:
            status, detail = "PASS", check(k)
        except Skipped as why:
            status, detail = "SKIP", str(why)
        except Exception as err:  # a self-test reports every failure instead of stopping at one
            status, detail = "FAIL", f"{type(err).__name__}: {err}"
        out.append(Outcome(name, status, detail, time.perf_counter() - start))
    return out
