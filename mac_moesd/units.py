"""Sizes in bytes for people to read: the one place bytes become "1.5 GiB" or "300 MiB".

Data files keep raw bytes; messages, tables and reports format them here.
"""

from __future__ import annotations

__all__ = ["GiB", "MiB", "gib", "human_bytes"]

MiB = 2**20
GiB = 2**30


def human_bytes(nbytes: float, places: int = 1) -> str:
    """GiB from 1 GiB up with ``places`` decimals, MiB below with one fewer, so that a small size
    never reads '0.0 GiB' (nor a refusal '0.1 needs 0.1')."""
    if nbytes >= GiB:
        return f"{nbytes / GiB:.{places}f} GiB"
    return f"{nbytes / MiB:.{max(places - 1, 0)}f} MiB"


def gib(nbytes: float | None) -> str:
    """Always in GiB, one decimal (columns of sizes read alike); "n/a" for an unknown size."""
    return "n/a" if nbytes is None else f"{nbytes / GiB:.1f} GiB"
