"""The one timer every measurement uses.

Each point is a callable whose outputs are forced with ``mx.eval`` inside the timed region (MLX
is lazy: an un-evaluated result costs nothing), followed by an untimed reset (e.g. trimming the
KV cache back). Points are warmed up once per shape, then sampled in rounds whose order is
shuffled, until the median's 95% confidence interval is tight or the point's budget is spent.

Short kernels are timed K launches per eval (``calibrate`` grows K until one eval lasts
MIN_EVAL_S, as pyperf grows its loop count), so the fixed cost of one eval (a command buffer's
commit and wait on Metal) is spread over K; ``per_launch`` divides it out, and K is recorded.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator, Protocol, Sequence, TypeVar

import mlx.core as mx
import numpy as np

from mac_moesd.errors import MacMoesdError
from mac_moesd.results import schema
from mac_moesd.results.schema import Measurement

__all__ = ["Budget", "Measurement", "Point", "Ranks", "calibrate", "drift", "launches",
           "finite_time", "measure", "run_untimed", "MEDIAN_CI_MIN", "median_ci", "median_ci_rel", "per_launch", "summarise", "synchronised"]

DRIFT_THRESHOLD = 0.03  # a reference point moving more than this between start and end is flagged
SHORT_SAMPLE_S = 1e-3  # below this, launch overhead and timer resolution weigh on the value
MIN_EVAL_S = 5e-3  # calibrated K launches make one timed eval last at least this
MAX_LAUNCHES = 4096  # bounds the graph a calibrated eval builds

K = TypeVar("K", bound=Hashable)  # a point's key


@dataclass(frozen=True)
class Point:
    """One thing to time: ``run`` returns the arrays to evaluate; ``reset`` runs untimed after.

    With ``build_untimed``, ``run`` only builds the lazy graph and is called before the clock
    starts, so the timed region is the evaluation alone (for K launches of a short kernel).
    ``before`` runs untimed ahead of each sample, to leave the machine as the loop being timed
    leaves it (a drafter's chain after the target's verify: ``draft_chain``); it counts in the
    point's time budget.
    """

    run: Callable[[], Any]
    reset: Callable[[], None] | None = None
    build_untimed: bool = False
    before: Callable[[], None] | None = None
    seconds: float | None = None  # this point's time budget, where it is not the budget's seconds_per_point


@dataclass(frozen=True)
class Budget:
    warmup: int = 2  # untimed calls per point before sampling (kernel compilation, allocation)
    min_repeats: int = 5
    max_repeats: int = 200
    target_ci: float = 0.01  # stop when the 95% CI half-width of the median is within this fraction
    seconds_per_point: float = 2.0
    per_visit: int = 3  # samples taken each time a round visits a point
    # Forwards per pipelined sample of a one-token point: a decode step, which generation runs in
    # chains as long as its output. A chain's fixed cost (filling the pipeline, the last wait) is
    # spread over its forwards: on a 2-core Linux box chains of 8 one-token forwards cost 0.4-0.7
    # ms more per forward than chains of 64 (B = 1, 2, 4, one shuffled schedule); 32 leave a
    # seventh of that.
    decode_chain: int = 32
    # Those chained one-token points get this many times seconds_per_point: each sample is a whole
    # chain, and the box's slow phases are as long as one, so 2 s held 9 chains at batch 1 on a
    # 2-core Linux box (95% CI of the median +-18%, where 30 s of them gave +-1.7%). Their
    # difference from the synchronous points is the graph-build time the fit takes off every
    # plain decode step, the denominator of each predicted speedup.
    decode_seconds_factor: float = 4.0

    def __post_init__(self):
        if self.min_repeats < 3 or self.max_repeats < self.min_repeats:
            raise ValueError("need 3 <= min_repeats <= max_repeats")
        if (self.warmup < 0 or self.per_visit < 1 or self.seconds_per_point <= 0 or self.decode_chain < 2
                or self.decode_seconds_factor < 1):
            raise ValueError("warmup >= 0, per_visit >= 1, seconds_per_point > 0, decode_chain >= 2 and "
                             "decode_seconds_factor >= 1 required")


# A quick run keeps every point at its half second: its ETA is what it is for.
QUICK = Budget(warmup=1, min_repeats=5, max_repeats=40, target_ci=0.02, seconds_per_point=0.5,
               decode_seconds_factor=1.0)


MEDIAN_CI_MIN = 6  # the fewest values whose whole range covers their median 95% of the time (1 - 2/2^6)


def median_ci(values: Sequence[float] | np.ndarray) -> tuple[float, float]:
    """Distribution-free 95% CI of the median from order statistics: the values of ranks
    floor(n/2 - 0.98 sqrt(n)) and ceil(1 + n/2 + 0.98 sqrt(n)), 1-based and clipped to [1, n]
    (Conover, Practical Nonparametric Statistics, the normal approximation to the binomial).
    From ``MEDIAN_CI_MIN`` values on its coverage is at least 95% for any continuous
    distribution, where a bootstrap of the median comes out too narrow for a few values; below
    that it is the values' whole range, which covers less (one value: that value)."""
    ordered = np.sort(np.asarray(values, dtype=float))
    n = len(ordered)
    half = 1.96 * math.sqrt(n) / 2
    lo = max(int(math.floor(n / 2 - half)), 1)
    hi = min(int(math.ceil(1 + n / 2 + half)), n)
    return float(ordered[lo - 1]), float(ordered[hi - 1])


