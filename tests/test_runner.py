"""The stage runner with fake stages (milliseconds): isolation (a failure of the listed kinds is
skipped with its reason and the next stage runs; anything else is a bug and goes up, the stages
before it saved), resume (a stage done in an earlier run is not run again), and the exit status."""

import json

import pytest

from mac_moesd.errors import MacMoesdError
from mac_moesd.pipeline import runner
from mac_moesd.pipeline.runner import Context, Outcome, Stage
from mac_moesd.results import ResultsStore

META = {"chip_slug": "x", "backend": "cpu", "versions": {}, "blas": {}}


def writes(section: str, key: str):
    """A stage's work that writes one document, as a measuring stage does."""
    def work(ctx: Context) -> None:
        ctx.store.put(section, key, {"model": key, "memory": {"usable_bytes": ctx.usable_bytes}})
    return work


def fails(err: BaseException):
    def work(ctx: Context) -> None:
        raise err
    return work


def run(tmp_path, stages, data=None):
    path = tmp_path / "results.json"
    if data is not None:
        path.write_text(json.dumps({"schema": "mac-moesd/3", "meta": META, **data}))
    store = ResultsStore(path, META)
    return runner.run_stages(stages, Context(store, "cpu", None, Outcome())), path


@pytest.mark.parametrize("err, reason", [
    (MacMoesdError("does not fit in 3 GiB\nmore detail"), "does not fit in 3 GiB"),
    (MemoryError("malloc of 9 GiB failed"), "MemoryError: malloc of 9 GiB failed"),
    (MemoryError(), "MemoryError"),
    (RuntimeError("[metal] command buffer failed"), "RuntimeError: [metal] command buffer failed"),
])
def test_a_failing_stage_is_skipped_with_its_reason_and_the_next_runs(tmp_path, err, reason):
    outcome, path = run(tmp_path, [Stage("sweep a", fails(err)), Stage("sweep b", writes("sweeps", "b"))])
    assert outcome.skipped == {"sweep a": reason} and outcome.ran == ["sweep b"]
    saved = json.loads(path.read_text())
    assert saved["skipped"] == {"sweep a": reason}
    assert saved["sweeps"]["b"]["memory"]["usable_bytes"] > 0  # planned within the memory usable as it started
    assert "thermal_pressure" in saved["sweeps"]["b"]
    assert outcome.exit_status == 3


def test_an_error_outside_the_list_is_a_bug_and_goes_up_with_earlier_stages_saved(tmp_path):
    stages = [Stage("sweep a", writes("sweeps", "a")), Stage("sweep b", fails(KeyError("points"))),
              Stage("sweep c", writes("sweeps", "c"))]
    with pytest.raises(KeyError, match="points"):
        run(tmp_path, stages)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert list(saved["sweeps"]) == ["a"] and "skipped" not in saved


def test_a_stage_done_in_an_earlier_run_is_kept_and_an_earlier_skip_is_cleared(tmp_path):
    calls = []
    done_before = Stage("sweep a", lambda ctx: calls.append("a"), done=lambda data: "a" in data.get("sweeps", {}))
    skipped_before = Stage("sweep b", writes("sweeps", "b"), done=lambda data: "b" in data.get("sweeps", {}))
    outcome, path = run(tmp_path, [done_before, skipped_before],
                        data={"sweeps": {"a": {"model": "a"}}, "skipped": {"sweep b": "did not fit"}})
    assert calls == [] and outcome.ran == ["sweep a", "sweep b"] and outcome.exit_status == 0
    assert json.loads(path.read_text())["skipped"] == {}


@pytest.mark.parametrize("ran, skipped, status", [
    (["roofline", "sweep a", "fit"], {}, 0),
    (["roofline", "fit"], {"sweep a": "did not fit"}, 3),
    (["fit"], {"roofline": "x", "sweep a": "y"}, 1),  # only the fit ran: nothing was measured
    ([], {"roofline": "x"}, 1),
])
def test_the_exit_status(ran, skipped, status):
    assert Outcome(ran=ran, skipped=skipped).exit_status == status
