"""The results file on disk: read (older schemas brought to today's), written atomically after
every finished point, resumed, and refused when it is not this machine's.

Rerunning the same command resumes: points already present under the same key are skipped. A file
that is corrupt, of an unknown schema, or measured on another machine or MLX version is reported
and left untouched. What the documents inside hold is ``schema``'s.

One process writes a results file at a time: a command holds the file's writer's lock
(``WriterLock``) while it has the file open, so a second command pointed at the same file (another
terminal, the same default folder) stops at once with a clear error instead of each overwriting
the other's points with its own copy of the file.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import tempfile
import weakref
from pathlib import Path
from typing import Any, Mapping

from mac_moesd.errors import MacMoesdError
from mac_moesd.finite_json import finite_document
from mac_moesd.results import schema, validate
from mac_moesd.results.schema import READS, SCHEMA, upgrade

__all__ = ["ResultsBusy", "ResultsStore", "WriterLock", "ensure_writable", "incompatibility", "load_results",
           "write_atomic"]

# Meta fields that must match for measurements to share one file.
COMPATIBLE_KEYS = ("chip_slug", "backend")
COMPATIBLE_VERSIONS = ("mlx",)


def load_results(path: Path) -> dict:
    """Read and validate a results file, in today's schema whatever schema of ``READS`` it was
    written in; raise MacMoesdError saying what is wrong."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise MacMoesdError(f"results file not found: {path}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise MacMoesdError(
            f"{path} is corrupt (not valid JSON: {err}); it was left untouched"
        ) from None
    if not isinstance(data, dict) or "schema" not in data:
        raise MacMoesdError(f"{path} is not a mac-moesd results file; it was left untouched")
    if data["schema"] not in READS:
        raise MacMoesdError(
            f"{path} has schema {data['schema']!r}, this version reads {' and '.join(map(repr, READS))}; "
            "it was left untouched"
        )
    data = upgrade(data)
    problem = validate.first_problem(data)
    if problem:
        raise MacMoesdError(f"{path} does not hold what a results file holds ({problem.lstrip('.')}); "
                            "it was left untouched")
    return data


class ResultsBusy(MacMoesdError):
    """Another process holds the results file's writer's lock; ``holder`` says which, if known."""

    def __init__(self, path: Path, holder: str):
        self.holder = holder
        super().__init__(f"{path} is being written by another mac-moesd process"
                         + (f" ({holder})" if holder else "")
                         + "; wait for it to finish, or write elsewhere with --out")


