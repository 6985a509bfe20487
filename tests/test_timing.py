import random

import mlx.core as mx
import numpy as np
import pytest

from mac_moesd import timing


def test_summarise_statistics():
    samples = [1.0, 2.0, 3.0, 4.0, 100.0]
    m = timing.summarise(samples, target_ci=0.01, warmups=2)
    assert m.median_s == 3.0
    assert m.iqr_s == pytest.approx(4.0 - 2.0)
    assert m.min_s == 1.0
    assert m.repeats == 5
    assert m.cv == pytest.approx(np.std(samples, ddof=1) / np.mean(samples))
    assert not m.converged
    assert timing.Measurement.from_dict(m.to_dict()) == m


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
    assert 5 <= m.repeats <= 50
    assert calls["run"] == calls["reset"] == m.repeats + 2  # warm-ups are reset too
    assert m.warmups == 2


def test_measure_respects_time_budget():
    budget = timing.Budget(warmup=0, min_repeats=3, max_repeats=1000, target_ci=0.0,
                           seconds_per_point=0.05, per_visit=1)
    points = {k: timing.Point(lambda: mx.ones((8,)) + 1) for k in range(3)}
    result = timing.measure(points, budget)
    for m in result.values():
        assert m.repeats < 1000
        assert not m.converged


def test_drift_flag():
    before = timing.summarise([1.0] * 5, 0.01, 0)
    assert not timing.drift(before, timing.summarise([1.02] * 5, 0.01, 0)).flagged
    d = timing.drift(before, timing.summarise([1.10] * 5, 0.01, 0))
    assert d.flagged and d.change == pytest.approx(0.10)


def test_grid_warnings():
    noisy = timing.summarise([1.0, 1.5, 0.5, 1.2, 0.8], 0.01, 1)
    steady = timing.summarise([1.0] * 5, 0.01, 1)
    warnings = timing.grid_warnings("m", [noisy, steady])
    assert any("1 of 2 points have a spread" in w for w in warnings)
    assert any("ended on the time budget" in w for w in warnings)
    assert timing.grid_warnings("m", [steady]) == []


@pytest.mark.parametrize("kwargs", [dict(min_repeats=2), dict(max_repeats=3, min_repeats=5),
                                    dict(seconds_per_point=0), dict(per_visit=0)])
def test_budget_rejects_nonsense(kwargs):
    with pytest.raises(ValueError):
        timing.Budget(**kwargs)
