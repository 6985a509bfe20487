"""Which BLAS MLX's CPU backend calls, and loading OpenBLAS in its place on Linux.

MLX's Linux CPU wheel bundles the netlib reference BLAS (~2.5 GFLOP/s float32 matmul on one
core), which makes every forward compute-bound and hides the roofline. A BLAS loaded with
RTLD_GLOBAL *before* MLX is imported takes precedence for ``cblas_sgemm``; OpenBLAS gives ~40x.
This module must not import MLX: ``mac_moesd/__init__.py`` calls ``preload`` first.

Where from, in order: the system's OpenBLAS (``OPENBLAS_CANDIDATES``), then the OpenBLAS wheel
the package depends on on Linux (scipy-openblas32). The wheel's symbols carry a ``scipy_``
prefix, so the package's small C library ``_cblas_forward`` (built at install) is loaded after
it, globally too, to give MLX the unprefixed names.

How many threads: one core fewer than the process may run on, unless the environment says
(``THREAD_ENVS``). MLX's CPU backend computes a graph on its stream's thread while Python builds
the next one; OpenBLAS's workers on every core took turns with that Python on a 2-core box: the
SD loop ran slower than the same loop waiting after each phase, and plain runs timed against
themselves varied twice as much (docs/design.md §6).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
import platform
import sys

__all__ = ["OPT_OUT_ENV", "OPENBLAS_CANDIDATES", "THREAD_ENVS", "describe", "preload", "preloaded_libraries"]

OPT_OUT_ENV = "MAC_MOESD_NO_OPENBLAS"
# What OpenBLAS reads its thread count from at load, first found first; the first is what we set.
THREAD_ENVS: tuple[str, ...] = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")

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
_state: dict = {"libraries": [], "source": None, "skipped": None, "threads_from": None}


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


def _choose_threads() -> None:
    """Leave one core to Python's graph building, unless the environment already sets a count.

    Set in the environment before the library loads (OpenBLAS reads it then), so a server the suite
    launches with the same library preloaded runs with the same count.
    """
    named = next((name for name in THREAD_ENVS if os.environ.get(name)), None)
    if named is not None:
        _state["threads_from"] = f"{named} from the environment"
        return
    cores = len(os.sched_getaffinity(0))
    os.environ[THREAD_ENVS[0]] = str(max(1, cores - 1))
    _state["threads_from"] = f"one fewer than the {cores} cores, leaving one to Python"


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
        _choose_threads()
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


def _openblas_threads(path: str) -> int | None:
    """The threads the OpenBLAS at ``path`` (already loaded) runs with, or None where it does not say."""
    try:
        library = ctypes.CDLL(path)
    except OSError:
        return None
    for name in ("openblas_get_num_threads", "scipy_openblas_get_num_threads"):
        getter = getattr(library, name, None)
        if getter is not None:
            return int(getter())
    return None


def describe(backend: str) -> dict:
    """What BLAS the MLX CPU backend uses here: ``{"name", "path", "note", "warning", "threads"}``.

    On Linux MLX's bundled BLAS is local to libmlx, so a global ``cblas_sgemm`` exists only if
    another BLAS was loaded globally, and then it is the one MLX binds to (when that is the
    forwarding library, ``path`` is the OpenBLAS it forwards to and ``note`` says so). ``threads``
    is OpenBLAS's own count, None for any other BLAS.
    """
    system = platform.system()
    if system == "Darwin":
        name = "accelerate" if backend == "cpu" else "n/a (GPU backend)"
        return {"name": name, "path": None, "note": "", "warning": None, "threads": None}
    if system != "Linux":
        return {"name": "unknown", "path": None, "note": "", "warning": None, "threads": None}
    path = _global_sgemm_library()
    note = _state["skipped"] or ""
    if path is None:
        warning = None
        if backend == "cpu":
            warning = (
                "MLX is using its bundled reference BLAS: every forward is compute-bound and "
                f"memory-bound effects are invisible ({note or 'OpenBLAS was not loaded'}); rerun after."
            )
        return {"name": "reference", "path": None, "note": note, "warning": warning, "threads": None}
    if path in _state["libraries"]:  # ours: the OpenBLAS, or the library forwarding to it
        preloaded = _preloaded()
        assert preloaded is not None  # path is one of the libraries it loaded
        path, note = preloaded, f"loaded from {_state['source']}; threads: {_state['threads_from']}"
    name = "openblas" if "openblas" in path.lower() else os.path.basename(path)
    threads = _openblas_threads(path) if name == "openblas" else None
    return {"name": name, "path": path, "note": note, "warning": None, "threads": threads}
