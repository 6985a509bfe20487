import pytest

from mac_moesd.analysis import fit, pipelining
from mac_moesd.reporting import formatting
from test_fit import L, hand_fit_doc, synthetic_results

HIDDEN_T, HIDDEN_D = 0.0015, 0.0004


def with_pipelined(data: dict, hidden_t=HIDDEN_T, hidden_d=HIDDEN_D) -> dict:
    """Pipelined points that hide a fixed graph-build time per forward, as a real sweep records."""
    for entry in data["sweeps"].values():
        entry["pipelined_points"] = {k: {"median_s": m["median_s"] - hidden_t} for k, m in entry["points"].items()}
    for entry in data["draft"].values():
        entry["pipelined_points"] = {k: {"median_s": m["median_s"] - hidden_d} for k, m in entry["points"].items()}
    return data


def test_hidden_seconds_weighs_each_difference_by_its_forwards_inverse_square():
    sync = {"a": 0.010, "b": 0.020, "c": 0.004, "d": 0.010}
    pipe = {"a": 0.008, "b": 0.018, "c": 0.0005, "d": 0.0105}  # c: noise beyond half; d: slower
    hidden, n = pipelining.hidden_seconds(sync, pipe)
    assert n == 4
    # differences 0.002, 0.002, 0.0035 clipped to half of 0.004 = 0.002, and -0.0005; weights
    # 1/T^2 = 10^4, 2500, 62500, 10^4: (20 + 5 + 125 - 5) / 85000
    assert hidden == pytest.approx(145 / 85000)
    assert pipelining.hidden_seconds(sync, {}) == (0.0, 0)
    # A batch-8 forward's noise weighs a sixty-fourth of a batch-1's: 1.3 ms at 7.7 ms and -1.3 ms
    # at 31 ms (one sweep on a 2-core box) give 1.1 ms, where the median of the two clipped gave 0.65.
    assert pipelining.hidden_seconds({1: 0.0077, 8: 0.031}, {1: 0.0064, 8: 0.0323})[0] == pytest.approx(
        (0.0013 / 0.0077**2 - 0.0013 / 0.031**2) / (1 / 0.0077**2 + 1 / 0.031**2))
    # Never below 0: a pipelined loop is never slower than a synchronous one.
    assert pipelining.hidden_seconds({1: 0.010}, {1: 0.011}) == (0.0, 1)
    # Never more than half a forward, wherever it is applied.
    assert pipelining.pipelined([0.010, 0.002], 0.002).tolist() == pytest.approx([0.008, 0.001])


@pytest.mark.slow  # several whole fits, or a fit in another process: seconds each
def test_the_hidden_figure_comes_from_the_one_token_points_when_the_grid_has_them():
    data = with_pipelined(synthetic_results(noise=0.0))
    for entry in data["sweeps"].values():  # longer windows: chains that hide nothing
        for key, m in entry["pipelined_points"].items():
            if not key.endswith("x1"):
                m["median_s"] = entry["points"][key]["median_s"]
    assert fit.fit(fit.inputs_from_results(data)).pipelining["target_s"] == pytest.approx(HIDDEN_T, rel=1e-6)
    for entry in data["sweeps"].values():  # a grid without t = 1 takes every point
        for key in [k for k in entry["points"] if k.endswith("x1")]:
            del entry["points"][key], entry["pipelined_points"][key]
    assert fit.fit(fit.inputs_from_results(data)).pipelining["target_s"] == 0.0


def test_fit_measures_what_pipelining_hides_and_predicts_each_loop_with_it():
    result = fit.fit(fit.inputs_from_results(with_pipelined(synthetic_results(noise=0.0))))
    p = result.pipelining
    decode_points = len({b for b, t, _ in result.inputs.target if t == 1})
    assert p["target_s"] == pytest.approx(HIDDEN_T, rel=1e-6) and p["target_points"] == decode_points
    assert p["draft_s"] == pytest.approx(HIDDEN_D, rel=1e-6) and p["draft_points"] == 5
    assert p["target_mape"] < 0.05
    # Stored and read back, the document keeps the figures.
    doc = fit.fit_document(result)
    assert doc["pipelining"]["target_s"] == pytest.approx(HIDDEN_T)
    assert doc["pipelining"]["draft_s"] == pytest.approx(HIDDEN_D)


def test_each_loop_is_predicted_with_what_pipelining_hides_worked_by_hand():
    # The hand-worked fit of test_fit (T_T(n) = 0.95 + 0.05n ms, T_D = 0.1 ms, no rejection) with
    # 0.1 ms of each target forward and 0.04 ms of each drafter step hidden. alpha 0.8, gamma 4:
    # Omega = (1 - 0.8**5)/0.2 = 3.3616; plain T(1) - 0.1 = 0.9 ms; verify T(5) - 0.1 = 1.1 ms;
    # the first draft step pays its graph build, the other 3 hide 0.04 ms: 4*0.1 - 3*0.04 = 0.28 ms.
    # S = 3.3616*0.9/(0.28 + 1.1) = 3.02544/1.38 = 2.192348 (synchronous: 3.3616/1.6 = 2.101).
    doc = hand_fit_doc()
    doc["pipelining"] = {"target_s": 0.1e-3, "draft_s": 0.04e-3, "target_points": 4, "draft_points": 4}
    predictor = fit.speedup_predictor(doc)
    assert predictor(1, 4, 0.8, False, 64) == pytest.approx(2.192348, abs=1e-6)
    # A self-draft steps the target, 1.0 ms synchronous, hiding 0.1 ms in 3 of 4 steps:
    # 1.0 - 0.1*3/4 = 0.925 ms per step; round 4*0.925 + 1.1 = 4.8 ms: S = 3.02544/4.8 = 0.63030.
    assert predictor(1, 4, 0.8, True, 64) == pytest.approx(0.63030, abs=1e-6)


@pytest.mark.slow  # several whole fits, or a fit in another process: seconds each
def test_pipelining_lowers_the_predicted_speedup_when_graph_building_is_hidden_from_plain_decode():
    plain_only = fit.fit(fit.inputs_from_results(synthetic_results(noise=0.0)))
    both = fit.fit(fit.inputs_from_results(with_pipelined(synthetic_results(noise=0.0), hidden_d=0.0)))
    # Same synchronous fit; plain decode and the verify both lose HIDDEN_T, the plain per token
    # share is larger, so SD gains less than a synchronous comparison says.
    assert float(both.model().speedup(1, 4, 0.7, L)) < float(plain_only.model().speedup(1, 4, 0.7, L))


def test_results_without_pipelined_points_say_so_and_predict_synchronously():
    inputs = fit.inputs_from_results(synthetic_results(noise=0.0))
    assert fit.NO_PIPELINED in inputs.missing
    result = fit.fit(inputs)
    assert not pipelining.measured(result.pipelining)
    m = result.model()
    assert float(m.target(2, 1, L, pipelined=True)) == float(m.target(2, 1, L))


def test_the_report_says_how_the_hidden_figure_was_taken():
    record = {"target_s": 0.001, "draft_s": 0.0004, "target_points": 4, "draft_points": 4, "target_mape": None}
    assert "(mean, weighted 1/T^2, of synchronous - pipelined over 4 points)" in formatting.pipelining_lines(
        {**record, "weighted": True})[0]
    assert "(median of synchronous - pipelined" in formatting.pipelining_lines(record)[0]  # a fit made before
