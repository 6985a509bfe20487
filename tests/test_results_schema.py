"""The results schema: the point key, older files brought to today's schema, and every key the
recorded files hold declared by a record of ``results.schema``."""

import json
import shutil
from pathlib import Path

import pytest

from mac_moesd.results import SCHEMA, ResultsStore, load_results, validate

DATA = Path(__file__).parent / "data"
REPO = Path(__file__).parent.parent
# The files recorded before the schema went to mac-moesd/2: the first --quick run and a later one
# (pipelined points, second context, variants); and the example report's, recorded with /2.
OLDER = [DATA / "results_quick_cpu_early.json", DATA / "results_quick_cpu.json"]
RECORDED = OLDER + [REPO / "reports" / "example-linux-cpu-amd-epyc" / "results.json"]


@pytest.mark.parametrize("path", OLDER, ids=lambda p: p.name)
def test_recorded_files_load_as_today_s_schema_and_stay_untouched(path):
    before = path.read_bytes()
    assert json.loads(before)["schema"] == "mac-moesd/1"
    data = load_results(path)
    assert data["schema"] == SCHEMA == "mac-moesd/3"
    assert path.read_bytes() == before


def test_resuming_an_older_file_keeps_its_points_and_writes_today_s_schema(tmp_path):
    path = tmp_path / "results.json"
    shutil.copy(DATA / "results_quick_cpu.json", path)
    old = json.loads(path.read_text())
    store = ResultsStore(path, {**old["meta"], "time": "t1", "command": "mac-moesd sweep x"})
    store.save()
    new = json.loads(path.read_text())
    assert new["schema"] == "mac-moesd/3"
    assert new["sweeps"] == old["sweeps"] and new["fits"] == old["fits"]


@pytest.mark.parametrize("path", RECORDED, ids=lambda p: p.name if p.parent == DATA else "example-report")
def test_every_key_of_the_recorded_files_is_declared(path):
    assert validate.undeclared_keys(load_results(path)) == []


def test_an_undeclared_key_is_found():
    data = {"schema": SCHEMA, "sweeps": {"m|fp16|L64|layers2": {"points": {"1x1": {"median_s": 1.0, "medain_s": 2}}}}}
    assert validate.undeclared_keys(data) == [".sweeps['m|fp16|L64|layers2'].points['1x1'].medain_s"]


@pytest.mark.parametrize("path", RECORDED, ids=lambda p: p.name if p.parent == DATA else "example-report")
def test_every_value_of_the_recorded_files_has_its_declared_type(path):
    assert validate.first_problem(load_results(path)) is None


def test_a_value_of_another_type_is_found_with_its_place():
    from mac_moesd.results import validate

    data = {"schema": SCHEMA, "spec": {"k": {"runs": [{"greedy_check": {"first_mismatch_at": [3, 9]}},
                                                      {"batch": "two"}]}}}
    assert validate.first_problem(data) == ".spec['k'].runs[1].batch is a string, not a number"
    assert validate.first_problem({"schema": SCHEMA, "roofline": {"ridge_flop_per_byte": float("inf")}}) == (
        ".roofline.ridge_flop_per_byte is inf, not a finite number")


@pytest.mark.parametrize("path", OLDER, ids=lambda p: p.name)
def test_upgrade_moves_an_early_run_s_prediction_into_predicted_by(path):
    early = json.loads(path.read_text())
    runs = [r for doc in early["spec"].values() for r in doc["runs"]]
    assert runs and all("predicted_by" not in r and "predicted_from" not in r for r in runs)
    upgraded = [r for doc in load_results(path)["spec"].values() for r in doc["runs"]]
    # Before predicted_from, the one prediction a run held was the fitted model's; no fit named.
    assert [r["predicted_by"] for r in upgraded] == [
        {"measured": None, "model": r["predicted_speedup"], "fit": None} for r in runs]


def test_upgrade_files_a_timed_parts_prediction_under_measured_and_leaves_todays_runs_alone():
    from mac_moesd.results import schema

    today = {"predicted_speedup": 1.2, "predicted_from": "measured",
             "predicted_by": {"measured": 1.2, "model": 1.1, "fit": "2026-12-01T10:00:00.000000+00:00"}}
    data = {"schema": "mac-moesd/2", "spec": {"a|b|real": {"runs": [
        {"predicted_speedup": 0.9, "predicted_from": "measured"}, dict(today), {"batch": 1}]}}}
    runs = schema.upgrade(data)["spec"]["a|b|real"]["runs"]
    assert runs[0]["predicted_by"] == {"measured": 0.9, "model": None, "fit": None}
    assert runs[1] == today and runs[2] == {"batch": 1}
    assert schema.upgrade({"schema": "mac-moesd/1", "spec": ["not", "documents"]})["schema"] == SCHEMA  # left to validate
