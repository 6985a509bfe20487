"""Launching `mlx_lm.server` on loopback for the serving stage, and stopping it on every exit.

The server runs in a session of its own (``start_new_session``) so that stopping it signals its
whole process group; on Linux it also gets ``PR_SET_PDEATHSIG`` (prctl(2)), so the kernel sends
it SIGTERM if this process dies without a chance to clean up (SIGKILL, a crash). Its pid and
command line are written to ``serving-server.pid`` in the results folder while it runs: a later
run finds a server of its own left by a killed run (same pid, same command line) and stops it.

It is ready when ``/health`` answers 200 and a one-token completion comes back: mlx-lm starts
its HTTP server while the model still loads in a thread (mlx_lm/server.py, ``ResponseGenerator``),
and answers 503 once that thread has died (a model it cannot load). ``/v1/models`` is not used:
mlx-lm answers it by scanning the Hugging Face cache, which fails where there is none.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from mac_moesd.errors import BadInput, MacMoesdError
from mac_moesd.machine import blas

__all__ = ["HOST", "LaunchedServer", "ServerConfig", "free_port", "reap_stale", "served_folder",
           "sigterm_as_interrupt", "cpu_servable"]

HOST = "127.0.0.1"  # loopback only: the server has no authentication
PID_FILE = "serving-server.pid"
READY_TIMEOUT_S = 180.0
STOP_GRACE_S = 5.0
PR_SET_PDEATHSIG = 1  # linux/prctl.h
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def default_command() -> list[str]:
    """mlx-lm's server in this Python (``python -m mlx_lm server``, its non-deprecated form)."""
    return [sys.executable, "-m", "mlx_lm", "server"]


@dataclass(frozen=True)
class ServerConfig:
    """One launch of mlx_lm.server: ``name`` labels its legs and its log file."""

    name: str
    model: Path
    draft: Path | None = None
    gamma: int = 3
    decode_concurrency: int = 32
    prompt_concurrency: int = 8
    port: int | None = None  # None: a free port chosen at launch
    command: tuple[str, ...] = ()  # the server executable and leading arguments; () = default_command()
    ready_timeout_s: float = READY_TIMEOUT_S
    notes: dict = field(default_factory=dict)  # recorded with the server (e.g. a served copy)

    def argv(self, port: int) -> list[str]:
        args = [*(self.command or default_command()), "--model", str(self.model), "--host", HOST,
                "--port", str(port), "--decode-concurrency", str(self.decode_concurrency),
                "--prompt-concurrency", str(self.prompt_concurrency)]
        if self.draft is not None:
            args += ["--draft-model", str(self.draft), "--num-draft-tokens", str(self.gamma)]
        return args


