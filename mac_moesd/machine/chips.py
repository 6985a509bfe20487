"""Every Apple chip tier's published figures (bandwidth, FP32 FLOPS, GPU cores), with sources.

Hardware as data: one entry per chip tier in SI units, the source cited beside each entry; how a
figure Apple did not print was obtained is said in the entry's ``derived``. The probing code that
finds which chip this is lives in ``hardware``.
"""

from __future__ import annotations

from mac_moesd.results import schema

__all__ = ["APPLE_CHIPS", "lookup_spec"]


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
# "up to" 20-core GPU and 307GB/s (M5 Pro), 40-core GPU and 614GB/s (M5 Max), March 2026; binned
# tiers are not on this page, so they are not in the table (their lookup finds no spec).
_M5_PRO_MAX = (
    "https://www.apple.com/newsroom/2026/03/"
    "apple-debuts-m5-pro-and-m5-max-to-supercharge-the-most-demanding-pro-workflows/"
)
# M1's bandwidth is not in Apple's release: LPDDR4X-4266 on a 128-bit bus (AnandTech, "The 2020
# Mac Mini Unleashed", Nov 2020) gives 4266e6 * 16 B = 68.25 GB/s.
_M1_BW = _M1 + "; bandwidth from LPDDR4X-4266 x 128-bit (AnandTech M1 review)"
# Apple's newsroom releases state FP32 TFLOPS for M1 only (2.6); the M1 Pro/Max/Ultra and M2
# figures are from Apple's launch presentations, and the M2 Pro/Max/Ultra ones are derived from the
# core count, so those entries say so in ``derived``. M3, M4 and M5 tiers carry None.
_EVENT = "FP32 TFLOPS from Apple's launch presentation; the newsroom release states cores and bandwidth only"
_M2_DERIVED = ("FP32 TFLOPS derived from the core count (cores x 128 FP32 lanes x 2 FLOP x ~1.4 GHz), "
               "not stated by Apple; the release states cores and bandwidth only")
_TIER = "this core count is from the Mac's tech specs; the release states the full tier"


def _spec(name: str, cores: int, gbs: float, tflops: float | None, source: str, derived: str = "") -> schema.ChipSpec:
    """One chip tier's published figures in SI units (bytes/s, FLOP/s); ``derived`` says how a
    figure Apple did not print was obtained from one it did. Its spec ridge point is peak FP32
    FLOP/s over memory bandwidth (None where Apple published no FP32 figure)."""
    flops = None if tflops is None else tflops * _TFLOPS
    return {"name": name, "gpu_cores": cores, "bandwidth_bytes_s": gbs * _GB, "fp32_flops": flops,
            "source": source, "derived": derived,
            "ridge_flop_per_byte": None if flops is None else flops / (gbs * _GB)}


APPLE_CHIPS: tuple[schema.ChipSpec, ...] = (
    _spec("Apple M1", 8, 68.25, 2.6, _M1_BW),
    _spec("Apple M1", 7, 68.25, 2.6 * 7 / 8, _M1_BW, _SCALED),
    _spec("Apple M1 Pro", 16, 200, 5.2, _M1_PRO_MAX, _EVENT),
    _spec("Apple M1 Pro", 14, 200, 5.2 * 14 / 16, _M1_PRO_MAX, f"{_SCALED}; {_EVENT}; {_TIER}"),
    _spec("Apple M1 Max", 32, 400, 10.4, _M1_PRO_MAX, _EVENT),
    _spec("Apple M1 Max", 24, 400, 10.4 * 24 / 32, _M1_PRO_MAX, f"{_SCALED}; {_EVENT}; {_TIER}"),
    _spec("Apple M1 Ultra", 64, 800, 21.0, _M1_ULTRA, _EVENT),
    _spec("Apple M1 Ultra", 48, 800, 21.0 * 48 / 64, _M1_ULTRA, f"{_SCALED}; {_EVENT}; {_TIER}"),
    _spec("Apple M2", 10, 100, 3.6, _M2, _EVENT),
    _spec("Apple M2", 8, 100, 3.6 * 8 / 10, _M2, f"{_SCALED}; {_EVENT}; {_TIER}"),
    _spec("Apple M2 Pro", 19, 200, 6.8, _M2_PRO_MAX, _M2_DERIVED),
    _spec("Apple M2 Pro", 16, 200, 6.8 * 16 / 19, _M2_PRO_MAX, f"{_SCALED}; {_M2_DERIVED}; {_TIER}"),
    _spec("Apple M2 Max", 38, 400, 13.6, _M2_PRO_MAX, _M2_DERIVED),
    _spec("Apple M2 Max", 30, 400, 13.6 * 30 / 38, _M2_PRO_MAX, f"{_SCALED}; {_M2_DERIVED}; {_TIER}"),
    _spec("Apple M2 Ultra", 76, 800, 27.2, _M2_ULTRA, _M2_DERIVED),
    _spec("Apple M2 Ultra", 60, 800, 27.2 * 60 / 76, _M2_ULTRA, f"{_SCALED}; {_M2_DERIVED}; {_TIER}"),
    _spec("Apple M3", 10, 100, None, _M3),
    _spec("Apple M3", 8, 100, None, _M3),
    _spec("Apple M3 Pro", 18, 150, None, _M3),
    _spec("Apple M3 Pro", 14, 150, None, _M3),
    _spec("Apple M3 Max", 40, 400, None, _M3),
    _spec("Apple M3 Max", 30, 300, None, _M3),  # binned M3 Max: narrower memory bus
    _spec("Apple M3 Ultra", 80, 819, None, _M3_ULTRA),
    _spec("Apple M3 Ultra", 60, 819, None, _M3_ULTRA, _TIER),
    _spec("Apple M4", 10, 120, None, _M4),
    _spec("Apple M4", 8, 120, None, _M4, _TIER),
    _spec("Apple M4 Pro", 20, 273, None, _M4_PRO_MAX),
    _spec("Apple M4 Pro", 16, 273, None, _M4_PRO_MAX),
    _spec("Apple M4 Max", 40, 546, None, _M4_PRO_MAX),
    _spec("Apple M4 Max", 32, 410, None, _M4_PRO_MAX),  # binned M4 Max: narrower memory bus
    _spec("Apple M5", 10, 153, None, _M5),
    _spec("Apple M5 Pro", 20, 307, None, _M5_PRO_MAX),
    _spec("Apple M5 Max", 40, 614, None, _M5_PRO_MAX),
)


def lookup_spec(chip: str, gpu_cores: int | None) -> schema.ChipSpec | None:
    """The table entry for a chip name and core count; the full-core tier when cores are unknown.
    A copy: the caller may store it in a document without sharing the table's own record."""
    tiers = [c for c in APPLE_CHIPS if c["name"].lower() == chip.strip().lower()]
    if not tiers:
        return None
    if gpu_cores is None:
        return schema.ChipSpec(**max(tiers, key=lambda c: c["gpu_cores"]))
    found = next((c for c in tiers if c["gpu_cores"] == gpu_cores), None)
    return None if found is None else schema.ChipSpec(**found)
