"""Which BLAS MLX's CPU backend calls, and loading OpenBLAS in its place on Linux.

MLX's Linux CPU wheel bundles the netlib reference BLAS (~2.5 GFLOP/s float32 matmul on one
core), which makes every forward compute-bound and hides the roofline. A BLAS loaded with
RTLD_GLOBAL *before* MLX is imported takes precedence for ``cblas_sgemm``; OpenBLAS gives ~40x.
This module must not import MLX: ``mac_moesd/__init__.py`` calls ``preload`` first.

Where from, in order: the system's OpenBLAS (``OPENBLAS_CANDIDATES``), then the OpenBLAS wheel
the package depends on on Linux (scipy-openblas32). The wheel's symbols carry a ``scipy_``
prefix, so the package's small C library ``_cblas_forward`` (built at install) is loaded after
it, globally too, to give MLX the unprefixed names.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
import platform
import sys

__all__ = ["OPT_OUT_ENV", "OPENBLAS_CANDIDATES", "describe", "preload", "preloaded_libraries"]

OPT_OUT_ENV = "MAC_MOESD_NO_OPENBLAS"

# Debian/Ubuntu's libopenblas0-pthread, then the other common layouts.
OPENBLAS_CANDIDATES: tuple[str, ...] = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

WHEEL = "scipy-openblas32"
FORWARD_MODULE = "mac_moesd.machine._cblas_forward"

# What ``preload`` did: the libraries it loaded, in order (the OpenBLAS first), where they came
# from, or why it loaded none.
_state: dict = {"libraries": [], "source": None, "skipped": None}


def _preloaded() -> str | None:
    """The OpenBLAS ``preload`` loaded, or None."""
    return _state["libraries"][0] if _state["libraries"] else None


def _wheel_openblas() -> tuple[str, str] | None:
    """(the wheel's OpenBLAS, the forwarding library) where both are installed, else None."""
    try:
        import scipy_openblas32  # type: ignore[import-untyped]  # the wheel ships no type information
    except ImportError:
        return None
    library = os.path.join(scipy_openblas32.get_lib_dir(), scipy_openblas32.get_library(fullname=True))
    forward = importlib.util.find_spec(FORWARD_MODULE)
    if forward is None or not forward.origin or not os.path.exists(library):
        return None
    return library, forward.origin


def _load_wheel() -> bool:
    """Load the wheel's OpenBLAS, then the forwarding library, both globally; whether both loaded."""
    found = _wheel_openblas()
    if found is None:
        return False
    library, forward = found
    try:
        ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)
        ctypes.CDLL(forward, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return False
    _state["source"] = f"the {WHEEL} wheel, through {os.path.basename(forward)}"
    _state["libraries"] = [library, forward]
    return True


def preload() -> str | None:
    """Load OpenBLAS globally if on Linux, installed, not opted out and MLX not yet imported.

    Returns the loaded path, or None (the reason is kept for ``describe``).
    """
    if _preloaded() or _state["skipped"]:
        return _preloaded()
    if platform.system() != "Linux":
        _state["skipped"] = "not Linux"
    elif os.environ.get(OPT_OUT_ENV, "") not in ("", "0"):
        _state["skipped"] = f"{OPT_OUT_ENV} is set"
    elif "mlx.core" in sys.modules:
        _state["skipped"] = "mlx was imported before mac_moesd"
    else:
        for path in OPENBLAS_CANDIDATES:
            if os.path.exists(path):
                try:
                    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                except OSError:
                    continue
                _state["source"], _state["libraries"] = "the system", [path]
                return path
        if not _load_wheel():
            _state["skipped"] = (f"no OpenBLAS found: reinstall mac-moesd where a C compiler is present "
                                 f"(it builds {FORWARD_MODULE.rsplit('.', 1)[1]} for the {WHEEL} wheel), "
                                 "or install the system's (Debian: apt-get install libopenblas0-pthread)")
    return _preloaded()


def preloaded_libraries() -> list[str]:
    """The libraries ``preload`` loaded, in order: what a child process (a server the suite
    launches) needs in its LD_PRELOAD to call the same BLAS."""
    return list(_state["libraries"])


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _global_sgemm_library() -> str | None:
    """The file that provides ``cblas_sgemm`` in the process's global symbol scope, if any."""
    try:
        symbol = ctypes.CDLL(None).cblas_sgemm
    except AttributeError:
        return None
    libdl_name = ctypes.util.find_library("dl") or "libdl.so.2"
    try:
        dladdr = ctypes.CDLL(libdl_name).dladdr
    except (OSError, AttributeError):
        return "unknown"
    info = _DlInfo()
    address = ctypes.cast(symbol, ctypes.c_void_p)
    if not dladdr(address, ctypes.byref(info)) or not info.dli_fname:
        return "unknown"
    return info.dli_fname.decode(errors="replace")


def describe(backend: str) -> dict:
    """What BLAS the MLX CPU backend uses here: ``{"name", "path", "note", "warning"}``.

    On Linux MLX's bundled BLAS is local to libmlx, so a global ``cblas_sgemm`` exists only if
    another BLAS was loaded globally, and then it is the one MLX binds to (when that is the
    forwarding library, ``path`` is the OpenBLAS it forwards to and ``note`` says so).
    """
    system = platform.system()
    if system == "Darwin":
        name = "accelerate" if backend == "cpu" else "n/a (GPU backend)"
        return {"name": name, "path": None, "note": "", "warning": None}
    if system != "Linux":
        return {"name": "unknown", "path": None, "note": "", "warning": None}
    path = _global_sgemm_library()
    note = _state["skipped"] or ""
    if path is None:
        warning = None
        if backend == "cpu":
            warning = (
                "MLX is using its bundled reference BLAS: every forward is compute-bound and "
                f"memory-bound effects are invisible ({note or 'OpenBLAS was not loaded'}); rerun after."
            )
        return {"name": "reference", "path": None, "note": note, "warning": warning}
    if path in _state["libraries"]:  # ours: the OpenBLAS, or the library forwarding to it
        preloaded = _preloaded()
        assert preloaded is not None  # path is one of the libraries it loaded
        path, note = preloaded, f"loaded from {_state['source']}"
    name = "openblas" if "openblas" in path.lower() else os.path.basename(path)
    return {"name": name, "path": path, "note": note, "warning": None}
