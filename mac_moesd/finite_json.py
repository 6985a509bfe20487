"""JSON documents hold finite numbers only: NaN and infinity are not JSON (RFC 8259, section 6).

A figure that could not be computed (a CI of a zero median, a ratio over zero, a fit without
points) is written as null with the reason beside it: the dict that held it gains
``null_reasons: {key: reason}`` (list items are named ``key[i]``). Every writer of a results file
and every ``--json`` output passes through ``finite_document``.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["finite_document"]


def _reason(value: float) -> str:
    return f"not computable (came out {value!r})"


def _clean(value: Any, reasons: dict[str, str], key: str) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        reasons[key] = _reason(value)
        return None
    if isinstance(value, dict):
        return finite_document(value)
    if isinstance(value, (list, tuple)):
        return [_clean(item, reasons, f"{key}[{i}]") for i, item in enumerate(value)]
    return value


def finite_document(document: dict) -> dict:
    """A copy of ``document`` with every non-finite float replaced by None, and the reason
    recorded in ``null_reasons`` of the dict that held it. Finite documents come back equal."""
    reasons: dict[str, str] = dict(document.get("null_reasons") or {})
    out = {key: _clean(value, reasons, str(key)) for key, value in document.items() if key != "null_reasons"}
    if reasons:
        out["null_reasons"] = reasons
    return out
