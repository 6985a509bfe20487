import subprocess
from pathlib import Path

import pytest

from mac_moesd.machine import hardware

DATA = Path(__file__).parent / "data"


def test_gpu_cores_from_system_profiler():
    text = (DATA / "system_profiler_m3max.json").read_text()
    assert hardware.parse_gpu_cores_system_profiler(text) == 40
    assert hardware.parse_gpu_cores_system_profiler("not json") is None


def test_gpu_cores_from_ioreg():
    assert hardware.parse_gpu_cores_ioreg((DATA / "ioreg_agx_m2pro.txt").read_text()) == 19
    assert hardware.parse_gpu_cores_ioreg("") is None


def test_linux_parsers():
    assert hardware.parse_cpuinfo_model((DATA / "cpuinfo_epyc.txt").read_text()) == (
        "AMD EPYC 7763 64-Core Processor"
    )
    mem = hardware.parse_meminfo((DATA / "meminfo.txt").read_text())
    assert mem == {"MemTotal": 24636612 * 1024, "MemAvailable": 24112300 * 1024}
    assert hardware.parse_power_source((DATA / "pmset_batt.txt").read_text()) == "Battery Power"


def test_spec_lookup_by_tier_and_binning():
    full = hardware.lookup_spec("Apple M3 Max", 40)
    binned = hardware.lookup_spec("Apple M3 Max", 30)
    assert full["bandwidth_bytes_s"] == 400e9
    assert binned["bandwidth_bytes_s"] == 300e9
    assert hardware.lookup_spec("Apple M4 Max", 32)["bandwidth_bytes_s"] == 410e9
    assert hardware.lookup_spec("apple m1 max", None)["gpu_cores"] == 32
    assert hardware.lookup_spec("Apple M1 Max", 31) is None
    assert hardware.lookup_spec("Intel Xeon", None) is None


def test_spec_ridge_is_flops_over_bandwidth():
    m1_max = hardware.lookup_spec("Apple M1 Max", 32)
    assert m1_max["ridge_flop_per_byte"] == pytest.approx(10.4e12 / 400e9)
    assert hardware.lookup_spec("Apple M4 Pro", 20)["ridge_flop_per_byte"] is None


def test_every_entry_is_sourced_and_unique():
    keys = [(c["name"], c["gpu_cores"]) for c in hardware.APPLE_CHIPS]
    assert len(keys) == len(set(keys))
    for chip in hardware.APPLE_CHIPS:
        assert chip["source"].startswith("https://")
        assert chip["bandwidth_bytes_s"] > 0


def test_chip_slugs():
    assert hardware.chip_slug("Apple M3 Max", 40, "metal") == "apple-m3-max-40c"
    linux = hardware.chip_slug("AMD EPYC 7763 64-Core Processor", None, "cpu")
    assert linux.endswith("-cpu-amd-epyc-7763")
    intel = hardware.chip_slug("Intel(R) Xeon(R) CPU E5-2686 v4 @ 2.30GHz", None, "cpu")
    assert intel.endswith("-cpu-intel-xeon-e5-2686-v4")


def test_detect_here():
    machine = hardware.detect()
    assert machine.backend in {"metal", "cuda", "cpu"}
    assert machine.slug
    assert machine.memory_bytes and machine.memory_bytes > 0


def test_power_and_thermal_parsers():
    assert hardware.parse_low_power_mode((DATA / "pmset_g.txt").read_text()) is True
    assert hardware.parse_low_power_mode(" lowpowermode         0\n") is False
    assert hardware.parse_low_power_mode(" powermode            1\n") is True  # High Power Mode Macs
    assert hardware.parse_low_power_mode(" powermode            2\n") is False
    assert hardware.parse_low_power_mode("") is None
    nominal = hardware.parse_thermal((DATA / "pmset_therm_nominal.txt").read_text())
    assert nominal == {"speed_limit": 100, "warnings": []}
    hot = hardware.parse_thermal((DATA / "pmset_therm_throttled.txt").read_text())
    assert hot == {"speed_limit": 62, "warnings": []}
    assert hardware.parse_thermal("Thermal Warning Level = 2\n")["warnings"] == ["Thermal Warning Level = 2"]
    assert hardware.parse_thermal("") is None


