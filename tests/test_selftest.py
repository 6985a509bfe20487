"""The selftest's checks pass here, and each can fail."""

import json

import mlx.core as mx
import pytest
from click.testing import CliRunner

from mac_moesd.measure import kernels, selftest
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


def test_launch_scaling_passes_and_catches_merged_launches():
    assert "2K/K time ratio" in selftest.check_launch_scaling()
    a = mx.random.uniform(shape=(selftest.CHECK_ELEMENTS,))
    mx.eval(a)
    shared = {}

    def merged(i):  # what deduplication would do: one computation however many launches
        if i == 0:
            shared["x"] = mx.sum(a.reshape(-1, 1024), axis=1) * 1.5
        return shared["x"]

    with pytest.raises(selftest.SelftestFailed, match="expected about 2x"):
        selftest.check_launch_scaling(launch=merged)


def test_memory_guard_and_results_checks():
    assert "sliced" in selftest.check_memory_guard() or "refused" in selftest.check_memory_guard()
    assert "same document" in selftest.check_results_roundtrip()


def test_cli_selftest_json_and_exit_status(monkeypatch):
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
