"""Metadata recorded with every result: machine, backend, BLAS, versions, time, command line."""

from __future__ import annotations

import datetime as _dt
import platform
import sys
from importlib import metadata as _importlib_metadata

from mac_moesd import __version__
from mac_moesd.machine import blas, hardware


def package_version(name: str) -> str | None:
    try:
        return _importlib_metadata.version(name)
    except _importlib_metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    return {
        "mac_moesd": __version__,
        "python": platform.python_version(),
        "mlx": package_version("mlx"),
        "mlx_lm": package_version("mlx-lm"),
        "numpy": package_version("numpy"),
        "scipy": package_version("scipy"),
    }


def collect(machine: hardware.Machine | None = None) -> dict:
    """The ``meta`` block of a results file."""
    machine = machine or hardware.detect()
    return {
        "chip": machine.chip,
        "chip_slug": machine.slug,
        "gpu_cores": machine.gpu_cores,
        "memory_bytes": machine.memory_bytes,
        "backend": machine.backend,
        "blas": blas.describe(machine.backend),
        "os": machine.os,
        "power_source": machine.power_source,
        "low_power_mode": machine.low_power_mode,
        "thermal": machine.thermal,
        "warnings": machine.warnings,
        "versions": versions(),
        "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["mac-moesd", *sys.argv[1:]]),
    }
