"""What machine this is: chip, GPU cores, memory, MLX backend, and the chip's published specs
(the table itself is ``chips``; its names are re-exported here).

Only this module and ``kernels.py`` know about Metal. The parsers take command output as text so
they are tested on recorded samples; the ``detect`` function runs the commands.
"""

from __future__ import annotations

import contextlib
import functools
import json
import platform
import re
import subprocess
from dataclasses import asdict, dataclass, field
from typing import Iterator

from mac_moesd.errors import MacMoesdError
from mac_moesd.machine.chips import APPLE_CHIPS, lookup_spec
from mac_moesd.results import schema

__all__ = ["APPLE_CHIPS", "Machine", "chip_slug", "detect", "lookup_spec", "measuring_stage",
           "mac_version", "native_python_problem", "power_warnings", "require_native_python",
           "wired_limit_unavailable"]


# ---- parsers of command output (pure; tested on recorded samples) ----


def parse_gpu_cores_system_profiler(text: str) -> int | None:
    """GPU core count from `system_profiler SPDisplaysDataType -json`."""
    try:
        displays = json.loads(text).get("SPDisplaysDataType", [])
    except (json.JSONDecodeError, AttributeError):
        return None
    for entry in displays:
        cores = str(entry.get("sppci_cores", "")).strip()
        if cores.isdigit():
            return int(cores)
    return None


def parse_gpu_cores_ioreg(text: str) -> int | None:
    """GPU core count from `ioreg -rc AGXAccelerator -d 1` ("gpu-core-count" = 40)."""
    match = re.search(r'"gpu-core-count"\s*=\s*(\d+)', text)
    return int(match.group(1)) if match else None


def parse_cpuinfo_model(text: str) -> str | None:
    """CPU model name from /proc/cpuinfo."""
    match = re.search(r"^model name\s*:\s*(.+)$", text, flags=re.MULTILINE)
    return match.group(1).strip() if match else None


def parse_meminfo(text: str) -> dict[str, int]:
    """MemTotal and MemAvailable from /proc/meminfo, in bytes."""
    out = {}
    for key in ("MemTotal", "MemAvailable"):
        match = re.search(rf"^{key}:\s*(\d+)\s*kB", text, flags=re.MULTILINE)
        if match:
            out[key] = int(match.group(1)) * 1024
    return out


def parse_power_source(text: str) -> str | None:
    """'AC Power' or 'Battery Power' from `pmset -g batt`."""
    match = re.search(r"Now drawing from '([^']+)'", text)
    return match.group(1) if match else None


def parse_low_power_mode(text: str) -> bool | None:
    """Low Power Mode from `pmset -g`: "lowpowermode 1", or "powermode 1" (0 automatic, 1 low,
    2 high) on Macs that also offer High Power Mode; None when neither line is there."""
    match = re.search(r"^\s*(low)?powermode\s+(\d+)\s*$", text, flags=re.MULTILINE)
    if not match:
        return None
    return int(match.group(2)) == 1


def parse_thermal(text: str) -> dict | None:
    """Thermal state from `pmset -g therm`: ``speed_limit`` (CPU_Speed_Limit, percent; 100 when
    no CPU power status was recorded) and ``warnings`` (recorded thermal/performance warning
    lines). None when the output is not pmset's."""
    if not re.search(r"warning level|CPU_Speed_Limit|CPU power status", text, flags=re.IGNORECASE):
        return None
    match = re.search(r"CPU_Speed_Limit\s*=\s*(\d+)", text)
    warnings = [line.strip() for line in text.splitlines()
                if re.search(r"warning level", line, flags=re.IGNORECASE)
                and not re.search(r"\bno\b.*has been recorded", line, flags=re.IGNORECASE)]
    return {"speed_limit": int(match.group(1)) if match else 100, "warnings": warnings}


def power_warnings(power_source: str | None, low_power_mode: bool | None, thermal: dict | None) -> list[str]:
    """What about this machine's power state makes timings unlike a plugged-in, cool Mac's."""
    out = []
    if power_source == "Battery Power":
        out.append("running on battery: macOS may lower clocks and memory bandwidth; plug in power "
                   "and rerun for numbers comparable with other Macs")
    if low_power_mode:
        out.append("Low Power Mode is on: clocks are capped; turn it off (System Settings > Battery "
                   "> Low Power Mode, or `sudo pmset -a lowpowermode 0`) and rerun")
    if thermal and (thermal["speed_limit"] < 100 or thermal["warnings"]):
        detail = "; ".join([f"CPU speed limit {thermal['speed_limit']}%", *thermal["warnings"]])
        out.append(f"the Mac is thermally throttled ({detail}): let it cool down, keep it on a hard "
                   "surface, close other heavy apps, then rerun")
    return out