def median_ci_rel(values: Sequence[float] | np.ndarray) -> float:
    """``median_ci``'s half-width as a fraction of the median (inf where the median is not positive)."""
    median = float(np.median(values))
    if median <= 0:
        return math.inf
    low, high = median_ci(values)
    return (high - low) / 2 / median


def summarise(samples: list[float], target_ci: float, warmups: int) -> Measurement:
    values = np.sort(np.asarray(samples, dtype=float))
    q1, median, q3 = np.percentile(values, [25, 50, 75])
    mean = float(values.mean())
    cv = float(values.std(ddof=1) / mean) if len(values) > 1 and mean > 0 else 0.0
    ci = median_ci_rel(values)
    return Measurement(
        median_s=float(median),
        iqr_s=float(q3 - q1),
        cv=cv,
        min_s=float(values[0]),
        mean_s=mean,
        repeats=len(values),
        ci_rel=ci,
        converged=ci <= target_ci,
        warmups=warmups,
        samples_s=[float(v) for v in samples],
    )


class Ranks(Protocol):
    """The processes of a sharded model, timed as one (``measure.cluster.distributed``)."""

    def barrier(self) -> None:
        """Return once every rank has called it."""

    def slowest(self, seconds: float) -> float:
        """The largest of every rank's ``seconds``, the same value on each rank."""


_ranks: Ranks | None = None


@contextlib.contextmanager
def synchronised(ranks: Ranks) -> Iterator[None]:
    """Time every sample on all ranks together: each starts after a barrier and counts as the
    slowest rank's time. All ranks then see the same samples, so their adaptive repeat counts,
    and the collectives those calls run, stay in step."""
    global _ranks
    previous, _ranks = _ranks, ranks
    try:
        yield
    finally:
        _ranks = previous


def time_once(point: Point) -> float:
    ranks = _ranks
    if point.before is not None:
        point.before()
    graph = point.run() if point.build_untimed else None
    if ranks is not None:
        ranks.barrier()
    start = time.perf_counter()
    mx.eval(graph if point.build_untimed else point.run())
    elapsed = time.perf_counter() - start
    if ranks is not None:
        elapsed = ranks.slowest(elapsed)
    if point.reset is not None:
        point.reset()
    return elapsed


def run_untimed(point: Point) -> None:
    """One call of ``point``, evaluated and reset, on no clock: what a timed loop runs between
    the parts it times (``Point.before``)."""
    mx.eval(point.run())
    if point.reset is not None:
        point.reset()


RETIMES = 3  # tries for a sample that came out non-finite (a rank's report lost, a clock fault)


def finite_time(point: Point) -> float:
    """``time_once``, retimed when the sample is not a finite, non-negative number of seconds;
    raises after RETIMES tries, so no NaN sample reaches a median."""
    for _ in range(RETIMES):
        elapsed = time_once(point)
        if math.isfinite(elapsed) and elapsed >= 0:
            return elapsed
    raise MacMoesdError(f"a timing came out {elapsed!r} {RETIMES} times in a row; the point was not recorded")


def measure(
    points: dict[K, Point],
    budget: Budget = Budget(),
    rng: random.Random | None = None,
    on_done: Callable[[K, Measurement], None] | None = None,
    group: Callable[[K], Hashable] | None = None,
) -> dict[K, Measurement]:
    """Measure every point; ``on_done`` is called as each one finishes (to save it at once).

    ``group(key)``: points of one group are visited back to back in every round (groups in
    shuffled order, and the points within each), so two timings of one shape that are compared
    with each other see the machine in the same state; drift between far-apart visits would
    otherwise land in their difference."""
    rng = rng or random.Random(0)
    for point in points.values():
        for _ in range(budget.warmup):
            time_once(point)
    samples: dict[K, list[float]] = {key: [] for key in points}
    spent = {key: 0.0 for key in points}
    done: dict[K, Measurement] = {}

    def finished(key) -> bool:
        n = len(samples[key])
        if n < budget.min_repeats:
            return False
        if n >= budget.max_repeats or spent[key] >= (points[key].seconds or budget.seconds_per_point):
            return True
        return median_ci_rel(samples[key]) <= budget.target_ci

    while len(done) < len(points):
        order = [key for key in points if key not in done]
        rng.shuffle(order)
        if group is not None:
            groups = list(dict.fromkeys(group(key) for key in order))  # first-seen order: shuffled
            order = [key for g in groups for key in order if group(key) == g]
        for key in order:
            for _ in range(budget.per_visit):
                start = time.perf_counter()
                elapsed = finite_time(points[key])
                samples[key].append(elapsed)
                # What runs untimed before a sample is spent on the point too: the budget bounds
                # the time a point takes, whatever part of it the clock measures. (This rank's own
                # wall time: sharded sweeps time no such point, so their ranks stay in step.)
                spent[key] += time.perf_counter() - start if points[key].before is not None else elapsed
            if finished(key):
                done[key] = summarise(samples[key], budget.target_ci, budget.warmup)
                if on_done is not None:
                    on_done(key, done[key])
    return done


