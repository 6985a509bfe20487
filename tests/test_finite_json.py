"""NaN and infinity never reach a JSON document: a figure that could not be computed is null with
its reason beside it, and a timing that came out non-finite is retimed, never recorded."""

import json
import math

import pytest

from mac_moesd.errors import MacMoesdError
from mac_moesd.finite_json import finite_document
from mac_moesd.measure.clock import timing
from mac_moesd.results import ResultsStore, load_results

META = {"chip_slug": "x", "backend": "cpu", "versions": {"mlx": "0"}, "blas": {}}


def test_non_finite_figures_become_null_with_a_reason():
    doc = {"a": 1.0, "ci_rel": math.inf, "nested": {"mape": math.nan, "ok": 2}, "xs": [1.0, -math.inf]}
    out = finite_document(doc)
    assert out["a"] == 1.0 and out["ci_rel"] is None and out["nested"]["mape"] is None
    assert out["xs"] == [1.0, None]
    assert out["null_reasons"] == {"ci_rel": "not computable (came out inf)", "xs[1]": "not computable (came out -inf)"}
    assert out["nested"]["null_reasons"] == {"mape": "not computable (came out nan)"}
    json.dumps(out, allow_nan=False)  # valid JSON
    assert finite_document({"a": [1, {"b": 2.5}]}) == {"a": [1, {"b": 2.5}]}  # finite: unchanged


def test_a_results_file_with_an_infinite_ci_is_written_and_reads_back(tmp_path):
    # A point whose median came out 0 has no relative CI (median_ci_rel is inf); before, the
    # store's strict json.dump raised ValueError and the point, and every later one, was lost.
    path = tmp_path / "results.json"
    store = ResultsStore(path, META)
    values = timing.summarise([0.0, 0.0, 0.0], target_ci=0.01, warmups=0)
    assert values["ci_rel"] == math.inf
    store.entry("sweeps", "k", {})["points"]["1x1"] = values
    store.save()
    point = load_results(path)["sweeps"]["k"]["points"]["1x1"]
    assert point["ci_rel"] is None and "inf" in point["null_reasons"]["ci_rel"]
    assert "NaN" not in path.read_text() and "Infinity" not in path.read_text()


def test_a_non_finite_sample_is_retimed(monkeypatch):
    samples = iter([math.nan, 0.002, 0.002, math.inf, 0.002])
    monkeypatch.setattr(timing, "time_once", lambda point: next(samples))
    budget = timing.Budget(warmup=0, min_repeats=3, max_repeats=3, per_visit=3)
    (m,) = timing.measure({"p": timing.Point(run=lambda: None)}, budget).values()
    assert m["repeats"] == 3 and m["samples_s"] == [0.002, 0.002, 0.002]


def test_a_sample_that_stays_non_finite_is_an_error(monkeypatch):
    monkeypatch.setattr(timing, "time_once", lambda point: math.nan)
    with pytest.raises(MacMoesdError, match="came out nan 3 times"):
        timing.measure({"p": timing.Point(run=lambda: None)}, timing.Budget(warmup=0, min_repeats=3))


def test_json_output_of_a_command_is_valid_json(capsys):
    from mac_moesd import cli

    cli.emit({"speedup": math.nan}, True, str)
    doc = json.loads(capsys.readouterr().out)
    assert doc == {"speedup": None, "null_reasons": {"speedup": "not computable (came out nan)"}}
