"""Continuous batching of a regional worker, sans I/O.

State changes happen per change as messages arrive; the vectors and one
pipelined cache write happen per entity per *batch*. A batch closes at
``max_changes`` changes, or once it is ``within_s`` old and at least
``catch_up`` times as old as the last flush took: a worker that falls behind
takes bigger batches (the fixed cost of a flush is shared by more changes)
instead of falling further behind.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline.runtime.ledger import Delivery

__all__ = ["BatchPolicy", "ClosedBatch", "RegionBatch", "Touched"]


@dataclass(frozen=True, slots=True)
class BatchPolicy:
    """When a batch closes (``pipeline.batch_max``, ``batch_within_ms``, ``batch_catch_up``)."""

    max_changes: int = 5000
    within_s: float = 0.02
    catch_up: float = 2.0


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

    def add(self, delivery: Delivery, changes: int, now: float) -> None:
        """A message with ``changes`` changes joined the batch."""
        if self.opened_at is None:
            self.opened_at = now
        self.deliveries.append(delivery)
        self.changes += changes

    def touch(self, key: str, touched: Touched) -> None:
        """The batch changed entity ``key`` (the newest state wins)."""
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
        return self.opened_at + max(self.policy.within_s, self.policy.catch_up * self.last_flush_s)

    def close(self) -> ClosedBatch:
        """Take the batch for flushing; a new one opens with the next message."""
        closed = ClosedBatch(self.deliveries, self.touched, self.changes)
        self.deliveries, self.touched, self.changes, self.opened_at = [], {}, 0, None
        return closed

    def flushed(self, seconds: float) -> None:
        """The last flush took ``seconds`` (it sets how long the next batch may grow)."""
        self.last_flush_s = seconds
