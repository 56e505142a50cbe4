"""Continuous batching of a regional worker, sans I/O.

State changes happen per change as messages arrive; the vectors and one
pipelined cache write happen per entity per *batch*. A batch closes at
``max_changes`` changes, or once it is ``within_s`` old while the worker keeps
up: once it has taken every message its partitions held (each message tells
how many followed it on its partition as the consumer last heard,
:attr:`Delivery.backlog`). While the worker is behind (a partition holds more),
a batch also stays open until it is ``catch_up`` times as old as the last flush
took: a worker that falls behind takes bigger batches (the fixed cost of a
flush, and an entity changed many times, are shared by more changes) instead
of falling further behind. A worker that keeps up flushes soon, whatever its
last flush took: a batch that waits twice a flush's time is most of the
commit -> cache latency at a steady rate (docs/benchmarks.md, "Pipeline").

Entities a batch changed only by snapshot reads (op ``r``: an incremental
snapshot's rows, a history rebuild, a feature backfill) are set apart
(:attr:`ClosedBatch.read_only`): the worker writes their vectors from a slower
lane (:class:`SnapshotLane`), once per ``lane_s`` however many of their rows
came, so that a snapshot's rows cost streamed changes little CPU. A snapshot
interleaves entities (a chunk holds a few rows of each of hundreds): written per
batch, one entity's vector would be computed again with each chunk.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pipeline.runtime.ledger import Delivery

__all__ = ["BatchPolicy", "ClosedBatch", "RegionBatch", "SnapshotLane", "Touched"]


@dataclass(frozen=True, slots=True)
class BatchPolicy:
    """When a batch closes (``pipeline.batch_max``, ``batch_within_ms``, ``batch_catch_up``)."""

    max_changes: int = 5000
    within_s: float = 0.02
    catch_up: float = 2.0
    lane_s: float = 1.0  # how long snapshot-read entities wait to be written


@dataclass(frozen=True, slots=True)
class Touched:
    """An entity whose state a batch changed: what its cache write needs."""

    entity: str
    entity_id: Any
    delivery: Delivery  # the message that last changed it (its partition takes the state)
    state: Any  # pipeline.features.EntityState


@dataclass(frozen=True, slots=True)
class ClosedBatch:
    """A batch taken for flushing."""

    deliveries: list[Delivery]
    touched: dict[str, Touched]
    changes: int
    read_only: set[str] = field(default_factory=set)  # touched by snapshot reads only


@dataclass(slots=True)
class RegionBatch:
    """The open batch: the messages it holds and the entities they changed.

    Args:
        policy: When the batch is due.
    """

    policy: BatchPolicy = field(default_factory=BatchPolicy)
    deliveries: list[Delivery] = field(default_factory=list)
    touched: dict[str, Touched] = field(default_factory=dict)
    changes: int = 0
    opened_at: float | None = None
    last_flush_s: float = 0.0
    read_only: set[str] = field(default_factory=set)
    # Partition -> the backlog its last message reported (None: unknown, as behind).
    backlogs: dict[int, int | None] = field(default_factory=dict)

    def add(self, delivery: Delivery, changes: int, now: float) -> None:
        """A message with ``changes`` changes joined the batch."""
        if self.opened_at is None:
            self.opened_at = now
        self.deliveries.append(delivery)
        self.changes += changes
        self.backlogs[delivery.partition] = delivery.backlog

    def behind(self) -> bool:
        """Whether a partition held messages after the last one taken from it (or
        could have: its backlog is unknown)."""
        return any(b is None or b > 0 for b in self.backlogs.values())

    def reassigned(self) -> None:
        """The worker's partitions changed: forget what the old ones held."""
        self.backlogs.clear()

    def touch(self, key: str, touched: Touched, *, snapshot_read: bool = False) -> None:
        """The batch changed entity ``key`` (the newest state wins); ``snapshot_read``:
        by a snapshot read (an entity changed only by those goes to the lane)."""
        if not snapshot_read:
            self.read_only.discard(key)
        elif key not in self.touched:
            self.read_only.add(key)
        self.touched[key] = touched

    def due(self, now: float) -> bool:
        """True once the batch should be flushed."""
        due_at = self.due_at()
        return due_at is not None and now >= due_at

    def due_at(self) -> float | None:
        """When the open batch falls due by age (now, when full); None when none is open."""
        if self.opened_at is None:
            return None
        if self.changes >= self.policy.max_changes:
            return self.opened_at
        if not self.behind():
            return self.opened_at + self.policy.within_s
        return self.opened_at + max(self.policy.within_s, self.policy.catch_up * self.last_flush_s)

    def close(self) -> ClosedBatch:
        """Take the batch for flushing; a new one opens with the next message."""
        closed = ClosedBatch(self.deliveries, self.touched, self.changes, self.read_only)
        self.deliveries, self.touched, self.changes, self.opened_at = [], {}, 0, None
        self.read_only = set()
        return closed

    def flushed(self, seconds: float) -> None:
        """The last flush took ``seconds`` (it sets how long the next batch may grow)."""
        self.last_flush_s = seconds


@dataclass(slots=True)
class SnapshotLane:
    """Entities changed only by snapshot reads, waiting for their vectors' write, and
    the messages behind them (acknowledged only once those vectors are in the cache:
    the ledger gets them from :meth:`take`).

    Args:
        lane_s: How long the lane holds what it took first.
        max_entities: The lane is due at once when it holds this many entities.
    """

    lane_s: float = 1.0
    max_entities: int = 5000
    touched: dict[str, Touched] = field(default_factory=dict)
    deliveries: list[Delivery] = field(default_factory=list)
    opened_at: float | None = None

    def hold(self, touched: dict[str, Touched], deliveries: list[Delivery], now: float) -> None:
        """Hold ``touched`` (snapshot-read entities) and the messages of their batch."""
        if self.opened_at is None:
            self.opened_at = now
        self.touched.update(touched)
        self.deliveries.extend(deliveries)

    def superseded(self, keys: Iterable[str]) -> None:
        """These entities are written with newer states: the lane drops them (their
        messages stay held until the lane is taken)."""
        if not self.touched:  # the common case, every flush of a streaming worker
            return
        for key in keys:
            self.touched.pop(key, None)

    def due(self, now: float) -> bool:
        """True once the lane's vectors should be written."""
        due_at = self.due_at()
        return due_at is not None and now >= due_at

    def due_at(self) -> float | None:
        """When the lane falls due (None: it holds nothing)."""
        if self.opened_at is None:
            return None
        if len(self.touched) >= self.max_entities:
            return self.opened_at
        return self.opened_at + self.lane_s

    def take(self) -> tuple[dict[str, Touched], list[Delivery]]:
        """Empty the lane: its entities to write, and the messages to hand the ledger
        once they are written."""
        taken = self.touched, self.deliveries
        self.touched, self.deliveries, self.opened_at = {}, [], None
        return taken
