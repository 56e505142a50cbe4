"""Detached service processes with pid files that can tell our processes from foreign ones.

A pid file records the pid and the process start time (``/proc/<pid>/stat``
field 22). A pid whose start time differs belongs to some other process that
reused the number, so ``dev down`` after a crash never kills a stranger.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "PidRecord",
    "port_in_use",
    "read_pid",
    "spawn",
    "stop_pid",
    "wait_until",
]


# Processes started by this interpreter, kept so they can be reaped (waited for)
# when stopped; otherwise they would linger as zombies, and Popen would warn.
_children: dict[int, subprocess.Popen[bytes]] = {}


@dataclass(frozen=True, slots=True)
class PidRecord:
    """What a pid file holds about one process we started."""

    pid: int
    start_ticks: int
    argv: tuple[str, ...]

    def alive(self) -> bool:
        """True if the process still runs and is the very one we started."""
        return _start_ticks(self.pid) == self.start_ticks


def _start_ticks(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":  # a zombie is dead for our purposes
        return None
    return int(fields[19])


def spawn(
    argv: Sequence[str],
    *,
    log_path: Path,
    pid_path: Path,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    user: str | None = None,
) -> PidRecord:
    """Start ``argv`` in its own session (it outlives the caller), logging to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    pid_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=True,
            user=user,
        )
    _children[proc.pid] = proc
    ticks = _start_ticks(proc.pid)
    record = PidRecord(proc.pid, ticks if ticks is not None else -1, tuple(argv))
    tmp = pid_path.with_suffix(".tmp")
    tmp.write_text(
        json.dumps(
            {"pid": record.pid, "start_ticks": record.start_ticks, "argv": list(record.argv)}
        )
    )
    tmp.replace(pid_path)
    return record


def read_pid(pid_path: Path) -> PidRecord | None:
    """The record in ``pid_path``, or None when there is none or it is unreadable."""
    try:
        data = json.loads(pid_path.read_text())
        return PidRecord(int(data["pid"]), int(data["start_ticks"]), tuple(data["argv"]))
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def stop_pid(
    record: PidRecord, *, sig: signal.Signals = signal.SIGTERM, timeout_s: float = 15.0
) -> bool:
    """Stop the process of ``record`` if it is still ours; SIGKILL after ``timeout_s``.

    Returns:
        True if a live process of ours was stopped, False if it had already gone
        (or the pid now belongs to someone else, who is left alone).
    """
    if not record.alive():
        _reap(record.pid)
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(record.pid, sig)
    if wait_until(lambda: not record.alive(), timeout_s=timeout_s, interval_s=0.05):
        _reap(record.pid)
        return True
    if record.alive():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(record.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(record.pid, signal.SIGKILL)
        wait_until(lambda: not record.alive(), timeout_s=5.0, interval_s=0.05)
    _reap(record.pid)
    return True


def _reap(pid: int) -> None:
    # A process started by this very interpreter stays a zombie until waited for.
    proc = _children.pop(pid, None)
    if proc is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=1)


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """True if something accepts or holds ``host:port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def wait_until(predicate: Callable[[], bool], *, timeout_s: float, interval_s: float = 0.1) -> bool:
    """Poll ``predicate`` until it is true or ``timeout_s`` passes; returns the last result."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)
