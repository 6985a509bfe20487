"""How the report writes a number: every section formats its figures with these, and a figure
that is missing (None) is written "-"."""

from __future__ import annotations

__all__ = ["f2", "ms", "num", "pct", "seconds"]


def num(value: float | None, spec: str) -> str:
    """``value`` in the format ``spec`` (as ``format`` takes it), "-" for None."""
    return "-" if value is None else format(value, spec)


def f2(value: float | None) -> str:
    """Two decimals: speedups, ratios, acceptances."""
    return num(value, ".2f")


def pct(value: float | None) -> str:
    """A share as a percentage with one decimal."""
    return num(value, ".1%")


def ms(value_s: float | None) -> str:
    """Seconds written as milliseconds with one decimal (no unit: the column's header has it)."""
    return "-" if value_s is None else f"{value_s * 1e3:.1f}"


def seconds(value: float) -> str:
    """Seconds as s, ms or us with three significant digits."""
    if value >= 1:
        return f"{value:.3g} s"
    if value >= 1e-3:
        return f"{value * 1e3:.3g} ms"
    return f"{value * 1e6:.3g} us"