def launches(launch: Callable[[int], Any], k: int) -> Point:
    """K launches evaluated together: ``launch(i)`` builds the i-th as a new lazy node.

    Each call makes new graph nodes, and MLX evaluates every node it is given: only
    ``mx.compile`` merges identical operations, and the batch is never compiled as a whole.
    """
    if k < 1:
        raise ValueError("k >= 1 launches required")
    return Point(lambda: [launch(i) for i in range(k)], build_untimed=True)


def chained(step: Callable[[int, Any], Any], k: int) -> Point:
    """K launches evaluated together, each reading the previous one's output: ``step(i, prev)``
    (``prev`` None for the first). Only the last output is returned, so two buffers are live
    whatever K is, and a small array's launches stay in cache as one launch's would."""
    if k < 1:
        raise ValueError("k >= 1 launches required")

    def build():
        out = None
        for i in range(k):
            out = step(i, out)
        return [out]

    return Point(build, build_untimed=True)


def pipelined(step: Callable[[mx.array], mx.array], first: mx.array, steps: int) -> list[mx.array]:
    """``steps`` applications of ``step``, each fed the previous output, each next one queued
    with ``mx.async_eval`` before waiting on the current one: the loop of mlx-lm's
    ``generate_step``, so building a graph overlaps the previous one's compute. Returns every
    output; the last may still be running."""
    outputs = [step(first)]
    mx.async_eval(outputs[-1])
    for _ in range(steps - 1):
        outputs.append(step(outputs[-1]))
        mx.async_eval(outputs[-1])
        mx.eval(outputs[-2])  # a generation loop reads each token as it arrives
    return outputs


def calibrate(launch: Callable, max_k: int = MAX_LAUNCHES, min_seconds: float = MIN_EVAL_S,
              batch: Callable[[Callable, int], Point] = launches) -> int:
    """The launch count K (a power of two, at most ``max_k``) for which one eval of K launches
    (``batch(launch, K)``: ``launches`` or ``chained``) lasts ``min_seconds``: double K until it
    does, the fastest of two evals deciding each step."""
    time_once(batch(launch, 1))  # compile and allocate outside the calibration
    k = 1
    while k < max_k:
        point = batch(launch, k)
        if min(time_once(point) for _ in range(2)) >= min_seconds:
            break
        k = min(2 * k, max_k)
    return max(k, 1)


def per_launch(m: Measurement, k: int) -> Measurement:
    """A measurement of evals of K launches, as seconds per launch (CV and CI are unchanged)."""
    return {**m, "median_s": m["median_s"] / k, "iqr_s": m["iqr_s"] / k, "min_s": m["min_s"] / k,
            "mean_s": m["mean_s"] / k, "samples_s": [v / k for v in m["samples_s"]]}


def drift(before: Measurement, after: Measurement, threshold: float = DRIFT_THRESHOLD) -> schema.Drift:
    """A reference point measured at the start and again at the end of a run."""
    change = after["median_s"] / before["median_s"] - 1.0
    return {"before_s": before["median_s"], "after_s": after["median_s"], "threshold": threshold,
            "change": change, "flagged": abs(change) > threshold}


def grid_warnings(label: str, measurements: list[Measurement]) -> list[str]:
    """pyperf-style advice on a set of measurements that should not be trusted as they are."""
    out = []
    noisy = [m for m in measurements if m["cv"] >= 0.10]
    if noisy:
        worst = max(m["cv"] for m in noisy)
        out.append(
            f"{label}: {len(noisy)} of {len(measurements)} points have a spread of 10% or more "
            f"(worst CV {worst:.0%}); close other apps, plug in power, and rerun"
        )
    short = [m for m in measurements if m["median_s"] < SHORT_SAMPLE_S]
    if short:
        out.append(f"{label}: {len(short)} points take under 1 ms; launch overhead weighs on them")
    loose = [m for m in measurements if not m["converged"]]
    if loose:
        worst = max(m["ci_rel"] for m in loose)
        out.append(
            f"{label}: {len(loose)} of {len(measurements)} points ended on the time budget before "
            f"the median's 95% CI reached the target (worst +/-{worst:.1%}); "
            "raise --seconds-per-point for tighter numbers"
        )
    return out
