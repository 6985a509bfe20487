"""The selftest's checks pass here, and each can fail."""

import json

import mlx.core as mx
import pytest
from click.testing import CliRunner

from mac_moesd.measure.clock import timing
from mac_moesd.measure.peaks import kernels
from mac_moesd.pipeline import selftest
from mac_moesd.cli import cli


@pytest.mark.parametrize("name", ["read", "copy", "triad"])
def test_kernel_checks_pass(name):
    assert "agrees with its reference" in selftest.check_kernel(name)


def test_fma_check_skips_without_metal():
    if mx.metal.is_available():
        assert "agrees" in selftest.check_kernel("fma")
    else:
        with pytest.raises(selftest.Skipped):
            selftest.check_kernel("fma")


def test_kernel_check_fails_on_a_wrong_kernel(monkeypatch):
    monkeypatch.setattr(kernels, "copy_twin", lambda a: a * 1.0001 + 1)
    k = kernels.Kernels({n: "mlx" for n in kernels.NAMES}, {n: "test" for n in kernels.NAMES})
    [outcome] = selftest.run({"kernel copy": lambda _: selftest.check_kernel("copy", k)})
    assert outcome.status == "FAIL" and "KernelCheckFailed" in outcome.detail


@pytest.mark.timing
def test_launch_scaling_passes_on_this_machine():
    # Real timings: 2K launches of the read kernel against K. On a loaded machine the ratio can
    # leave its band, so this runs in the timing suite only.
    assert "2K/K time ratio" in selftest.check_launch_scaling()


def _distinct_outputs_clock(monkeypatch):
    # A fake clock: an evaluation costs 1 ms per distinct array its launches produce, so K
    # independent launches cost K ms and K launches of one shared result cost 1 ms.
    monkeypatch.setattr(timing, "time_once", lambda point: len({id(x) for x in point.run()}) * 1e-3)


def test_launch_scaling_passes_for_independent_launches(monkeypatch):
    _distinct_outputs_clock(monkeypatch)
    a = mx.ones((1024,))
    assert "2K/K time ratio 2.00" in selftest.check_launch_scaling(launch=lambda i: a + i)


def test_launch_scaling_catches_merged_launches(monkeypatch):
    _distinct_outputs_clock(monkeypatch)
    shared = mx.ones((1024,)) * 1.5  # what deduplication would do: one computation however many launches
    with pytest.raises(selftest.SelftestFailed, match="expected about 2x"):
        selftest.check_launch_scaling(launch=lambda i: shared)


def test_memory_guard_and_results_checks():
    assert "sliced" in selftest.check_memory_guard() or "refused" in selftest.check_memory_guard()
    assert "same document" in selftest.check_results_roundtrip()


def test_cli_selftest_json_and_exit_status(monkeypatch):
    # The command's contract, not this machine's timing: the launch-scaling check (real timings,
    # tested above with a fake clock) stands aside here.
    checks = {**selftest.CHECKS, "K-launch timing is linear": lambda k: "stubbed"}
    monkeypatch.setattr(selftest, "CHECKS", checks)
    monkeypatch.setattr(selftest.run, "__defaults__", (checks,))
    result = CliRunner().invoke(cli, ["selftest", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["passed"] is True
    assert [c["check"] for c in doc["checks"]] == list(selftest.CHECKS)
    assert {c["status"] for c in doc["checks"]} <= {"PASS", "SKIP"}
    monkeypatch.setattr(selftest, "CHECKS", {"results round trip": lambda k: 1 / 0})
    monkeypatch.setattr(selftest.run, "__defaults__", (selftest.CHECKS,))
    failed = CliRunner().invoke(cli, ["selftest"])
    assert failed.exit_code == 1
    assert "FAIL  results round trip: ZeroDivisionError" in failed.stdout
    assert "1 of 1 checks failed" in failed.stdout
