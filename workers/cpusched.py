"""A short scheduler time slice for the worker's threads (Linux 6.12+, EEVDF).

A model worker spends most of a request waiting: for the client's bytes, for
Redis, for the model thread. Each wait puts its event loop to sleep, and on a
node where something else keeps the cores busy (a batch job, a neighbour's
container, ``stress-ng --cpu 2`` in the benchmarks) the woken loop then waits
for a core: the kernel's EEVDF scheduler lets the running task finish its slice
(1.4 ms on the development machine's kernel, ``base_slice_ns`` x (1 + log2
cores)) before the woken one runs. Measured there, a thread that sleeps 0.3 ms
and does a little work, beside ``stress-ng --cpu 2``: wake-up delay p99
7.4-8.9 ms at the default slice against 2.5-3.1 ms at 0.1 ms (5 runs each,
alternated).

Since Linux 6.12 a task may ask for its own slice (``sched_setattr`` with
``sched_runtime`` under ``SCHED_OTHER``; the kernel clamps it to 0.1-100 ms):
a shorter one gives it an earlier virtual deadline, so it runs sooner when it
wakes, in shorter turns. Its share of the CPU is unchanged (that is the
weight, ``nice`` or the cgroup's); only the latency of getting it. No
privilege is needed. Threads and processes started afterwards inherit it, so
the worker asks before it loads the model (torch's threads) and starts its
children.

Python has no binding for ``sched_setattr``; this calls the system call through
:mod:`ctypes` (the structure is ``struct sched_attr`` of
``include/uapi/linux/sched/types.h``, 56 bytes since Linux 4.19).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import struct
import sys
import threading

__all__ = ["SLICE_MAX_US", "SLICE_MIN_US", "available", "current_slice_us", "request_slice"]

log = logging.getLogger("edgefeed.workers")

SLICE_MIN_US, SLICE_MAX_US = 100, 100_000  # what the kernel accepts (it clamps)

# sched_setattr / sched_getattr: the generic table's numbers, and x86_64's own.
_SYSCALLS = {"x86_64": (314, 315), "aarch64": (274, 275), "arm64": (274, 275)}
_ATTR = struct.Struct("IIQiIQQQII")  # size, policy, flags, nice, priority, runtime,
# deadline, period, util_min, util_max
_FAIR = {0, 3}  # SCHED_OTHER, SCHED_BATCH: the policies a slice applies to


def _call(number: int, *args: object) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.syscall(number, *args))


def _get(tid: int = 0) -> tuple[int, ...] | None:
    """Thread ``tid``'s ``struct sched_attr`` (0: this one); None off Linux or where
    the call fails."""
    numbers = _SYSCALLS.get(platform.machine()) if sys.platform == "linux" else None
    if numbers is None:
        return None
    buffer = ctypes.create_string_buffer(_ATTR.size)
    if _call(numbers[1], tid, buffer, _ATTR.size, 0) != 0:
        return None
    return _ATTR.unpack(buffer.raw)


def current_slice_us(tid: int = 0) -> float | None:
    """The slice thread ``tid`` (0: this one) runs with, in microseconds (asked for or the kernel's
    default); None where the kernel has no per-task slice (before 6.12 it reports
    none) or the thread's policy takes none."""
    attr = _get(tid)
    if attr is None or attr[1] not in _FAIR or not attr[5]:
        return None
    return attr[5] / 1e3


def available() -> bool:
    """Whether this kernel gives a thread a slice of its own (Linux 6.12+)."""
    return current_slice_us() is not None


def _threads() -> list[int]:
    """This process's threads (their ids), this one first."""
    try:
        others = [int(name) for name in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: this thread alone
        others = []
    here = threading.get_native_id()
    return [here, *(tid for tid in others if tid != here)]


def _set(tid: int, us: float) -> bool:
    """Thread ``tid``'s slice set to ``us``, its policy and nice value kept."""
    attr = _get(tid)
    if attr is None or attr[1] not in _FAIR:
        return False
    try:
        nice = os.getpriority(os.PRIO_PROCESS, tid)  # on Linux: the thread's own
    except OSError:  # it ended meanwhile
        return False
    wanted = _ATTR.pack(_ATTR.size, attr[1], 0, nice, 0, int(us * 1e3), 0, 0, 0, 0)
    setattr_ = _SYSCALLS[platform.machine()][0]
    if _call(setattr_, tid, ctypes.create_string_buffer(wanted, _ATTR.size), 0) != 0:
        log.info("scheduler slice of thread %d not set: %s", tid, os.strerror(ctypes.get_errno()))
        return False
    return True


def request_slice(us: float) -> float | None:
    """Ask for a time slice of ``us`` microseconds for this process's threads (those
    already running: a library may have started some at import, and those started
    later, which inherit it); returns the slice in effect, or None where there is
    none to ask for (not Linux, a kernel before 6.12, a real-time policy, a sandbox
    refusing the call): the worker then runs at the kernel's default, as before,
    and says so at start.

    Raises:
        ValueError: ``us`` outside what the kernel accepts (100 to 100,000).
    """
    if not SLICE_MIN_US <= us <= SLICE_MAX_US:
        raise ValueError(
            f"a scheduler slice of {us!r} us is outside what Linux accepts "
            f"({SLICE_MIN_US} to {SLICE_MAX_US} us); use 0 for the kernel's default"
        )
    here, *others = _threads()
    if not _set(here, us):
        return None
    for tid in others:
        _set(tid, us)
    # Before 6.12 the kernel takes sched_runtime under SCHED_OTHER and ignores it.
    return current_slice_us()
