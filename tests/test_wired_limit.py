"""The wired limit is set, and recorded, only where MLX can wire memory: Metal on macOS 15+.

MLX wires through Metal residency sets, which macOS has from 15.0; ``mx.set_wired_limit`` is
documented as "only useful on macOS 15.0 or higher". The hardware is faked here.
"""

import mlx.core as mx
import pytest

from mac_moesd.machine import hardware


def fake_mac(monkeypatch, version: str, backend: str = "metal") -> list:
    calls = []
    monkeypatch.setattr(hardware, "mlx_backend", lambda: backend)
    monkeypatch.setattr(hardware, "mac_version", lambda: version)
    monkeypatch.setattr(mx, "device_info", lambda: {"max_recommended_working_set_size": 123})
    monkeypatch.setattr(mx, "set_wired_limit", lambda limit: calls.append(limit) or 7)
    return calls


@pytest.mark.parametrize("version", ["14.6.1", "13.0", "14"])
def test_before_macos_15_nothing_is_wired_and_the_record_says_why(monkeypatch, version):
    calls = fake_mac(monkeypatch, version)
    with hardware.measuring_stage() as stage:
        pass
    assert calls == []
    assert stage["wired_limit_bytes"] is None
    assert f"macOS {version} has no Metal residency sets" in stage["wired_limit_note"]


@pytest.mark.parametrize("version", ["15.0", "15.3.2", "26.1"])
def test_from_macos_15_the_limit_is_set_and_restored(monkeypatch, version):
    calls = fake_mac(monkeypatch, version)
    with hardware.measuring_stage() as stage:
        assert calls == [123]
    assert stage == {"wired_limit_bytes": 123}
    assert calls == [123, 7]


def test_the_limit_is_restored_only_after_both_streams_finish(monkeypatch):
    from mlx_lm.generate import generation_stream

    events = []
    fake_mac(monkeypatch, "26.1")
    monkeypatch.setattr(mx, "set_wired_limit", lambda limit: events.append(("limit", limit)) or 7)
    monkeypatch.setattr(mx, "synchronize", lambda stream=None: events.append(("sync", stream)))
    with hardware.measuring_stage():
        events.clear()
    assert events == [("sync", None), ("sync", generation_stream), ("limit", 7)]


@pytest.mark.parametrize("sw_vers, mac_ver, expected", [
    ("26.1\n", "16.0", "26.1"),  # a Python built against an older SDK says 16.0 for macOS 26
    ("", "15.3", "15.3"),  # sw_vers could not be run
])
def test_the_macos_version_comes_from_sw_vers(monkeypatch, sw_vers, mac_ver, expected):
    hardware.mac_version.cache_clear()
    monkeypatch.setattr(hardware.platform, "system", lambda: "Darwin")
    monkeypatch.setattr(hardware.platform, "mac_ver", lambda: (mac_ver, ("", "", ""), "arm64"))
    monkeypatch.setattr(hardware, "run_tool", lambda args: sw_vers if args == ["sw_vers", "-productVersion"] else "")
    try:
        assert hardware.mac_version() == expected
    finally:
        hardware.mac_version.cache_clear()


def test_off_metal_the_record_is_null_with_the_backend(monkeypatch):
    calls = fake_mac(monkeypatch, "", backend="cpu")
    with hardware.measuring_stage() as stage:
        pass
    assert calls == [] and stage["wired_limit_bytes"] is None
    assert "cpu backend" in stage["wired_limit_note"]


def test_unavailability_rule():
    assert hardware.wired_limit_unavailable("metal", "15.0") is None
    assert hardware.wired_limit_unavailable("metal", "14.7") == (
        "macOS 14.7 has no Metal residency sets (macOS 15 and later), so MLX cannot wire memory here")
    assert hardware.wired_limit_unavailable("metal", "26.1") is None
    assert "could not be read" in hardware.wired_limit_unavailable("metal", "")
