"""The one-row forward T_T(1,1) is the sweep's timing of it; every other shape the fitted curve."""

import numpy as np
import pytest

from mac_moesd.analysis import fit, one_row, pipelining
from mac_moesd.reporting import formatting
from test_fit import L, hand_fit_doc, synthetic_results
from test_pipelining import with_pipelined

FAST = 0.8  # a one-row forward below any smooth curve through the others, as MLX's M = 1 path


def results() -> dict:
    data = with_pipelined(synthetic_results(noise=0.0))
    for entry in data["sweeps"].values():
        entry["points"]["1x1"]["median_s"] *= FAST
        entry["pipelined_points"]["1x1"]["median_s"] *= FAST
    return data


@pytest.fixture(scope="module")
def result():
    return fit.fit(fit.inputs_from_results(results()))


def test_the_one_row_forward_is_the_timed_one_carried_to_another_context(result):
    m, curve = result.model(), result.model(timed_one_row=False)
    i = result.inputs
    sync = {(b, t): s for b, t, s in i.target}[(1, 1)]
    pipe = {(b, t): s for b, t, s in i.target_pipelined}[(1, 1)]
    later = L + 100
    # The KV term k_kv*B*L + k_seq*B at L + 100 less at L, B = 1: k_seq cancels, 100*k_kv is left.
    kv = 100 * m.k_kv
    assert m.k_kv > 0 and kv > 0
    assert float(m.target(1, 1, later)) == pytest.approx(sync + kv, rel=1e-12)
    assert float(m.target(1, 1, later, pipelined=True)) == pytest.approx(pipe + kv, rel=1e-12)
    assert float(curve.target(1, 1, later)) > 1.05 * float(m.target(1, 1, later))  # the curve misses it
    # Every other shape is the curve's, element by element in arrays.
    batches, tokens = np.array([1, 1, 2, 4]), np.array([1, 2, 1, 1])
    got, fitted = m.target(batches, tokens, later), curve.target(batches, tokens, later)
    assert got[0] == pytest.approx(sync + kv) and got[1:].tolist() == fitted[1:].tolist()
    # A round at batch 1: plain decode and the self-draft's steps are the one-row forward.
    plain, verify, draft, _ = m.step_times(1, 3, later, self_draft=True)
    assert float(plain) == pytest.approx(pipe + kv, rel=1e-12)
    assert float(verify) == float(curve.step_times(1, 3, later)[1])
    assert float(draft) < float(curve.step_times(1, 3, later, self_draft=True)[2])
    # ... so SD gains less at batch 1 than the curve says: its plain decode is faster.
    assert float(m.speedup(1, 3, 0.7, later)) < float(curve.speedup(1, 3, 0.7, later))
    assert float(m.speedup(2, 3, 0.7, later)) == float(curve.speedup(2, 3, 0.7, later))


def test_the_stored_fit_predicts_with_the_timed_one_row_forward(result):
    doc = fit.fit_document(result)
    assert doc["one_row"]["context"] == L and doc["one_row"]["pipelined_s"] is not None
    m = result.model()
    predictor = fit.speedup_predictor(doc)
    for batch, gamma in ((1, 3), (1, 4), (2, 4)):
        assert predictor(batch, gamma, 0.7, False, L + 50) == pytest.approx(
            float(m.speedup(batch, gamma, 0.7, L + 50)), rel=1e-12)
    at1 = next(p["speedup"] for p in doc["predictions"] if (p["batch"], p["gamma"], p["alpha"]) == (1, 4, 0.7))
    assert at1 == pytest.approx(float(m.speedup(1, 4, 0.7, L)), rel=1e-12)
    # The fit's output says which figure the predictions took, and how far the curve is from it.
    (line,) = formatting.one_row_lines(doc)
    curve = float(result.model(timed_one_row=False).target(1, 1, L))
    assert f"{curve / doc['one_row']['sync_s'] - 1:+.1%}" in line and "predictions take the timed one" in line
    assert line in formatting.render_fit(doc)


