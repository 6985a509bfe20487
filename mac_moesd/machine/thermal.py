"""Thermal pressure on macOS, read as any process may read it, without root.

`pmset -g therm` prints the same "No ... recorded" lines on an Apple-silicon Mac that is
throttling, so the level comes from the ``com.apple.system.thermalpressurelevel`` notification
instead: libSystem's notify(3) API (<notify.h>) holds its current state, which
``notify_get_state`` returns after ``notify_register_check``. Anywhere else, or on any failure,
the level is None and ``Reading.reason`` says why.
"""

from __future__ import annotations

import ctypes
import platform
from dataclasses import dataclass

__all__ = ["LEVELS", "Reading", "read", "record", "throttled", "unread_warning", "warning"]

NOTIFICATION = b"com.apple.system.thermalpressurelevel"
LIBSYSTEM = "/usr/lib/libSystem.B.dylib"
NOTIFY_STATUS_OK = 0  # <notify.h>
# OSThermalPressureLevel on macOS, 0-4 in this order (Apple's <libkern/OSThermalNotification.h>;
# iOS numbers them 0, 10, ..., 50 instead).
LEVELS = ("nominal", "moderate", "heavy", "trapping", "sleeping")


@dataclass(frozen=True)
class Reading:
    """One reading: ``level`` (one of LEVELS) or None, with ``reason`` saying why not."""

    level: str | None
    reason: str | None = None


def load_libsystem():
    """libSystem through ctypes (tests replace this loader with a fake)."""
    return ctypes.CDLL(LIBSYSTEM)


def read() -> Reading:
    """The thermal pressure level now; never raises."""
    if platform.system() != "Darwin":
        return Reading(None, f"thermal pressure is published by macOS only, not {platform.system() or 'this OS'}")
    try:
        lib = load_libsystem()
        lib.notify_register_check.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int)]
        lib.notify_register_check.restype = ctypes.c_uint32
        lib.notify_get_state.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_uint64)]
        lib.notify_get_state.restype = ctypes.c_uint32
        lib.notify_cancel.argtypes = [ctypes.c_int]
        lib.notify_cancel.restype = ctypes.c_uint32
        token = ctypes.c_int(0)
        status = lib.notify_register_check(NOTIFICATION, ctypes.pointer(token))
        if status != NOTIFY_STATUS_OK:
            return Reading(None, f"notify_register_check returned status {status}")
        try:
            state = ctypes.c_uint64(0)
            status = lib.notify_get_state(token.value, ctypes.pointer(state))
        finally:
            lib.notify_cancel(token.value)
    except (OSError, AttributeError, TypeError, ValueError) as err:
        return Reading(None, f"cannot call libSystem's notify API: {err}")
    if status != NOTIFY_STATUS_OK:
        return Reading(None, f"notify_get_state returned status {status}")
    if state.value >= len(LEVELS):
        return Reading(None, f"unknown thermal pressure level {state.value}")
    return Reading(LEVELS[state.value])


def throttled(level: str | None) -> bool:
    """macOS throttles the chip from "moderate" pressure on."""
    return level is not None and LEVELS.index(level) >= LEVELS.index("moderate")


def record(before: Reading, after: Reading) -> dict | None:
    """A stage's ``thermal_pressure``: {before, after} levels, or None when neither was read."""
    if before.level is None and after.level is None:
        return None
    return {"before": before.level, "after": after.level}


def warning(stage: str, pressure: dict | None) -> str | None:
    """A warning, with advice, when ``stage`` started or ended throttled; else None."""
    if pressure is None or not any(throttled(pressure[k]) for k in ("before", "after")):
        return None
    return (f"{stage} ran under thermal pressure (before: {pressure['before'] or 'unknown'}, after: "
            f"{pressure['after'] or 'unknown'}): macOS slowed the chip, so its timings are below this "
            "Mac's best; let it cool (on a hard surface, plugged in) and rerun into a fresh --out folder")


def unread_warning(reading: Reading) -> str | None:
    """A warning when macOS did not tell its thermal pressure (elsewhere there is none to tell)."""
    if reading.level is not None or platform.system() != "Darwin":
        return None
    return f"thermal pressure could not be read ({reading.reason}): a throttled stage would go unnoticed"