class WriterLock:
    """The writer's lock of one results file: an exclusive ``flock`` on a hidden file beside it.
    The kernel releases it however the process ends, so a killed run leaves nothing stale behind.
    Takes within one process are counted (a command that opens its file twice, tests that run
    commands in process), and the lock is let go when the last taker releases it."""

    _held: dict[Path, list[int]] = {}  # file -> [descriptor, takers]

    @classmethod
    def take(cls, path: Path) -> Path:
        """Take the lock of ``path`` (ResultsBusy if another process holds it); returns the key
        to ``release`` it with."""
        key = Path(path).resolve()
        if key in cls._held:
            cls._held[key][1] += 1
            return key
        try:
            fd = os.open(key.with_name(f".{key.name}.lock"), os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as err:
            raise MacMoesdError(f"cannot write beside {path}: {err.strerror or err}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 4096).decode(errors="replace").strip()
            os.close(fd)
            raise ResultsBusy(path, holder) from None
        except OSError:  # a filesystem without locks (some network mounts): written unlocked
            os.close(fd)
            cls._held[key] = [-1, 1]
            return key
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()}: {' '.join(sys.argv[1:]) or sys.argv[0]}".encode())
        cls._held[key] = [fd, 1]
        return key

    @classmethod
    def release(cls, key: Path) -> None:
        held = cls._held.get(key)
        if held is None:
            return
        held[1] -= 1
        if held[1] == 0:
            del cls._held[key]
            if held[0] >= 0:
                os.close(held[0])  # closing the descriptor lets the flock go


def ensure_writable(folder: Path) -> None:
    """Create ``folder`` if needed and check a file can be written there, before any measuring."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise MacMoesdError(f"cannot write results to {folder}: {err.strerror or err}") from None


def write_atomic(path: Path, document: dict) -> None:
    """Write JSON to a temp file in the same folder, fsync, then rename over ``path``.

    A failure (disk full, folder not writable) raises MacMoesdError and leaves the earlier file
    as it was. A figure that came out NaN or infinite is written as null with its reason
    (``finite_document``)."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes 0600; results are for sharing
        with os.fdopen(fd, "w") as f:
            json.dump(finite_document(document), f, indent=1, allow_nan=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(err, OSError):
            raise MacMoesdError(f"cannot write {path}: {err.strerror or err}; "
                                "an earlier file there is unchanged") from None
        raise


def cluster_shape(meta: dict) -> tuple | None:
    """(ranks, backend, parallel) of a sharded run's ``meta``; None for one machine."""
    c = meta.get("cluster")
    return (c["ranks"], c["backend"], c["parallel"]) if c else None


def _say(meta: dict) -> str:
    shape = cluster_shape(meta)
    return "one machine" if shape is None else "{} ranks over {}, {} parallel".format(*shape)


def incompatibility(old: dict, new: dict) -> str | None:
    """Why two ``meta`` blocks cannot share a results file, or None."""
    for key in COMPATIBLE_KEYS:
        if old.get(key) != new.get(key):
            return f"{key} {old.get(key)!r} there, {new.get(key)!r} here"
    for key in COMPATIBLE_VERSIONS:
        a, b = old.get("versions", {}).get(key), new.get("versions", {}).get(key)
        if a != b:
            return f"{key} {a} there, {b} here"
    if cluster_shape(old) != cluster_shape(new):
        return f"{_say(old)} there, {_say(new)} here"
    old_blas, new_blas = old.get("blas", {}), new.get("blas", {})
    if old_blas.get("name") != new_blas.get("name"):
        return f"BLAS {old_blas.get('name')} there, {new_blas.get('name')} here"
    if old_blas.get("threads") != new_blas.get("threads"):
        return f"BLAS threads {old_blas.get('threads', 'unrecorded')} there, {new_blas.get('threads')} here"
    return None


class ResultsStore:
    """A results file opened for resuming: read once, updated in memory, saved atomically."""

    def __init__(self, path: Path, meta: dict):
        self.path = Path(path)
        ensure_writable(self.path.parent)
        key = WriterLock.take(self.path)
        # Held while this store lives: a command's store goes when the command returns.
        self.close = weakref.finalize(self, WriterLock.release, key)
        if self.path.exists():
            try:
                self.data = load_results(self.path)
                why = incompatibility(self.data.get("meta", {}), meta)
            except MacMoesdError:
                self.close()
                raise
            if why:
                self.close()
                raise MacMoesdError(
                    f"{self.path} was measured elsewhere ({why}); it was left untouched. "
                    "Write to another folder with --out."
                )
            self.data["meta"]["last_run"] = {"time": meta.get("time"), "command": meta.get("command")}
        else:
            self.data = {"schema": SCHEMA, "meta": meta}

    def claim(self, name: str, identity: schema.ModelIdentity) -> None:
        """Record that ``name`` in these results is the model ``identity`` describes
        (``ModelSource.identity``); refuse, before anything of it is written, where they hold
        results of another model of that name (two folders called alike, random weights and
        stored ones), whose entries a resumed command would otherwise take for its own."""
        held = self.data.get("models", {}).get(name)
        if held is None:
            self.section("models")[name] = {**identity}
            return
        if held.get("config_sha256") != identity["config_sha256"]:
            why = "another config"
        elif held.get("weights") != identity["weights"]:
            why = f"{held.get('weights')} weights, where this one's are {identity['weights']}"
        else:
            return
        raise MacMoesdError(f"{self.path} holds results of another model named {name} ({why}); they were "
                            "left untouched: write to another folder with --out (or rename the model's folder)")

    def section(self, name: str) -> dict:
        return self.data.setdefault(name, {})

    def entry(self, section: str, key: str, header: Mapping[str, Any]) -> dict:
        """The entry ``key`` of ``section``, created with ``header`` if new."""
        entries = self.section(section)
        if key not in entries:
            entries[key] = {**header, "points": {}}
        return entries[key]

    def put(self, section: str, key: str, value: Any) -> None:
        self.section(section)[key] = value
        self.save()

    def put_section(self, section: str, value: Any) -> None:
        """A document that is a whole section (the roofline: one per machine)."""
        self.data[section] = value
        self.save()

    def save(self) -> None:
        write_atomic(self.path, self.data)