def free_port() -> int:
    """A TCP port on loopback nobody listens on now (the server binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def served_folder(model: str) -> Path:
    """The folder mlx_lm.server is given for MODEL: a model folder with weights and a tokenizer,
    or a Hugging Face repo id already in the local cache. BadInput otherwise."""
    from mac_moesd.inputs import hfcache

    path = Path(model).expanduser()
    if not path.is_dir():
        cached = hfcache.cached_model(model) if "/" in model and not path.exists() else None
        if cached is None:
            raise BadInput(f"{model} is not a model folder nor a Hugging Face repo id in the local cache "
                           f"({hfcache.cache_root()}): a server needs the model's files")
        path = cached
    if not any(path.glob("model*.safetensors")):
        raise BadInput(f"{model} has no weights (no model*.safetensors): a server measurement needs "
                       "a trained model; random weights generate noise")
    if not any((path / name).exists() for name in TOKENIZER_FILES):
        raise BadInput(f"{model} has no tokenizer (tokenizer.json or tokenizer_config.json): "
                       "mlx_lm.server needs one")
    return path


def stored_dtypes(folder: Path) -> set[str]:
    """The dtypes of a folder's safetensors tensors, from their headers (8-byte length, then
    JSON: the safetensors format), without loading any weights."""
    dtypes = set()
    for file in folder.glob("model*.safetensors"):
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        dtypes |= {v["dtype"] for k, v in header.items() if k != "__metadata__"}
    return dtypes


def cpu_servable(folder: Path, copies: Path) -> tuple[Path, dict]:
    """``folder``, or on MLX's CPU backend a float32 copy of it under ``copies`` when its weights
    are stored in 16-bit floats: there the MoE layers' ``gather_mm`` runs float32 only, so
    mlx_lm.server would fail on the first request. Returns (folder to serve, note to record)."""
    half = stored_dtypes(folder) & {"F16", "BF16"}
    if not half:
        return folder, {}
    import shutil

    import mlx.core as mx

    dest = copies / f"{folder.name}-float32"
    stamp = {"source": str(folder.resolve()),
             "mtimes": sorted(p.stat().st_mtime for p in folder.glob("model*.safetensors"))}
    marker = dest / ".mac-moesd-copy.json"
    if not (marker.exists() and json.loads(marker.read_text()) == stamp):
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        for file in folder.iterdir():
            if file.is_file() and not file.name.startswith("model") and file.suffix != ".safetensors":
                shutil.copy(file, dest / file.name)
        for file in folder.glob("model*.safetensors"):
            # a .safetensors file loads as a dict; mlx's stub has no overload by format
            weights: dict[str, mx.array] = mx.load(str(file))  # type: ignore[assignment]
            mx.save_safetensors(str(dest / file.name),
                                {k: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v
                                 for k, v in weights.items()}, metadata={"format": "mlx"})
        index = folder / "model.safetensors.index.json"
        if index.exists():
            shutil.copy(index, dest / index.name)
        marker.write_text(json.dumps(stamp))
    return dest, {"served_copy": {"of": str(folder), "dtype": "float32", "stored": sorted(half),
                                  "why": "MLX's CPU backend runs the MoE gather_mm in float32 only"}}


def _parent_death_signal(parent: int):
    """The child's preexec: SIGTERM when this process dies (Linux), and exit at once if it
    already has (the prctl would then never fire)."""
    libc = ctypes.CDLL(None, use_errno=True)

    def arm() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return arm


def _child_env() -> dict[str, str]:
    """The server's environment: ours, unbuffered, and on Linux the OpenBLAS this process loaded
    (MLX's bundled reference BLAS would make the server ~40x slower than the suite's timings)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    loaded = blas.preloaded_libraries()
    if platform.system() == "Linux" and loaded:
        env["LD_PRELOAD"] = " ".join(p for p in (env.get("LD_PRELOAD"), *loaded) if p)
    return env


def _cmdline(pid: int) -> list[str] | None:
    """The command line of a live process, or None when it is gone."""
    proc = Path(f"/proc/{pid}/cmdline")
    if proc.exists():
        try:
            return [a for a in proc.read_bytes().decode(errors="replace").split("\0") if a]
        except OSError:
            return None
    try:
        out = subprocess.run(["ps", "-o", "command=", "-p", str(pid)], capture_output=True, text=True,
                             timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.split() if out.returncode == 0 and out.stdout.strip() else None


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie its parent has not reaped yet has)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def reap_stale(folder: Path) -> str | None:
    """Stop a server an earlier run left in ``folder`` (its pid file names a live process with the
    recorded command line); returns what was done, or None when nothing was left."""
    path = Path(folder) / PID_FILE
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
        pid, command = int(record["pid"]), list(record["command"])
    except (OSError, ValueError, KeyError, TypeError):
        path.unlink(missing_ok=True)
        return f"removed an unreadable {path}"
    live = _cmdline(pid)
    if live is None or live != command:
        path.unlink(missing_ok=True)
        return None
    _signal_group(pid, signal.SIGTERM)  # pid is the group's leader (start_new_session)
    deadline = time.monotonic() + STOP_GRACE_S
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if not _gone(pid):
        _signal_group(pid, signal.SIGKILL)
    path.unlink(missing_ok=True)
    return f"stopped mlx_lm.server pid {pid} left running by an earlier, interrupted run in {folder}"


