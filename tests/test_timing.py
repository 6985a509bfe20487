import itertools
import json
import random

import mlx.core as mx
import numpy as np
import pytest

from mac_moesd.measure.clock import timing


def test_summarise_statistics():
    samples = [1.0, 2.0, 3.0, 4.0, 100.0]
    m = timing.summarise(samples, target_ci=0.01, warmups=2)
    assert m["median_s"] == 3.0
    assert m["iqr_s"] == pytest.approx(4.0 - 2.0)
    assert m["min_s"] == 1.0
    assert m["repeats"] == 5
    assert m["cv"] == pytest.approx(np.std(samples, ddof=1) / np.mean(samples))
    assert not m["converged"]
    assert json.loads(json.dumps(m)) == m  # the record is its JSON


def test_median_ci_from_order_statistics():
    # n = 100: ranks 40 and 61 bound the median's 95% CI.
    values = np.arange(1, 101, dtype=float)
    assert timing.median_ci_rel(values) == pytest.approx((61 - 40) / 2 / 50.5)
    assert timing.median_ci_rel(np.full(20, 2.0)) == 0.0


def test_measure_evaluates_resets_and_stops_on_ci():
    calls = {"run": 0, "reset": 0}
    x = mx.ones((4,))

    def run():
        calls["run"] += 1
        return x * 2

    def reset():
        calls["reset"] += 1

    budget = timing.Budget(warmup=2, min_repeats=5, max_repeats=50, target_ci=0.5, per_visit=1)
    done = []
    result = timing.measure({"a": timing.Point(run, reset)}, budget, random.Random(0),
                            on_done=lambda k, m: done.append(k))
    m = result["a"]
    assert done == ["a"]
    assert 5 <= m["repeats"] <= 50
    assert calls["run"] == calls["reset"] == m["repeats"] + 2  # warm-ups are reset too
    assert m["warmups"] == 2


def test_what_runs_before_a_sample_is_not_timed(monkeypatch):
    # A fake clock that only the sample's evaluation moves: 5 s pass in ``before``, 1 s in ``run``.
    now = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])
    order = []

    def before():
        order.append("before")
        now[0] += 5.0

    def run():
        order.append("run")
        now[0] += 1.0
        return mx.ones((2,))

    point = timing.Point(run, reset=lambda: order.append("reset"), before=before)
    assert timing.time_once(point) == 1.0
    assert order == ["before", "run", "reset"]
    # run_untimed is what ``before`` does with a point: it runs, evaluates and resets it.
    timing.run_untimed(timing.Point(run, reset=lambda: order.append("reset")))
    assert order[3:] == ["run", "reset"]


def test_what_runs_before_a_sample_counts_in_the_points_budget(monkeypatch):
    # 5 s untimed before each 0.1 s sample: a 1 s budget is spent at the fewest repeats, not after 10.
    now = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])

    def advance(seconds):
        now[0] += seconds

    durations = itertools.cycle([0.1, 0.15, 0.05])  # samples that differ: no CI stops them early

    def run():
        advance(next(durations))
        return mx.ones((1,))

    budget = timing.Budget(warmup=0, min_repeats=3, max_repeats=50, seconds_per_point=0.95, per_visit=1, target_ci=0.0)
    m = timing.measure({"a": timing.Point(run, before=lambda: advance(5.0))}, budget, random.Random(0))["a"]
    assert m["repeats"] == 3 and m["median_s"] == pytest.approx(0.1)
    # Without it, the same samples run until their own 0.1 s each fill the budget: 10 of them.
    assert timing.measure({"a": timing.Point(run)}, budget, random.Random(0))["a"]["repeats"] == 10


def test_a_point_with_its_own_seconds_runs_to_them(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])

    def point(**kw):
        durations = itertools.cycle([0.1, 0.15, 0.05])  # no CI stops them early

        def run():
            now[0] += next(durations)
            return mx.ones((1,))

        return timing.Point(run, **kw)

    budget = timing.Budget(warmup=0, min_repeats=3, max_repeats=50, seconds_per_point=0.95, per_visit=1, target_ci=0.0)
    m = timing.measure({"a": point(), "b": point(seconds=1.95)}, budget, random.Random(0))
    # 0.1 s a sample on average: 10 fill the budget's 0.95 s, 20 the point's own 1.95 s.
    assert sum(m["a"]["samples_s"]) >= 0.95 and m["a"]["repeats"] == 10
    assert sum(m["b"]["samples_s"]) >= 1.95 and m["b"]["repeats"] == 20


