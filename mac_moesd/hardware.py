"""What machine this is: chip, GPU cores, memory, MLX backend, and the chip's published specs.

Only this module and ``kernels.py`` know about Metal. The parsers take command output as text so
they are tested on recorded samples; the ``detect`` function runs the commands.
"""

from __future__ import annotations

import json
import platform
import re
import subprocess
from dataclasses import asdict, dataclass

__all__ = ["APPLE_CHIPS", "ChipSpec", "Machine", "chip_slug", "detect", "lookup_spec"]


@dataclass(frozen=True)
class ChipSpec:
    """Published figures for one Apple chip tier (SI units: bytes/s and FLOP/s)."""

    name: str
    gpu_cores: int
    bandwidth_bytes_s: float
    fp32_flops: float | None  # None where Apple published no figure
    source: str
    derived: str = ""  # how a figure not printed by Apple was obtained from one that was

    @property
    def ridge_flop_per_byte(self) -> float | None:
        """Spec ridge point: peak FP32 FLOP/s over memory bandwidth."""
        return None if self.fp32_flops is None else self.fp32_flops / self.bandwidth_bytes_s


_GB = 1e9
_TFLOPS = 1e12
_SCALED = "FP32 TFLOPS scaled from the full-core figure by GPU core count"

_M1 = "https://www.apple.com/newsroom/2020/11/apple-unleashes-m1/"
_M1_PRO_MAX = (
    "https://www.apple.com/newsroom/2021/10/"
    "introducing-m1-pro-and-m1-max-the-most-powerful-chips-apple-has-ever-built/"
)
_M1_ULTRA = (
    "https://www.apple.com/newsroom/2022/03/"
    "apple-unveils-m1-ultra-the-worlds-most-powerful-chip-for-a-personal-computer/"
)
_M2 = "https://www.apple.com/newsroom/2022/06/apple-unveils-m2-with-breakthrough-performance-and-capabilities/"
_M2_PRO_MAX = (
    "https://www.apple.com/newsroom/2023/01/"
    "apple-unveils-m2-pro-and-m2-max-next-generation-chips-for-next-level-workflows/"
)
_M2_ULTRA = "https://www.apple.com/newsroom/2023/06/apple-introduces-m2-ultra/"
_M3 = (
    "https://www.apple.com/newsroom/2023/10/"
    "apple-unveils-m3-m3-pro-and-m3-max-the-most-advanced-chips-for-a-personal-computer/"
    " and the MacBook Pro (Nov 2023) tech specs"
)
_M3_ULTRA = "https://www.apple.com/newsroom/2025/03/apple-reveals-m3-ultra-taking-apple-silicon-to-a-new-extreme/"
_M4 = "https://www.apple.com/newsroom/2024/05/apple-introduces-m4-chip/"
_M4_PRO_MAX = (
    "https://www.apple.com/newsroom/2024/10/apple-introduces-m4-pro-and-m4-max/"
    " and the MacBook Pro (Nov 2024) tech specs"
)
_M5 = "https://www.apple.com/newsroom/2025/10/apple-unleashes-m5-the-next-big-leap-in-ai-performance-for-apple-silicon/"
# M1's bandwidth is not in Apple's release: LPDDR4X-4266 on a 128-bit bus (AnandTech, "The 2020
# Mac Mini Unleashed", Nov 2020) gives 4266e6 * 16 B = 68.25 GB/s.
_M1_BW = _M1 + "; bandwidth from LPDDR4X-4266 x 128-bit (AnandTech M1 review)"
# Apple published FP32 TFLOPS for M1 and M2 tiers only; M3, M4 and M5 tiers carry None.


def _spec(name, cores, gbs, tflops, source, derived=""):
    flops = None if tflops is None else tflops * _TFLOPS
    return ChipSpec(name, cores, gbs * _GB, flops, source, derived)


