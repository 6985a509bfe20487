from pathlib import Path

import pytest

from mac_moesd import hardware

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
    assert full.bandwidth_bytes_s == 400e9
    assert binned.bandwidth_bytes_s == 300e9
    assert hardware.lookup_spec("Apple M4 Max", 32).bandwidth_bytes_s == 410e9
    assert hardware.lookup_spec("apple m1 max", None).gpu_cores == 32
    assert hardware.lookup_spec("Apple M1 Max", 31) is None
    assert hardware.lookup_spec("Intel Xeon", None) is None


def test_spec_ridge_is_flops_over_bandwidth():
    m1_max = hardware.lookup_spec("Apple M1 Max", 32)
    assert m1_max.ridge_flop_per_byte == pytest.approx(10.4e12 / 400e9)
    assert hardware.lookup_spec("Apple M4 Pro", 20).ridge_flop_per_byte is None


def test_every_entry_is_sourced_and_unique():
    keys = [(c.name, c.gpu_cores) for c in hardware.APPLE_CHIPS]
    assert len(keys) == len(set(keys))
    for chip in hardware.APPLE_CHIPS:
        assert chip.source.startswith("https://")
        assert chip.bandwidth_bytes_s > 0


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