def test_power_warnings_give_advice():
    assert hardware.power_warnings("AC Power", False, {"speed_limit": 100, "warnings": []}) == []
    warnings = hardware.power_warnings("Battery Power", True, {"speed_limit": 62, "warnings": []})
    assert len(warnings) == 3
    assert "plug in power" in warnings[0]
    assert "Low Power Mode" in warnings[1] and "lowpowermode 0" in warnings[1]
    assert "CPU speed limit 62%" in warnings[2] and "cool down" in warnings[2]


def test_native_python_check():
    assert hardware.native_python_problem("Linux", "x86_64", "") is None
    assert hardware.native_python_problem("Darwin", "arm64", "0\n") is None
    rosetta = hardware.native_python_problem("Darwin", "x86_64", "1\n")
    assert "native arm64 Python" in rosetta and "Rosetta" in rosetta
    assert "native arm64 Python" in hardware.native_python_problem("Darwin", "x86_64", "")


def test_cli_refuses_rosetta_python_before_mlx(monkeypatch, capsys):
    import sys

    from mac_moesd import cli

    monkeypatch.setattr(hardware.platform, "system", lambda: "Darwin")
    monkeypatch.setattr(hardware.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(hardware, "run_tool", lambda args: "1\n" if "sysctl.proc_translated" in args else "")
    monkeypatch.setattr(sys, "argv", ["mac-moesd", "info"])
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    assert exit_.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs a native arm64 Python" in err[0]


def test_tools_by_absolute_path_then_bare_name(monkeypatch):
    tried = []

    def fake_run(args, **kwargs):
        tried.append(args[0])
        if args[0].startswith("/"):
            raise FileNotFoundError(args[0])
        return subprocess.CompletedProcess(args, 0, stdout="Apple M2\n")

    monkeypatch.setattr(hardware.subprocess, "run", fake_run)
    assert hardware.run_tool(["sysctl", "-n", "machdep.cpu.brand_string"]) == "Apple M2\n"
    assert tried == ["/usr/sbin/sysctl", "sysctl"]
    assert hardware.TOOLS["pmset"] == "/usr/bin/pmset"


def test_detect_on_a_mac_without_tools_names_the_chip_from_mlx(monkeypatch):
    monkeypatch.setattr(hardware.platform, "system", lambda: "Darwin")
    monkeypatch.setattr(hardware, "run_tool", lambda args: "")
    monkeypatch.setattr(hardware, "mlx_backend", lambda: "metal")
    monkeypatch.setattr(hardware, "mlx_device_info", lambda: {
        "device_name": "Apple M3 Max", "memory_size": 64 * 2**30,
        "max_recommended_working_set_size": 48 * 2**30})
    machine = hardware.detect()
    assert machine.chip == "Apple M3 Max"
    assert machine.spec is not None and machine.spec["gpu_cores"] == 40
    assert machine.memory_bytes == 64 * 2**30 and machine.available_bytes == 48 * 2**30
    assert machine.warnings == []


def test_measuring_stage_wires_and_restores(monkeypatch):
    import mlx.core as mx

    calls = []
    monkeypatch.setattr(hardware, "mlx_backend", lambda: "metal")
    monkeypatch.setattr(hardware, "mac_version", lambda: "15.1")
    monkeypatch.setattr(mx, "device_info", lambda: {"max_recommended_working_set_size": 123})
    monkeypatch.setattr(mx, "set_wired_limit", lambda limit: calls.append(limit) or 7)
    with hardware.measuring_stage() as stage:
        assert calls == [123]
    assert stage == {"wired_limit_bytes": 123}
    assert calls == [123, 7]  # the previous limit, restored
    with pytest.raises(RuntimeError):
        with hardware.measuring_stage():
            raise RuntimeError("command buffer failed")
    assert calls == [123, 7, 123, 7]


def test_m5_tiers_and_derived_flops():
    assert hardware.lookup_spec("Apple M5 Pro", 20)["bandwidth_bytes_s"] == 307e9
    assert hardware.lookup_spec("Apple M5 Max", None)["bandwidth_bytes_s"] == 614e9
    assert hardware.lookup_spec("Apple M5 Max", 32) is None  # binned tier: not on the cited page
    assert hardware.lookup_spec("Apple M5", 10)["bandwidth_bytes_s"] == 153e9
    m2_max = hardware.lookup_spec("Apple M2 Max", 38)
    assert m2_max["fp32_flops"] == pytest.approx(13.6e12) and "not stated by Apple" in m2_max["derived"]
    assert hardware.lookup_spec("Apple M1", 8)["derived"] == ""  # 2.6 TFLOPS is on the M1 release
