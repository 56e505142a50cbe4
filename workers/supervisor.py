"""Several worker processes on one port: a supervisor and its children (issue 35).

One worker process has one event loop, and under load that loop is its
bottleneck (HTTP, feature lookups, batching and rendering all run on it). The
:class:`Supervisor` starts ``processes`` children, each a whole worker (its own
event loop, batcher and model) listening on the same port with ``SO_REUSEPORT``:
Linux's kernel spreads new connections over their listening sockets, so no
acceptor process sits in the path. The supervisor itself serves nothing:

* it restarts a child that dies (at once after a long life, with doubling
  backoff after short ones) and gives up with :class:`WorkerStartError` when
  one dies before it is ready ``max_start_failures`` times in a row, or when a
  child reports an error before any child was ever ready (a bad model file, a
  device that is not there: restarting cannot fix those);
* on SIGTERM or SIGINT it sends SIGTERM to every child, each of which drains
  (refuses new requests with 503, finishes those in flight), and waits;
* it owns the Prometheus multiprocess directory (``PROMETHEUS_MULTIPROC_DIR``,
  one per supervisor, created at start and removed at exit) where the children
  write their series, and marks each dead child's gauges dead, so that a scrape
  of any child sees one worker whose counters are the sum over children;
* it shares one byte per child (starting, ready) with every child, so that each
  child's ``/readyz`` answers for all of them (:class:`Cluster`), and each
  child's count of open connections, so that a child holding more than its
  share of the port's keep-alive connections closes the surplus after their
  answers and their clients connect again, anywhere (Linux spreads
  connections by a hash of their addresses when they open, never after: a
  pool of 64 came out as uneven as 27/37 over 2 children, and a child
  restarted after a crash got none of the connections its predecessor had).

Platforms without ``SO_REUSEPORT`` load balancing (macOS and the BSDs give every
connection to one socket, Windows has none) are refused more than one process:
:func:`check_processes`.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from workers.exceptions import WorkerConfigError, WorkersError

__all__ = [
    "ChildSlot",
    "Cluster",
    "Supervisor",
    "WorkerStartError",
    "check_processes",
    "default_processes",
    "threads_per_child",
]

log = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
_STARTING, _READY = 0, 1
_ORPHAN_DRAIN_S = 60.0


class WorkerStartError(WorkersError):
    """Worker processes cannot be kept running: a child keeps dying before it is
    ready, or reported an error no restart can fix. Not retryable."""


def _cgroup_cpus(path: Path = Path("/sys/fs/cgroup/cpu.max")) -> int | None:
    """Whole CPUs a cgroup v2 quota allows (None: no quota, or no cgroup v2)."""
    try:
        quota, period = path.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return max(1, -(-int(quota) // int(period)))


def default_processes() -> int:
    """One process per core this process may run on: its CPU affinity, capped by
    a cgroup CPU quota (a container limited to 2 CPUs on a 64-core node gets 2).
    1 where the platform cannot say, or cannot share a port (:func:`check_processes`)."""
    if sys.platform != "linux":
        return 1
    cores = len(os.sched_getaffinity(0))
    quota = _cgroup_cpus()
    return max(1, min(cores, quota) if quota is not None else cores)


def threads_per_child(processes: int) -> int:
    """Torch threads for each of ``processes`` children sharing this process's cores:
    the cores (:func:`default_processes`) divided among them, at least 1.

    Without it each child's torch starts one OpenMP thread per core (N x cores in
    all): beside other load, a forward pass's threads wait at every barrier for a
    descheduled sibling (60-80 ms for a 0.2 ms pass measured beside a CPU hog,
    docs/workers.md). ``cpu_threads`` set explicitly wins.
    """
    return max(1, default_processes() // max(1, processes))


def check_processes(processes: int) -> int:
    """``processes`` if this platform can serve that many on one port.

    Raises:
        WorkerConfigError: fewer than 1, or more than 1 off Linux.
    """
    if isinstance(processes, bool) or processes < 1:
        raise WorkerConfigError(f"processes must be at least 1, got {processes!r}")
    if processes > 1 and sys.platform != "linux":
        raise WorkerConfigError(
            f"processes {processes} needs Linux's SO_REUSEPORT load balancing, which "
            f"{sys.platform} lacks; use --processes 1 and run one worker per port "
            "behind a load balancer"
        )
    return processes


@dataclass(frozen=True, slots=True)
class ChildSlot:
    """What a child is told at spawn: its index, the port, the shared states.

    Attributes:
        index: This child's place, 0 to ``processes - 1`` (kept across restarts).
        processes: How many children serve the port.
        port: The port to bind, with ``SO_REUSEPORT``.
        states: One byte per child, shared: 1 when that child is ready.
        errors: Where a child that cannot start says why (index, bad input?, message).
        connections: One int per child, shared: the connections it holds open.
    """

    index: int
    processes: int
    port: int
    states: Any = field(repr=False)
    errors: Any = field(repr=False)
    connections: Any = field(default=None, repr=False)

    def report(self, exc: BaseException) -> None:
        """Tell the supervisor why this child cannot start."""
        with contextlib.suppress(Exception):
            self.errors.put((self.index, isinstance(exc, ValueError), str(exc)))


class Cluster:
    """A child's view of all children: what its ``/readyz`` and ``/healthz`` answer."""

    __slots__ = ("_slot",)

    def __init__(self, slot: ChildSlot) -> None:
        self._slot = slot

    @property
    def index(self) -> int:
        """This child's place, 0 to ``processes - 1`` (its feature log files carry it)."""
        return self._slot.index

    def mark_ready(self, ready: bool) -> None:
        """Record this child's readiness for every child to see."""
        self._slot.states[self._slot.index] = _READY if ready else _STARTING

    def ready_count(self) -> int:
        """Children ready now."""
        return sum(1 for state in self._slot.states if state == _READY)

    @property
    def processes(self) -> int:
        """Children that should be serving."""
        return self._slot.processes

    def all_ready(self) -> bool:
        """True when every child is ready."""
        return self.ready_count() == self._slot.processes

    def set_connections(self, count: int) -> None:
        """Record the connections this child holds open, for every child to see."""
        if self._slot.connections is not None:
            self._slot.connections[self._slot.index] = count

    def over_share(self, count: int) -> bool:
        """Whether this child, holding ``count`` connections (less those it is already
        closing), holds more than its share of the ready children's connections
        (their total divided by their number, rounded up). False while fewer than
        two children are ready: there is nowhere else to go."""
        connections = self._slot.connections
        if connections is None:
            return False
        states = self._slot.states
        ready = 0
        total = 0
        for index, state in enumerate(states):
            if state == _READY:
                ready += 1
                total += connections[index]
        if ready < 2 or states[self._slot.index] != _READY:
            return False
        return count > -(-total // ready)


ChildTarget = Callable[[ChildSlot], int]
"""A child's body: serve on ``slot.port`` until SIGTERM, return the exit status.
Must be picklable (a module-level function, or a ``functools.partial`` of one)."""


def _watch_parent(parent: int) -> None:
    # A supervisor killed outright (SIGKILL, OOM) cannot stop its children: they
    # notice it is gone and drain themselves instead of serving the port forever.
    while os.getppid() == parent:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(_ORPHAN_DRAIN_S)  # a child that cannot drain must not outlive it for long
    os.kill(os.getpid(), signal.SIGKILL)


def _child_main(target: ChildTarget, slot: ChildSlot, parent: int) -> None:
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    try:
        code = target(slot)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException as exc:
        slot.report(exc)
        raise
    sys.exit(code)


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exit status {code}"


@dataclass(slots=True)
class _Child:
    process: Any = None
    started: float = 0.0
    was_ready: bool = False
    short_lives: int = 0  # consecutive deaths before ready or within min_uptime_s
    restart_at: float | None = None
    error: str | None = None
    bad_input: bool = False


class Supervisor:
    """Runs ``processes`` children of ``target`` on one port; see the module docstring.

    Args:
        target: The child's body (picklable; run in a fresh ``spawn`` process).
        processes: Children to keep running (:func:`check_processes`).
        host: Interface the children bind (the supervisor reserves the port there).
        port: TCP port (0: a free one, chosen once for all children).
        drain_timeout_s: How long each child may take to drain on SIGTERM
            (the children's own drain budget); past it plus a grace, SIGKILL.
        max_start_failures: Consecutive short lives of one child that end it all.
        backoff_s: First wait before restarting a child after a short life
            (doubling to ``max_backoff_s``); one that served ``min_uptime_s``
            is restarted at once.
    """

    def __init__(
        self,
        target: ChildTarget,
        *,
        processes: int,
        host: str = "127.0.0.1",
        port: int = 0,
        drain_timeout_s: float = 30.0,
        max_start_failures: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        min_uptime_s: float = 5.0,
    ) -> None:
        self.target = target
        self.processes = check_processes(processes)
        self.host = host
        self.port = port
        self.drain_timeout_s = drain_timeout_s
        self.max_start_failures = max_start_failures
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.min_uptime_s = min_uptime_s
        self.restarts = 0
        self._mp = multiprocessing.get_context("spawn")
        self._children = [_Child() for _ in range(processes)]
        self._states: Any = None
        self._connections: Any = None
        self._errors: Any = None
        self._stop = threading.Event()
        self.metrics_dir: Path | None = None

    def pids(self) -> list[int]:
        """The living children's process ids."""
        return [c.process.pid for c in self._children if c.process is not None]

    def stop(self) -> None:
        """Ask :meth:`run` to drain the children and return (any thread, a signal)."""
        self._stop.set()

    def _reserve_port(self) -> socket.socket:
        # Bound with SO_REUSEPORT but never listening: it holds the port (and picks
        # one for port 0) while children come and go, and takes no connections.
        family, kind, proto, _, address = socket.getaddrinfo(
            self.host, self.port, type=socket.SOCK_STREAM
        )[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind(address)
        except OSError as exc:
            sock.close()
            raise WorkerConfigError(
                f"cannot bind {self.host}:{self.port} ({exc}); choose a free --port"
            ) from None
        return sock

    def _spawn(self, index: int) -> None:
        child = self._children[index]
        self._states[index] = _STARTING
        self._connections[index] = 0
        slot = ChildSlot(
            index, self.processes, self.port, self._states, self._errors, self._connections
        )
        process = self._mp.Process(
            target=_child_main,
            args=(self.target, slot, os.getpid()),
            name=f"edgefeed-worker-{index}",
        )
        process.start()
        child.process, child.started, child.was_ready = process, time.monotonic(), False
        child.restart_at, child.error = None, None

    def _reap(self, index: int, now: float) -> None:
        from prometheus_client import multiprocess

        child = self._children[index]
        process = child.process
        code = process.exitcode
        pid = process.pid
        process.close()
        child.process = None
        self._states[index] = _STARTING
        self._connections[index] = 0  # its connections died with it
        if self.metrics_dir is not None:
            multiprocess.mark_process_dead(pid, str(self.metrics_dir))  # type: ignore[no-untyped-call]
        if self._stop.is_set():
            return
        lived = now - child.started
        short = not child.was_ready or lived < self.min_uptime_s
        child.short_lives = child.short_lives + 1 if short else 0
        why = f"worker process {index} (pid {pid}) ended after {lived:.1f} s: {_exit_text(code)}"
        never_ready = not any(c.was_ready for c in self._children)
        if child.error is not None and not child.was_ready and never_ready:
            # A typed error before any child served: a bad setting or model, the same
            # for every restart.
            error = WorkerConfigError if child.bad_input else WorkerStartError
            raise error(f"{why}; it could not start: {child.error}")
        if not child.was_ready and child.short_lives >= self.max_start_failures:
            detail = f": {child.error}" if child.error else " (its error is logged above)"
            raise WorkerStartError(
                f"{why}; it died before it was ready {child.short_lives} times in a row, "
                f"not restarting{detail}"
            )
        delay = 0.0
        if short:
            delay = min(self.max_backoff_s, self.backoff_s * 2 ** (child.short_lives - 1))
        log.warning("%s; restarting it in %.1f s", why, delay)
        child.restart_at = now + delay

    def _step(self, now: float) -> None:
        while not self._errors.empty():
            index, bad_input, message = self._errors.get()
            self._children[index].error = message
            self._children[index].bad_input = bad_input
        for index, child in enumerate(self._children):
            if child.process is not None:
                if self._states[index] == _READY:
                    child.was_ready = True
                if child.process.exitcode is not None:
                    self._reap(index, now)
            if child.process is None and child.restart_at is not None and now >= child.restart_at:
                self.restarts += 1
                self._spawn(index)

    def _ready(self) -> bool:
        return all(state == _READY for state in self._states)

    def _drain(self) -> None:
        living = [c.process for c in self._children if c.process is not None]
        for process in living:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.drain_timeout_s + 10.0
        for process in living:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.exitcode is None:
                log.warning("worker process pid %d did not drain in time: killing it", process.pid)
                process.kill()
                process.join()
        for index, child in enumerate(self._children):
            if child.process is not None:
                self._reap(index, time.monotonic())

    def run(self, on_ready: Callable[[Supervisor], None] | None = None) -> None:
        """Start the children, keep them running until :meth:`stop` (SIGTERM, SIGINT), drain.

        Args:
            on_ready: Called once, when every child is first ready.

        Raises:
            WorkerStartError: children cannot be kept running (they are stopped first).
            WorkerConfigError: the port cannot be bound.
        """
        reserved = self._reserve_port()
        self.port = int(reserved.getsockname()[1])
        self.metrics_dir = Path(tempfile.mkdtemp(prefix="edgefeed-workers-metrics-"))
        saved_env = os.environ.get(MULTIPROC_ENV)
        # Children inherit it at spawn: prometheus_client reads it when imported.
        os.environ[MULTIPROC_ENV] = str(self.metrics_dir)
        self._states = self._mp.RawArray("b", self.processes)
        self._connections = self._mp.RawArray("i", self.processes)
        self._errors = self._mp.SimpleQueue()
        handlers = self._install_signals()
        announced = False
        try:
            for index in range(self.processes):
                self._spawn(index)
            while not self._stop.is_set():
                sentinels = [c.process.sentinel for c in self._children if c.process is not None]
                wait(sentinels, timeout=0.05)
                self._step(time.monotonic())
                if not announced and self._ready():
                    announced = True
                    if on_ready is not None:
                        on_ready(self)
        finally:
            self._stop.set()
            self._drain()
            self._restore_signals(handlers)
            if saved_env is None:
                os.environ.pop(MULTIPROC_ENV, None)
            else:
                os.environ[MULTIPROC_ENV] = saved_env
            shutil.rmtree(self.metrics_dir, ignore_errors=True)
            reserved.close()

    def _install_signals(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        handlers: dict[int, Any] = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            handlers[sig] = signal.signal(sig, lambda *_: self._stop.set())
        return handlers

    @staticmethod
    def _restore_signals(handlers: dict[int, Any]) -> None:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