def test_what_ifs_and_moesds_curve_do_not_take_the_timed_forward(result):
    m, curve = result.model(), result.model(timed_one_row=False)
    # The sparsity what-if changes K: the timed forward was the model's own K's.
    timed = {r["top_k"]: r for r in fit.sparsity_sweep(m, L)}
    fitted = {r["top_k"]: r for r in fit.sparsity_sweep(curve, L)}
    assert timed.keys() == fitted.keys() and len(timed) > 1
    for k in timed:
        if k == m.top_k:
            assert timed[k]["speedup_batch1"] < fitted[k]["speedup_batch1"]
        else:
            assert timed[k] == fitted[k]
    # Against the paper: the chosen column is the prediction, MoESD's its own curve.
    row = next(r for r in fit.paper_comparison(result) if (r["gamma"], r["alpha"]) == (4, 0.7))
    assert row["chosen"] == pytest.approx(float(m.speedup(1, 4, 0.7, L)))
    unique = result.model("unique", timed_one_row=False)
    assert row["unique"] == pytest.approx(float(unique.speedup(1, 4, 0.7, L)))


def test_the_timed_one_row_forward_worked_by_hand():
    # test_fit's hand-worked fit (T_T(n) = 0.95 + 0.05n ms, T_D = 0.1 ms, k_kv = 1 us per slot,
    # nothing pipelined) with T_T(1,1) timed at context 64: 0.8 ms, 0.7 ms pipelined; the curve
    # says 1.0 + 0.064 = 1.064 ms there.
    doc = hand_fit_doc(k_kv=1e-6)
    doc["one_row"] = {"context": 64, "sync_s": 0.8e-3, "pipelined_s": 0.7e-3}
    m = fit.FittedModel.from_document(doc)
    # Carried 100 slots further by the KV term: 0.8 + 0.1 = 0.9 ms, 0.7 + 0.1 = 0.8 ms pipelined.
    assert float(m.target(1, 1, 164)) == pytest.approx(0.9e-3, rel=1e-12)
    assert float(m.target(1, 1, 164, pipelined=True)) == pytest.approx(0.8e-3, rel=1e-12)
    # alpha 0.8, gamma 4 at context 64: Omega 3.3616, plain decode the pipelined 0.7 ms, the verify
    # the curve's T(5) + 0.064 = 1.264 ms, drafts 4*0.1: S = 3.3616*0.7/1.664 = 2.35312/1.664 = 1.414135.
    assert float(m.speedup(1, 4, 0.8, 64)) == pytest.approx(1.414135, abs=1e-6)
    # Self-drafting, each draft step is the synchronous one-row forward, 0.8 ms (nothing hidden):
    # round 4*0.8 + 1.264 = 4.464 ms, S = 2.35312/4.464 = 0.527133.
    assert float(m.speedup(1, 4, 0.8, 64, self_draft=True)) == pytest.approx(0.527133, abs=1e-6)


def test_one_row_from_points_and_absence():
    row = one_row.from_points(64, [(1, 1, 0.01), (2, 1, 0.02)], [(1, 1, 0.009)])
    assert row == {"context": 64, "sync_s": 0.01, "pipelined_s": 0.009}
    assert one_row.seconds(row, True) == 0.009 and one_row.seconds(row, False) == 0.01
    assert one_row.from_points(64, [(2, 1, 0.02)], []) is None  # a grid without (1, 1)
    # Without a pipelined timing of it, the synchronous one less what pipelining hides elsewhere.
    alone = one_row.from_points(64, [(1, 1, 0.01)], [])
    assert alone is not None and one_row.seconds(alone, True, hidden=0.002) == pytest.approx(0.008)


def test_without_pipelined_timings_the_synchronous_one_row_forward_stands():
    data = synthetic_results(noise=0.0)  # a sweep made before pipelined timings
    for entry in data["sweeps"].values():
        entry["points"]["1x1"]["median_s"] *= FAST
    result = fit.fit(fit.inputs_from_results(data))
    sync = {(b, t): s for b, t, s in result.inputs.target}[(1, 1)]
    m = result.model()
    assert m.one_row["pipelined_s"] is None and not pipelining.measured(result.pipelining)
    assert float(m.target(1, 1, L, pipelined=True)) == pytest.approx(sync, rel=1e-12)
    assert float(m.step_times(1, 3, L)[0]) == pytest.approx(sync, rel=1e-12)


def test_the_pipelined_check_is_the_curves_own_not_the_timed_one_row(monkeypatch):
    # Whatever the timed one-row forward says, the check of the pipelined curve against the
    # pipelined points does not change: it is the fitted curve's own error.
    before = fit.fit(fit.inputs_from_results(results())).pipelining["target_mape"]
    wild = {"context": L, "sync_s": 1.0, "pipelined_s": 1.0}
    monkeypatch.setattr(one_row, "from_points", lambda *args: wild)
    result = fit.fit(fit.inputs_from_results(results()))
    assert result.model().one_row == wild  # the predictions do take it
    assert result.pipelining["target_mape"] == before
