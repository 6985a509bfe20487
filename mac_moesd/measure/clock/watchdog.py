"""A guard process that ends a rank of a sharded run when the other ranks stop answering.

MLX's collectives block until every rank takes part, and the ring backend's ``init`` blocks
while holding the GIL (a rank waiting for a peer that never starts runs no Python thread), so
the guard is a separate process: the rank tells it on a pipe that it is making progress
(``beat``); when no beat comes for ``timeout`` seconds it prints one line on stderr and ends
the rank (SIGTERM, then SIGKILL, which also ends a stopped process). It exits with the rank.

Run as a script it is the guard itself, using the standard library only (it must not import
MLX): ``python watchdog.py PID TIMEOUT``.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

__all__ = ["Watchdog"]

GRACE_S = 3.0  # between SIGTERM and SIGKILL


class Watchdog:
    """The rank's side: start the guard, beat, stop."""

    def __init__(self, timeout: float, message: str):
        self.timeout = timeout
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(os.getpid()), str(timeout)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
        assert self.proc.stdin is not None  # stdin=PIPE
        self.stdin = self.proc.stdin
        self.say(message)

    def _send(self, line: str) -> None:
        try:
            self.stdin.write((line.replace("\n", " ") + "\n").encode())
            self.stdin.flush()
        except (BrokenPipeError, ValueError):  # the guard is gone: nothing left to guard with
            pass

    def say(self, message: str) -> None:
        """The line printed (after "Error: ") if the guard has to end this rank."""
        self._send(f"msg {message}")

    def beat(self) -> None:
        """Progress: the next ``timeout`` seconds start now."""
        self._send("beat")

    def stop(self) -> None:
        self._send("stop")
        try:
            self.stdin.close()
        except (BrokenPipeError, ValueError):
            pass
        self.proc.wait()

    def __enter__(self) -> Watchdog:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _guard(pid: int, timeout: float) -> int:
    message = f"no progress for {timeout:g} s"
    deadline = time.monotonic() + timeout
    stdin = sys.stdin.buffer
    buffer = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, _, _ = select.select([stdin], [], [], left)
        if not ready:
            continue
        chunk = os.read(stdin.fileno(), 65536)
        if not chunk:  # the rank exited
            return 0
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            text = line.decode(errors="replace")
            if text == "stop":
                return 0
            if text == "beat":
                deadline = time.monotonic() + timeout
            elif text.startswith("msg "):
                message = text[4:]
    sys.stderr.write(f"Error: {message}\n")
    sys.stderr.flush()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not _alive(pid):
            break
        os.kill(pid, sig)
        end = time.monotonic() + GRACE_S
        while _alive(pid) and time.monotonic() < end:
            time.sleep(0.05)
    return 1


if __name__ == "__main__":
    sys.exit(_guard(int(sys.argv[1]), float(sys.argv[2])))