_CPU_NOISE = re.compile(
    r"\(r\)|\(tm\)|\bprocessor\b|\bcpu\b|@.*$|\b\d+-core\b|\bwith radeon.*$", re.IGNORECASE
)


def chip_slug(chip: str, gpu_cores: int | None, backend: str) -> str:
    """A stable folder name: 'apple-m3-max-40c', 'linux-cpu-amd-epyc-7763', 'linux-cuda-...'."""
    words = chip
    prefix = ""
    if not chip.lower().startswith("apple"):
        words = _CPU_NOISE.sub(" ", chip)
        prefix = f"{platform.system().lower() or 'unknown'}-{backend}-"
    slug = re.sub(r"[^a-z0-9]+", "-", words.lower()).strip("-") or "unknown"
    if gpu_cores and chip.lower().startswith("apple"):
        slug += f"-{gpu_cores}c"
    return prefix + slug


# ---- detection (runs commands) ----


# Absolute paths, so detection works under a minimal PATH (launchd, cron, IDEs); the bare name
# is tried when a tool has moved.
TOOLS = {"sysctl": "/usr/sbin/sysctl", "system_profiler": "/usr/sbin/system_profiler",
         "ioreg": "/usr/sbin/ioreg", "pmset": "/usr/bin/pmset", "vm_stat": "/usr/bin/vm_stat",
         "sw_vers": "/usr/bin/sw_vers"}


def run_tool(args: list[str]) -> str:
    for tool in dict.fromkeys([TOOLS.get(args[0], args[0]), args[0]]):
        try:
            done = subprocess.run([tool, *args[1:]], capture_output=True, text=True, timeout=20, check=False)
        except (OSError, subprocess.SubprocessError):
            continue
        return done.stdout
    return ""


@functools.lru_cache(maxsize=1)
def mac_version() -> str:
    """macOS's version (e.g. "26.1"); "" off macOS. ``sw_vers`` first: a Python built against an
    SDK older than macOS 26 reports 26 as "16.0" through ``platform.mac_ver`` (CPython issue
    #135675), which would misdate the OS in every record and in the wired-limit rule."""
    if platform.system() != "Darwin":
        return ""
    return run_tool(["sw_vers", "-productVersion"]).strip() or platform.mac_ver()[0]


def read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


@dataclass(frozen=True)
class Machine:
    chip: str
    gpu_cores: int | None
    memory_bytes: int | None
    available_bytes: int | None  # what a measurement may allocate: working set on Metal, free RAM elsewhere
    backend: str  # "metal", "cuda" or "cpu"
    os: str
    spec: schema.ChipSpec | None
    slug: str
    power_source: str | None
    device_info: dict
    low_power_mode: bool | None = None
    thermal: dict | None = None
    warnings: list[str] = field(default_factory=list)  # power and thermal state, with advice

    def to_dict(self) -> dict:
        return asdict(self)


def mlx_backend() -> str:
    import mlx.core as mx

    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return "cpu"


def mlx_device_info() -> dict:
    import mlx.core as mx

    try:
        info = mx.device_info()
    except Exception:  # older MLX or a backend without the query
        return {}
    return {k: (v if isinstance(v, (int, float, str)) else str(v)) for k, v in info.items()}


