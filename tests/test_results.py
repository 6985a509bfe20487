import json

import pytest

from mac_moesd.errors import MacMoesdError
from mac_moesd.results import SCHEMA, ResultsStore, load_results

META = {"chip_slug": "apple-m3-max-40c", "backend": "metal", "versions": {"mlx": "0.32.4"},
        "blas": {"name": "n/a"}, "time": "t0", "command": "mac-moesd sweep x"}


def test_new_store_writes_schema_and_meta(tmp_path):
    store = ResultsStore(tmp_path / "r" / "results.json", META)
    entry = store.entry("sweeps", "k", {"model": "m"})
    entry["points"]["1x1"] = {"median_s": 1.0}
    store.save()
    data = load_results(tmp_path / "r" / "results.json")
    assert data["schema"] == SCHEMA
    assert data["meta"]["chip_slug"] == "apple-m3-max-40c"
    assert data["sweeps"]["k"]["points"]["1x1"]["median_s"] == 1.0
    assert not list((tmp_path / "r").glob(".*tmp"))  # the temp file was renamed away


def test_reopen_keeps_points(tmp_path):
    path = tmp_path / "results.json"
    store = ResultsStore(path, META)
    store.entry("sweeps", "k", {})["points"]["1x1"] = {"median_s": 1.0}
    store.save()
    again = ResultsStore(path, {**META, "time": "t1"})
    assert again.entry("sweeps", "k", {})["points"] == {"1x1": {"median_s": 1.0}}
    assert again.data["meta"]["last_run"]["time"] == "t1"


@pytest.mark.parametrize("content, fragment", [
    ("{not json", "corrupt"),
    ("[1, 2]", "not a mac-moesd results file"),
    (json.dumps({"schema": "mac-moesd/0", "meta": {}}), "schema 'mac-moesd/0'"),
])
def test_bad_files_are_reported_and_left_untouched(tmp_path, content, fragment):
    path = tmp_path / "results.json"
    path.write_text(content)
    with pytest.raises(MacMoesdError, match=fragment):
        ResultsStore(path, META)
    assert path.read_text() == content


@pytest.mark.parametrize("change", [{"chip_slug": "apple-m1-8c"}, {"backend": "cpu"},
                                    {"versions": {"mlx": "0.1"}}])
def test_results_from_another_machine_refuse_to_merge(tmp_path, change):
    path = tmp_path / "results.json"
    ResultsStore(path, META).save()
    before = path.read_text()
    with pytest.raises(MacMoesdError, match="measured elsewhere"):
        ResultsStore(path, {**META, **change})
    assert path.read_text() == before