APPLE_CHIPS: tuple[ChipSpec, ...] = (
    _spec("Apple M1", 8, 68.25, 2.6, _M1_BW),
    _spec("Apple M1", 7, 68.25, 2.6 * 7 / 8, _M1_BW, _SCALED),
    _spec("Apple M1 Pro", 16, 200, 5.2, _M1_PRO_MAX),
    _spec("Apple M1 Pro", 14, 200, 5.2 * 14 / 16, _M1_PRO_MAX, _SCALED),
    _spec("Apple M1 Max", 32, 400, 10.4, _M1_PRO_MAX),
    _spec("Apple M1 Max", 24, 400, 10.4 * 24 / 32, _M1_PRO_MAX, _SCALED),
    _spec("Apple M1 Ultra", 64, 800, 21.0, _M1_ULTRA),
    _spec("Apple M1 Ultra", 48, 800, 21.0 * 48 / 64, _M1_ULTRA, _SCALED),
    _spec("Apple M2", 10, 100, 3.6, _M2),
    _spec("Apple M2", 8, 100, 3.6 * 8 / 10, _M2, _SCALED),
    _spec("Apple M2 Pro", 19, 200, 6.8, _M2_PRO_MAX),
    _spec("Apple M2 Pro", 16, 200, 6.8 * 16 / 19, _M2_PRO_MAX, _SCALED),
    _spec("Apple M2 Max", 38, 400, 13.6, _M2_PRO_MAX),
    _spec("Apple M2 Max", 30, 400, 13.6 * 30 / 38, _M2_PRO_MAX, _SCALED),
    _spec("Apple M2 Ultra", 76, 800, 27.2, _M2_ULTRA),
    _spec("Apple M2 Ultra", 60, 800, 27.2 * 60 / 76, _M2_ULTRA, _SCALED),
    _spec("Apple M3", 10, 100, None, _M3),
    _spec("Apple M3", 8, 100, None, _M3),
    _spec("Apple M3 Pro", 18, 150, None, _M3),
    _spec("Apple M3 Pro", 14, 150, None, _M3),
    _spec("Apple M3 Max", 40, 400, None, _M3),
    _spec("Apple M3 Max", 30, 300, None, _M3),  # binned M3 Max: narrower memory bus
    _spec("Apple M3 Ultra", 80, 819, None, _M3_ULTRA),
    _spec("Apple M3 Ultra", 60, 819, None, _M3_ULTRA),
    _spec("Apple M4", 10, 120, None, _M4),
    _spec("Apple M4", 8, 120, None, _M4),
    _spec("Apple M4 Pro", 20, 273, None, _M4_PRO_MAX),
    _spec("Apple M4 Pro", 16, 273, None, _M4_PRO_MAX),
    _spec("Apple M4 Max", 40, 546, None, _M4_PRO_MAX),
    _spec("Apple M4 Max", 32, 410, None, _M4_PRO_MAX),  # binned M4 Max: narrower memory bus
    _spec("Apple M5", 10, 153, None, _M5),
)


def lookup_spec(chip: str, gpu_cores: int | None) -> ChipSpec | None:
    """The table entry for a chip name and core count; the full-core tier when cores are unknown."""
    tiers = [c for c in APPLE_CHIPS if c.name.lower() == chip.strip().lower()]
    if not tiers:
        return None
    if gpu_cores is None:
        return max(tiers, key=lambda c: c.gpu_cores)
    return next((c for c in tiers if c.gpu_cores == gpu_cores), None)


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


def _run(args: list[str]) -> str:
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout


def _read(path: str) -> str:
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
    spec: ChipSpec | None
    slug: str
    power_source: str | None
    device_info: dict

    def to_dict(self) -> dict:
        out = asdict(self)
        if self.spec is not None:
            out["spec"]["ridge_flop_per_byte"] = self.spec.ridge_flop_per_byte
        return out


def mlx_backend() -> str:
    import mlx.core as mx

    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return "cpu"


def _mlx_device_info() -> dict:
    import mlx.core as mx

    try:
        info = mx.device_info()
    except Exception:  # older MLX or a backend without the query
        return {}
    return {k: (v if isinstance(v, (int, float, str)) else str(v)) for k, v in info.items()}


def detect() -> Machine:
    """Detect this machine. On macOS: chip, GPU cores, memory, working set; elsewhere: CPU, RAM."""
    backend = mlx_backend()
    info = _mlx_device_info()
    system = platform.system()
    power = None
    if system == "Darwin":
        chip = _run(["sysctl", "-n", "machdep.cpu.brand_string"]).strip() or platform.processor()
        cores = parse_gpu_cores_system_profiler(
            _run(["system_profiler", "SPDisplaysDataType", "-json"])
        ) or parse_gpu_cores_ioreg(_run(["ioreg", "-rc", "AGXAccelerator", "-d", "1"]))
        memsize = _run(["sysctl", "-n", "hw.memsize"]).strip()
        memory = int(memsize) if memsize.isdigit() else info.get("memory_size")
        available = info.get("max_recommended_working_set_size") or memory
        power = parse_power_source(_run(["pmset", "-g", "batt"]))
        spec = lookup_spec(chip, cores)
    else:
        chip = parse_cpuinfo_model(_read("/proc/cpuinfo")) or platform.processor() or "unknown"
        cores = None
        mem = parse_meminfo(_read("/proc/meminfo"))
        memory = mem.get("MemTotal")
        available = mem.get("MemAvailable")
        if backend == "cuda":
            chip = str(info.get("device_name", chip))
            available = info.get("memory_size", available)
        spec = None
    os_name = f"{system} {platform.release()} ({platform.machine()})"
    if system == "Darwin" and platform.mac_ver()[0]:
        os_name = f"macOS {platform.mac_ver()[0]} ({platform.machine()})"
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
    )
