"""Thermal pressure: read through a faked notify API, recorded in every document a stage writes,
warned about, and marked in the report."""

import types

import pytest
from click.testing import CliRunner
from test_roofline import TINY

from mac_moesd.pipeline import runner, stages
from mac_moesd.cli import cli
from mac_moesd.machine import thermal
from mac_moesd.reporting import report
from mac_moesd.results import ResultsStore, load_results

META = {"chip_slug": "x", "backend": "cpu", "versions": {}, "blas": {}}


def fake_notify(states, register_status=0, get_status=0):
    """A stand-in for libSystem's notify functions: each notify_get_state returns the next of
    ``states`` (OSThermalPressureLevel values). Calls are logged."""
    states, log = iter(states), []

    def notify_register_check(name, token):
        log.append(("register", name))
        token.contents.value = 41
        return register_status

    def notify_get_state(token, state):
        log.append(("get", token))
        state.contents.value = next(states)
        return get_status

    def notify_cancel(token):
        log.append(("cancel", token))
        return 0

    lib = types.SimpleNamespace(notify_register_check=notify_register_check,
                                notify_get_state=notify_get_state, notify_cancel=notify_cancel)
    return lib, log


@pytest.fixture
def mac(monkeypatch):
    """This process as macOS: returns a function installing a faked notify API."""
    monkeypatch.setattr(thermal, "platform", types.SimpleNamespace(system=lambda: "Darwin"))

    def install(states, **status):
        lib, log = fake_notify(states, **status)
        monkeypatch.setattr(thermal, "load_libsystem", lambda: lib)
        return log

    return install


def test_every_level_is_read_and_the_token_cancelled(mac):
    log = mac([0, 1, 2, 3, 4])
    assert [thermal.read().level for _ in range(5)] == ["nominal", "moderate", "heavy", "trapping", "sleeping"]
    # each reading registers, reads the token it was given and cancels it
    assert log == [("register", b"com.apple.system.thermalpressurelevel"), ("get", 41), ("cancel", 41)] * 5


@pytest.mark.parametrize("states, status, reason", [
    ([0], {"register_status": 1000000}, "notify_register_check returned status 1000000"),
    ([0], {"get_status": 2}, "notify_get_state returned status 2"),
    ([10], {}, "unknown thermal pressure level 10"),  # iOS numbering, not macOS's
])
def test_a_failed_reading_is_none_with_its_reason(mac, states, status, reason):
    mac(states, **status)
    reading = thermal.read()
    assert reading.level is None and reading.reason == reason
    assert reason in thermal.unread_warning(reading)


def test_without_libsystem_the_reading_is_none(mac, monkeypatch):
    def missing():
        raise OSError("dlopen(/usr/lib/libSystem.B.dylib): image not found")

    monkeypatch.setattr(thermal, "load_libsystem", missing)
    reading = thermal.read()
    assert reading.level is None and "image not found" in reading.reason


def test_off_macos_nothing_is_read_and_nothing_warned():
    reading = thermal.read()  # this Linux box
    assert reading.level is None and "macOS only" in reading.reason
    assert thermal.unread_warning(reading) is None
    assert thermal.record(reading, reading) is None


def test_throttled_from_moderate_on():
    assert [thermal.throttled(level) for level in (*thermal.LEVELS, None)] == [False, True, True, True, True, False]
    assert thermal.warning("sweep m", {"before": "nominal", "after": "nominal"}) is None
    assert "sweep m ran under thermal pressure (before: nominal, after: moderate)" in thermal.warning(
        "sweep m", {"before": "nominal", "after": "moderate"})


def test_a_stage_records_pressure_in_what_it_wrote_and_warns(tmp_path, mac):
    mac([0, 2])  # nominal before the stage, heavy after it
    store = ResultsStore(tmp_path / "results.json", META)
    store.put("routing", "old|x", {"model": "old", "text": "x"})  # an earlier stage's document
    outcome = runner.Outcome()

    def work():
        store.put("routing", "m|code", {"model": "m", "text": "code"})

    runner.isolated(store, outcome, "routing m", work)
    data = load_results(tmp_path / "results.json")  # saved, as a report reads it
    assert data["routing"]["m|code"]["thermal_pressure"] == {"before": "nominal", "after": "heavy"}
    assert "thermal_pressure" not in data["routing"]["old|x"]
    assert len(outcome.warnings) == 1 and outcome.warnings[0].startswith("routing m ran under thermal pressure")
    assert outcome.ran == ["routing m"]


def test_on_linux_a_stage_records_null(tmp_path):
    store = ResultsStore(tmp_path / "results.json", META)
    outcome = runner.Outcome()
    runner.isolated(store, outcome, "routing m", lambda: store.put("routing", "m|code", {"model": "m"}))
    assert "thermal_pressure" in store.data["routing"]["m|code"]
    assert store.data["routing"]["m|code"]["thermal_pressure"] is None
    assert outcome.warnings == []


def test_a_throttled_roofline_is_marked_in_the_report(tmp_path, mac):
    mac([1, 3])  # moderate before, trapping after
    store = ResultsStore(tmp_path / "results.json", META)
    outcome = runner.Outcome()
    plan = types.SimpleNamespace(roofline=TINY)
    ctx = runner.Context(store, "cpu", None, outcome)
    runner.isolated(store, outcome, "roofline", lambda: stages.roofline_stage(plan).work(ctx))
    assert store.data["roofline"]["thermal_pressure"] == {"before": "moderate", "after": "trapping"}
    md = report.to_markdown(report.build_blocks(store.data, {}))
    assert ("> THROTTLED: the roofline ran under thermal pressure (moderate before, trapping after): macOS "
            "slowed the chip") in md
    store.data["roofline"]["thermal_pressure"] = {"before": "nominal", "after": "nominal"}
    assert "THROTTLED" not in report.to_markdown(report.build_blocks(store.data, {}))


def test_cli_run_prints_the_stages_warnings(tmp_path, monkeypatch):
    def measured(*args, **kwargs):
        outcome = runner.Outcome(ran=["roofline"])
        outcome.warn(thermal.warning("roofline", {"before": "nominal", "after": "heavy"}))
        return outcome

    monkeypatch.setattr(stages, "run_all", measured)
    result = CliRunner().invoke(cli, ["run", "--quick", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.stderr
    assert "warning: roofline ran under thermal pressure (before: nominal, after: heavy)" in result.stderr


def test_every_timed_section_is_named_when_throttled():
    from mac_moesd.reporting.formatting import throttled_lines

    hot = {"before": "heavy", "after": None}
    data = {"sweeps": {"k": {"model": "m", "layers": 2, "context": 64, "thermal_pressure": hot}},
            "draft": {"k": {"model": "d", "thermal_pressure": hot}},
            "reject": {"k": {"thermal_pressure": hot}},
            "routing": {"k": {"model": "m", "text": "code", "thermal_pressure": hot}},
            "spec": {"k": {"target": "m", "draft": "d", "prompts": {"name": "chat"}, "thermal_pressure": hot}},
            "serving": {"k": {"target_name": "m", "thermal_pressure": hot}},
            "fits": {"m": {"thermal_pressure": hot}}}  # a fit times nothing
    names = [line.split(" ran under")[0].removeprefix("THROTTLED: ") for line in throttled_lines(data)]
    assert names == ["the sweep of m (2 layers, context 64)", "the drafter step of d", "the rejection-sampling step",
                     "the routing of m on code", "measured SD of m with d on chat", "serving m"]
    assert "(heavy before, unknown after)" in throttled_lines(data)[0]