@contextlib.contextmanager
def sigterm_as_interrupt():
    """While inside, SIGTERM raises KeyboardInterrupt (in the main thread), so ``finally`` blocks
    run and the launched server is stopped as on Ctrl-C."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class LaunchedServer:
    """A running mlx_lm.server: ``with LaunchedServer(cfg, folder) as server: server.url``.
    Leaving the block (normally, by an exception, Ctrl-C) stops it and its children."""

    def __init__(self, cfg: ServerConfig, folder: Path):
        self.cfg = cfg
        self.folder = Path(folder)
        self.log_path = self.folder / f"serving-{cfg.name}.log"
        self.pid_path = self.folder / PID_FILE
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self.argv: list[str] = []

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def __enter__(self) -> LaunchedServer:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def failure(self, what: str) -> MacMoesdError:
        return MacMoesdError(f"mlx_lm.server ({self.cfg.name}) {what}; its output is in {self.log_path}"
                             + (f" (last line: {self.last_log_line()})" if self.last_log_line() else ""))

    def last_log_line(self) -> str:
        try:
            lines = [ln.strip() for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return ""
        errors = [ln for ln in lines if "error" in ln.lower()]
        return (errors or lines or [""])[-1][:300]

    def start(self) -> None:
        if self.cfg.command == () and importlib.util.find_spec("mlx_lm") is None:
            raise MacMoesdError("mlx_lm.server is not installed in this Python (pip install mlx-lm)")
        self.port = self.cfg.port or free_port()
        self.argv = self.cfg.argv(self.port)
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:
            try:
                self.proc = subprocess.Popen(
                    self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    env=_child_env(), start_new_session=True,
                    preexec_fn=_parent_death_signal(os.getpid()) if platform.system() == "Linux" else None)
            except OSError as err:
                log.write(f"cannot start {' '.join(self.argv)}: {err}\n")
                raise self.failure(f"could not be started ({err.strerror or err})") from None
        # The kernel's view of the command line, to recognise this server from a later run.
        self.pid_path.write_text(json.dumps({"pid": self.proc.pid, "command": self.argv, "port": self.port}))
        self.wait_ready()

    def wait_ready(self) -> None:
        """Until /health answers and a one-token completion returns, or the timeout; a server
        that exits or reports its model thread dead fails at once."""
        assert self.proc is not None, "wait_ready runs after start"
        deadline = time.monotonic() + self.cfg.ready_timeout_s
        with httpx.Client(base_url=self.url, timeout=1.0) as client:
            while True:
                if self.proc.poll() is not None:
                    raise self.failure(f"exited with status {self.proc.returncode} before answering")
                if time.monotonic() > deadline:
                    raise self.failure(f"did not answer within {self.cfg.ready_timeout_s:.0f} s")
                try:
                    health = client.get("/health")
                except httpx.TransportError:
                    time.sleep(0.2)
                    continue
                if health.status_code == 503:
                    raise self.failure("could not load its model")
                if health.status_code == 200:
                    break
                time.sleep(0.2)
            try:  # waits for the model to finish loading
                probe = client.post("/v1/chat/completions", timeout=max(deadline - time.monotonic(), 1.0),
                                    json={"messages": [{"role": "user", "content": "Hello"}],
                                          "max_tokens": 1, "temperature": 0.0})
            except httpx.TransportError as err:
                raise self.failure(f"did not complete a first request ({type(err).__name__})") from None
            if probe.status_code != 200:
                raise self.failure(f"answered a first request with HTTP {probe.status_code}")

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after a grace period; idempotent."""
        if self.proc is None:
            return
        _signal_group(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            _signal_group(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        _signal_group(self.proc.pid, signal.SIGKILL)  # a child that outlived its leader
        self.pid_path.unlink(missing_ok=True)

    def describe(self) -> dict:
        """The server as the results record it."""
        from mac_moesd.machine import metadata

        return {"name": self.cfg.name, "kind": "mlx_lm.server", "version": metadata.package_version("mlx-lm"),
                "url": self.url, "launched": True, "args": self.argv[len(self.cfg.command or default_command()):],
                "pid": self.proc.pid if self.proc else None, "log": str(self.log_path),
                "draft": str(self.cfg.draft) if self.cfg.draft else None,
                "gamma": self.cfg.gamma if self.cfg.draft else None,
                "decode_concurrency": self.cfg.decode_concurrency,
                "prompt_concurrency": self.cfg.prompt_concurrency, **self.cfg.notes}