def test_grouped_points_are_visited_back_to_back_every_round():
    visits = []

    def point(key):
        return timing.Point(lambda: visits.append(key) or mx.ones((2,)))

    keys = [(kind, t) for t in range(4) for kind in ("sync", "pipelined")]
    budget = timing.Budget(warmup=0, min_repeats=6, max_repeats=6, target_ci=0.0, per_visit=2)
    timing.measure({k: point(k) for k in keys}, budget, random.Random(1), group=lambda k: k[1])
    shapes = [t for _, t in visits]
    # Runs of one shape are 4 samples long (two kinds x per_visit 2), never interleaved.
    runs = [shapes[i:i + 4] for i in range(0, len(shapes), 4)]
    assert all(len(set(run)) == 1 for run in runs)
    assert len({tuple(k for k, _ in visits[i:i + 4]) for i in range(0, len(visits), 4)}) > 1  # order shuffled


def test_measure_respects_time_budget():
    # a tiny eval takes tens of microseconds: only the time budget can stop 10^6 repeats in time
    budget = timing.Budget(warmup=0, min_repeats=3, max_repeats=10**6, target_ci=0.0,
                           seconds_per_point=0.05, per_visit=1)
    points = {k: timing.Point(lambda: mx.ones((8,)) + 1) for k in range(3)}
    result = timing.measure(points, budget)
    for m in result.values():
        assert m["repeats"] < 10**6
        assert sum(m["samples_s"]) >= 0.05 and not m["converged"]


def test_drift_flag():
    before = timing.summarise([1.0] * 5, 0.01, 0)
    assert not timing.drift(before, timing.summarise([1.02] * 5, 0.01, 0))["flagged"]
    d = timing.drift(before, timing.summarise([1.10] * 5, 0.01, 0))
    assert d["flagged"] and d["change"] == pytest.approx(0.10)


def test_grid_warnings():
    noisy = timing.summarise([1.0, 1.5, 0.5, 1.2, 0.8], 0.01, 1)
    steady = timing.summarise([1.0] * 5, 0.01, 1)
    warnings = timing.grid_warnings("m", [noisy, steady])
    assert any("1 of 2 points have a spread" in w for w in warnings)
    assert any("ended on the time budget" in w for w in warnings)
    assert timing.grid_warnings("m", [steady]) == []


@pytest.mark.parametrize("kwargs", [dict(min_repeats=2), dict(max_repeats=3, min_repeats=5),
                                    dict(seconds_per_point=0), dict(per_visit=0),
                                    dict(decode_seconds_factor=0.5)])
def test_budget_rejects_nonsense(kwargs):
    with pytest.raises(ValueError):
        timing.Budget(**kwargs)


def test_k_launches_are_k_distinct_nodes_and_divided_out():
    a = mx.ones((64,))
    built = []

    def launch(i):
        out = a * (i + 1)
        built.append(out)
        return out

    point = timing.launches(launch, 5)
    assert point.build_untimed
    graph = point.run()
    assert len(graph) == 5 and len({id(x) for x in graph}) == 5
    mx.eval(graph)
    assert [x[0].item() for x in graph] == [1, 2, 3, 4, 5]  # five evaluated outputs, none merged
    m = timing.summarise([0.010, 0.012, 0.011], 0.01, 1)
    per = timing.per_launch(m, 5)
    assert per["median_s"] == pytest.approx(m["median_s"] / 5)
    assert per["samples_s"] == pytest.approx([0.002, 0.0024, 0.0022])
    assert per["cv"] == m["cv"] and per["repeats"] == 3
    with pytest.raises(ValueError):
        timing.launches(launch, 0)


def test_calibrate_doubles_k_until_an_eval_is_long_enough(monkeypatch):
    # a fake clock: each launch in an eval costs 1 ms
    monkeypatch.setattr(timing, "time_once", lambda point: len(point.run()) * 1e-3)
    launch = lambda i: mx.ones((4,)) + i  # noqa: E731
    assert timing.calibrate(launch, max_k=1024, min_seconds=5e-3) == 8
    assert timing.calibrate(launch, max_k=4, min_seconds=5e-3) == 4
    assert timing.calibrate(launch, max_k=1024, min_seconds=1e-4) == 1


def test_build_untimed_times_only_the_evaluation(monkeypatch):
    # A fake clock that only building a graph advances (by 50 ms): the untimed build is outside
    # the timed region (0 s), the plain point's build inside it (50 ms).
    now = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])

    def slow_build():
        now[0] += 0.05
        return mx.ones((4,)) + 1

    assert timing.time_once(timing.Point(slow_build, build_untimed=True)) == 0.0
    assert timing.time_once(timing.Point(slow_build)) == pytest.approx(0.05)


def test_chained_launches_feed_each_other_and_return_only_the_last():
    seen = []

    def step(i, prev):
        seen.append((i, None if prev is None else prev.item()))
        return mx.array(float(i)) if prev is None else prev + 1

    point = timing.chained(step, 4)
    (last,) = point.run()
    assert point.build_untimed and last.item() == 3.0
    assert seen == [(0, None), (1, 0.0), (2, 1.0), (3, 2.0)]
    with pytest.raises(ValueError):
        timing.chained(step, 0)
