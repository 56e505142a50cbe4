"""Readiness of the pipeline's processes, for the kubelet's ``/readyz`` probe (sans I/O).

The process's event loop tells these objects what it knows (a recovery ended, the
offsets of its partitions); the HTTP endpoint's thread asks them
(:meth:`Readiness.check`, :meth:`RegionReadiness.check`). A lock guards both sides:
the endpoint runs in a thread of its own (monitoring.endpoint). Nothing here does
I/O, so the decisions are unit-tested with plain values
(tests/unit/pipeline/test_probes.py).

- The router and the forwarder use :class:`Readiness`, a flag with a reason: the
  router is ready once its table of homes is recovered after an assignment (its
  source partitions are its own), the forwarder once it is connected
  (``FORWARDER_READY``).
- A regional worker uses :class:`RegionReadiness`: ready once it has recovered its
  partitions' states and is caught up (see :meth:`RegionReadiness.check`).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from pipeline.exceptions import PipelineConfigError

__all__ = [
    "DEFAULT_MAX_BEHIND_S",
    "PartitionMarks",
    "Readiness",
    "RegionReadiness",
    "partition_marks",
]

#: How far behind a regional worker may be and still be ready
#: (``pipeline.ready_max_behind_s``).
DEFAULT_MAX_BEHIND_S = 30.0


class Readiness:
    """Ready or not, and why; set by the process, read by the probe.

    Args:
        reason: Why it is not ready yet.
    """

    def __init__(self, reason: str = "starting") -> None:
        self._lock = threading.Lock()
        self._state = (False, reason)

    def set(self, ready: bool, reason: str) -> None:
        with self._lock:
            self._state = (ready, reason)

    def check(self) -> tuple[bool, str]:
        """(ready, reason)."""
        with self._lock:
            return self._state


@dataclass(frozen=True, slots=True)
class PartitionMarks:
    """What a regional worker knows of one partition of its change topic.

    Attributes:
        highwater: The log end offset (the offset the next record will get) as the
            consumer last saw it; None before its first fetch.
        committed: The group's committed offset (the next to read); None when none
            (read as 0: nothing consumed yet).
        taken: The offset after the newest message the worker took since it
            recovered; None when it took none.
        newest_commit_s: The source commit time (seconds since the epoch) of the
            newest change the worker took on this partition; None when unknown.
    """

    highwater: int | None
    committed: int | None = None
    taken: int | None = None
    newest_commit_s: float | None = None

    @property
    def waiting(self) -> int | None:
        """Messages in the log the worker has not taken (None: unknown).

        Exact for the regional change topics, whose offsets have no holes (the
        router and the forwarder write them without transactions; the same
        property ``faustcompat.patch_strict_commits`` relies on).
        """
        if self.highwater is None:
            return None
        return max(0, self.highwater - max(self.committed or 0, self.taken or 0))


def partition_marks(
    offsets: Mapping[int, tuple[int | None, int | None]],
    progress: Mapping[int, tuple[int, int]],
) -> dict[int, PartitionMarks]:
    """The marks of the partitions in ``offsets`` (partition -> committed offset and
    highwater, as ``faustcompat.partition_offsets`` reads them) and ``progress``
    (partition -> the offset after the newest message taken and the newest source
    commit time in ms, 0 when none: ``RegionRuntime.progress``)."""
    marks: dict[int, PartitionMarks] = {}
    for partition, (committed, highwater) in offsets.items():
        taken, newest_ms = progress.get(partition, (None, 0))
        newest_s = newest_ms / 1000 if newest_ms else None
        marks[partition] = PartitionMarks(highwater, committed, taken, newest_s)
    return marks


class RegionReadiness:
    """A regional worker's readiness: recovered, and caught up.

    Args:
        max_behind_s: How far behind the worker may be and still be ready
            (``pipeline.ready_max_behind_s``).
        clock: Seconds since the epoch (source commit times are on that scale);
            tests pass a fake.

    Raises:
        PipelineConfigError: ``max_behind_s`` is not positive.
    """

    def __init__(
        self, max_behind_s: float = DEFAULT_MAX_BEHIND_S, clock: Callable[[], float] = time.time
    ) -> None:
        if max_behind_s <= 0:
            raise PipelineConfigError(
                f"pipeline.ready_max_behind_s {max_behind_s} must be positive seconds"
            )
        self.max_behind_s = max_behind_s
        self.clock = clock
        self._lock = threading.Lock()
        self._partitions: frozenset[int] | None = None  # None: not recovered
        self._assigned_once = False
        self._marks: dict[int, PartitionMarks] = {}
        self._observed_at: float | None = None
        self._caught_up_at: dict[int, float] = {}

    def rebalancing(self) -> None:
        """Partitions are being revoked: not ready until the next recovery ends."""
        with self._lock:
            self._partitions = None

    def recovered(self, partitions: Iterable[int]) -> None:
        """The states of ``partitions`` (all the worker owns now; maybe none) are
        recovered. What was known of the partitions before is forgotten."""
        with self._lock:
            self._partitions = frozenset(partitions)
            self._assigned_once = True
            self._marks = {}
            self._observed_at = None
            self._caught_up_at = {}

    def observe(self, marks: Mapping[int, PartitionMarks]) -> None:
        """Where the worker's partitions stand now (called every second or so)."""
        now = self.clock()
        with self._lock:
            self._marks = dict(marks)
            self._observed_at = now
            for partition, mark in marks.items():
                if mark.waiting == 0:
                    self._caught_up_at[partition] = now

    def check(self) -> tuple[bool, str]:
        """(ready, reason).

        Not ready while no recovery has ended since the last assignment began
        (``recovering partitions``), before the first report of the partitions'
        offsets after it, or when the reports stopped for ``max_behind_s`` (the
        event loop is blocked). Otherwise ready unless a partition is behind by
        more than ``max_behind_s``: it has messages waiting and
        ``min(now - commit time of the newest change taken there, now - the last
        time it had none waiting)`` exceeds the bound. Both are upper bounds of
        the age of the oldest change waiting; the first is the source-to-worker
        delay (what a restarted worker with a backlog shows), the second keeps a
        rare change on a quiet partition from looking late, the moment before it
        is taken. A partition with nothing waiting is caught up however old its
        last change: an idle region is ready. A worker that owns no partition (more
        workers than partitions) is ready once recovered: it has nothing to do.
        """
        now = self.clock()
        with self._lock:
            if self._partitions is None:
                if self._assigned_once:
                    return False, "recovering partitions (rebalance)"
                return False, "starting: waiting for an assignment of partitions"
            if not self._partitions:
                return True, "ready: no partitions assigned (more workers than partitions)"
            if self._observed_at is None:
                return False, "recovered; waiting for the first offsets of its partitions"
            silent = now - self._observed_at
            if silent > self.max_behind_s:
                return False, f"no progress report for {_tenths_up(silent)} s (event loop blocked?)"
            worst: tuple[float, int, int] | None = None  # (seconds behind, partition, waiting)
            for partition in sorted(self._partitions):
                mark = self._marks.get(partition)
                waiting = None if mark is None else mark.waiting
                if mark is None or waiting is None:
                    return False, f"catching up: partition {partition} not fetched yet"
                if waiting == 0:
                    continue
                bounds = []
                if mark.newest_commit_s is not None:
                    bounds.append(now - mark.newest_commit_s)
                if partition in self._caught_up_at:
                    bounds.append(now - self._caught_up_at[partition])
                if not bounds:
                    return False, (
                        f"catching up: {_plural(waiting, 'message')} waiting on partition "
                        f"{partition}, none taken yet"
                    )
                behind = max(0.0, min(bounds))
                if worst is None or behind > worst[0]:
                    worst = (behind, partition, waiting)
            owned = _plural(len(self._partitions), "partition")
            if worst is None:
                return True, f"ready: caught up on {owned}"
            behind, partition, waiting = worst
            detail = f"partition {partition}, {_plural(waiting, 'message')} waiting"
            if behind > self.max_behind_s:
                bound = f"bound {self.max_behind_s:g} s"
                return False, f"behind: {_tenths_up(behind)} s ({detail}; {bound})"
            return True, f"ready: {owned}, behind {behind:.1f} s at most ({detail})"


def _tenths_up(seconds: float) -> str:
    """``seconds`` in tenths, rounded up: a time over the bound is shown over it
    (2.04 s past a 2 s bound read "2.0 s" when rounded to the nearest tenth)."""
    return f"{math.ceil(round(seconds * 10, 6)) / 10:.1f}"


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")