def detect() -> Machine:
    """Detect this machine. On macOS: chip, GPU cores, memory, working set; elsewhere: CPU, RAM."""
    backend = mlx_backend()
    info = mlx_device_info()
    system = platform.system()
    power = None
    low_power = thermal = None
    if system == "Darwin":
        # MLX's device name ("Apple M3 Max") when sysctl cannot be run at all
        chip = (run_tool(["sysctl", "-n", "machdep.cpu.brand_string"]).strip()
                or str(info.get("device_name") or "") or platform.processor())
        cores = parse_gpu_cores_system_profiler(
            run_tool(["system_profiler", "SPDisplaysDataType", "-json"])
        ) or parse_gpu_cores_ioreg(run_tool(["ioreg", "-rc", "AGXAccelerator", "-d", "1"]))
        memsize = run_tool(["sysctl", "-n", "hw.memsize"]).strip()
        memory = int(memsize) if memsize.isdigit() else info.get("memory_size")
        available = info.get("max_recommended_working_set_size") or memory
        power = parse_power_source(run_tool(["pmset", "-g", "batt"]))
        low_power = parse_low_power_mode(run_tool(["pmset", "-g"]))
        thermal = parse_thermal(run_tool(["pmset", "-g", "therm"]))
        spec = lookup_spec(chip, cores)
    else:
        chip = parse_cpuinfo_model(read_text("/proc/cpuinfo")) or platform.processor() or "unknown"
        cores = None
        mem = parse_meminfo(read_text("/proc/meminfo"))
        memory = mem.get("MemTotal")
        available = mem.get("MemAvailable")
        if backend == "cuda":
            chip = str(info.get("device_name", chip))
            available = info.get("memory_size", available)
        spec = None
    os_name = f"{system} {platform.release()} ({platform.machine()})"
    if system == "Darwin" and mac_version():
        os_name = f"macOS {mac_version()} ({platform.machine()})"
    return Machine(
        chip=chip,
        gpu_cores=cores,
        memory_bytes=memory,
        available_bytes=available,
        backend=backend,
        os=os_name,
        spec=spec,
        slug=chip_slug(chip, cores, backend),
        power_source=power,
        device_info=info,
        low_power_mode=low_power,
        thermal=thermal,
        warnings=power_warnings(power, low_power, thermal),
    )


def native_python_problem(system: str, machine: str, translated: str) -> str | None:
    """Why this Python cannot run mac-moesd on a Mac, or None: MLX ships for arm64 macOS only,
    and ``sysctl.proc_translated`` is "1" in a process Rosetta 2 translates."""
    if system != "Darwin":
        return None
    if translated.strip() == "1":
        return ("mac-moesd needs a native arm64 Python: this one runs under Rosetta (x86_64); "
                "install an arm64 Python (e.g. from python.org or `brew` in /opt/homebrew) and reinstall")
    if machine == "x86_64":
        return ("mac-moesd needs a native arm64 Python on an Apple-silicon Mac: MLX does not run on "
                "Intel Macs or x86_64 Python")
    return None


def require_native_python() -> None:
    """Raise MacMoesdError on an Intel Mac or a Rosetta Python, before anything imports MLX."""
    system, machine = platform.system(), platform.machine()
    # an arm64 process is never translated: ask sysctl only about an x86_64 one
    translated = run_tool(["sysctl", "-n", "sysctl.proc_translated"]) if (system, machine) == ("Darwin", "x86_64") else ""
    problem = native_python_problem(system, machine, translated)
    if problem:
        raise MacMoesdError(problem)


# MLX keeps memory wired through Metal residency sets (MTLResidencySet), which macOS has from 15.0
# on; before that ``mx.set_wired_limit`` is accepted and does nothing (its docstring says so).
WIRED_FROM_MACOS = (15, 0)


def wired_limit_unavailable(backend: str, macos: str) -> str | None:
    """Why a wired limit would not take effect here (``macos`` as ``mac_version`` gives it, ""
    off macOS), or None where it does."""
    if backend != "metal":
        return f"no wired memory on the {backend} backend (Metal only)"
    parts = [int(p) for p in re.findall(r"\d+", macos)[:2]]
    if not parts:
        return "the macOS version could not be read, so the wired limit was left alone"
    if tuple(parts + [0])[:2] < WIRED_FROM_MACOS:
        return (f"macOS {macos} has no Metal residency sets (macOS 15 and later), "
                "so MLX cannot wire memory here")
    return None


@contextlib.contextmanager
def measuring_stage() -> Iterator[dict]:
    """Device state for one measuring stage, restored in ``finally``.

    Where a wired limit takes effect (Metal on macOS 15 or later) it is raised to the recommended
    working set for the stage, as mlx-lm's ``wired_limit`` does around generation, and the
    previous limit is restored after the stage's work is synchronised: the default stream's and
    mlx-lm's generation stream's (its decode loops run there), as mlx-lm synchronises the
    streams it was given, since changing the limit during an asynchronous evaluation is unsafe.
    The yielded dict is the stage's record: the limit set, or None with ``wired_limit_note``
    saying why none was.
    """
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    why = wired_limit_unavailable(mlx_backend(), mac_version())
    limit = None if why else mx.device_info().get("max_recommended_working_set_size")
    if limit is None:
        yield {"wired_limit_bytes": None,
               "wired_limit_note": why or "Metal reports no recommended working set"}
        return
    previous = mx.set_wired_limit(int(limit))  # device_info's values are typed str | int
    try:
        yield {"wired_limit_bytes": limit}
    finally:
        mx.synchronize()
        mx.synchronize(generation_stream)
        mx.set_wired_limit(previous)
