"""A timed SD run's fitted-model prediction is stored with the fit it came from; readers print the
stored value and, where the results' fit is a newer one that predicts otherwise, both."""

import json

import pytest

from mac_moesd.analysis import fit
from mac_moesd.measure.sd.speedup import _prediction_record
from mac_moesd.reporting.formatting import NEWER_FIT_NOTE, newer_fit_note, predicted_cells
from mac_moesd.results import schema
from test_fit import hand_fit_doc, synthetic_fit_document

# The hand-worked fit (tests/test_fit.py) at B = 1, gamma 4, alpha 0.8, mlx-lm's loop (no catch-up):
# Omega = (1 - 0.8**5)/0.2 = 3.3616; plain T(1) = 1.0 ms, verify T(5) = 1.2 ms, drafts 4*0.1 ms:
# round 1.6 ms, S = 3.3616*1.0/1.6 = 2.101. With k_kv = 1e-6 s a cached slot at context 64 every
# forward reads 0.064 ms more: S = 3.3616*1.064/1.664 = 2.149485.
AT_NO_KV, AT_KV = 2.101, 2.149485
DOC = {"context": 64, "new_tokens": 0}


def named(fitted_at, k_kv=0.0):
    return {**hand_fit_doc(k_kv=k_kv), "fitted_at": fitted_at}


def timed_run(model=AT_NO_KV, fitted_at="2026-12-01T10:00:00.000000+00:00", **extra):
    return {"batch": 1, "gamma": 4, "measured_alpha": 0.8, "mode": "draft", "engine": "mlx-lm",
            "measured_speedup": 2.0, "predicted_by": {"measured": 1.9, "model": model, "fit": fitted_at},
            **extra}


def test_the_fit_the_run_was_priced_with_gives_the_stored_value_alone():
    run = timed_run(model=2.5)  # not what the fit gives now: the stored value is printed, not recomputed
    prediction = fit.model_prediction(named("2026-12-01T10:00:00.000000+00:00"), run, DOC)
    assert (prediction.stored, prediction.now, prediction.newer, prediction.shown) == (2.5, None, False, 2.5)
    assert predicted_cells(run, prediction) == ["1.90", "-5%", "2.50", "+25%"]
    assert newer_fit_note([prediction]) == []


def test_a_newer_fit_that_predicts_otherwise_is_shown_beside_the_stored_value():
    run = timed_run()
    prediction = fit.model_prediction(named("2026-12-02T08:00:00.000000+00:00", k_kv=1e-6), run, DOC)
    assert prediction.stored == AT_NO_KV and prediction.now == pytest.approx(AT_KV, abs=1e-6)
    assert prediction.newer and prediction.shown == AT_NO_KV
    assert prediction.now_fit == "2026-12-02T08:00:00.000000+00:00"
    assert predicted_cells(run, prediction) == ["1.90", "-5%", "2.10 (current fit: 2.15)", "+5%"]
    assert newer_fit_note([fit.RunPrediction(1.0), prediction]) == [NEWER_FIT_NOTE]


def test_a_newer_fit_that_predicts_the_same_to_two_decimals_is_not_shown():
    # 2.101 stored, 2.1049 now: one figure.
    prediction = fit.model_prediction(named("2026-12-02T08:00:00.000000+00:00"), timed_run(model=2.1049), DOC)
    assert not prediction.newer and prediction.stored == 2.1049


def test_with_nothing_stored_the_current_fit_predicts():
    run = timed_run(model=None, fitted_at=None)
    prediction = fit.model_prediction(named("2026-12-02T08:00:00.000000+00:00"), run, DOC)
    assert prediction.stored is None and prediction.shown == pytest.approx(AT_NO_KV)
    assert predicted_cells(run, prediction)[2] == "- (current fit: 2.10)"


def test_runs_and_fits_from_before_fits_were_named():
    # A run stored its model prediction as ``predicted_speedup`` before ``predicted_by`` (upgrade
    # moves it there on load); the fit has no ``fitted_at``: which fit priced the run is unknown,
    # so a differing one is shown beside.
    old = {key: value for key, value in timed_run().items() if key not in ("predicted_by", "predicted_from")}
    old["predicted_speedup"] = 2.3
    schema.upgrade({"spec": {"t|d|emulated-acceptance": {"runs": [old]}}})
    prediction = fit.model_prediction(hand_fit_doc(), old, DOC)
    assert prediction.stored == 2.3 and prediction.now == pytest.approx(AT_NO_KV)
    assert fit.model_prediction(None, old, DOC) == fit.RunPrediction(2.3)


def test_prompt_lookup_runs_are_never_recomputed():
    # Their prediction needs the verify widths the SD stage timed: only the stored value exists.
    run = timed_run(drafter_kind="prompt-lookup")
    prediction = fit.model_prediction(named("2026-12-02T08:00:00.000000+00:00", k_kv=1e-6), run, DOC)
    assert prediction == fit.RunPrediction(AT_NO_KV, "2026-12-01T10:00:00.000000+00:00")


class _Parts:
    def to_dict(self):
        return {}


def test_the_sd_stage_stores_the_fit_beside_its_prediction():
    doc = synthetic_fit_document()
    assert doc["fitted_at"].endswith("+00:00")
    predictor = fit.speedup_predictor(doc)
    assert predictor.fitted_at == doc["fitted_at"]
    run = {"batch": 1, "plain_step_s": 1e-3}
    record = _prediction_record(run, _Parts(), None, 1.7, predictor, None)
    assert record["predicted_by"] == {"measured": None, "model": 1.7, "fit": doc["fitted_at"]}
    assert _prediction_record(run, _Parts(), None, None, predictor, None)["predicted_by"]["fit"] is None



def test_a_refit_that_changes_nothing_keeps_the_stored_fit_and_its_date():
    # A resumed run fits again: the same fit keeps its name, so the runs it priced show one figure.
    stored = json.loads(json.dumps(named("2026-12-01T10:00:00.000000+00:00")))  # as loaded from the file
    data = {"fits": {"tiny": stored}}
    again = {**named("2026-12-02T08:00:00.000000+00:00"), "reforward": ("target",)}
    stored["reforward"], stored["thermal_pressure"] = ["target"], None  # the runner's record of the stage
    assert fit.store_fit(data, "tiny", again) is stored and data["fits"]["tiny"] is stored
    changed = named("2026-12-02T08:00:00.000000+00:00", k_kv=1e-6)
    assert fit.store_fit(data, "tiny", changed) is changed and data["fits"]["tiny"] is changed
