"""Checkpoints of a regional worker, sans I/O: what must go to the changelog, and
which messages may be acknowledged.

The rules, each a past bug or a guarantee the kill -9 tests rely on:

1. A message may be acked only after the batch it belongs to was written to the
   cache (:meth:`CheckpointLedger.written`) *and* the states it changed are in
   the changelog (the checkpoint that took them completed). A message still in
   an open or flushing batch is never acked.
2. A checkpoint takes the states changed since the last one (each entity once,
   its newest state) and the messages written since; states changed while it
   runs wait for the next one.
3. A checkpoint that fails gives its states and messages back (newer states of
   the same entities win), so nothing is acked without being stored.
4. After a restart, consumption resumes at :meth:`CheckpointLedger.safe_offsets`:
   per partition, the oldest message not yet checkpointed (Faust's committed
   offset is the same number, since only checkpointed messages are acked).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Checkpoint", "CheckpointLedger", "Delivery"]


@dataclass(frozen=True, slots=True, eq=False)
class Delivery:
    """One consumed message: where it came from, and the consumer's handle to ack it.

    Equality is identity: the same offset consumed twice (after a rebalance) is two
    deliveries.
    """

    partition: int
    offset: int
    handle: Any = None  # the Faust event
    key: bytes | None = None
    topic: str = ""
    # Messages of its partition after it that the broker held as the consumer last
    # heard (the log end offset of the last fetch, less its own); None: unknown.
    backlog: int | None = None


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """What one checkpoint writes and then acks."""

    states: list[tuple[str, Delivery, Any]]  # (entity key, last delivery, state)
    acks: list[Delivery]

    @property
    def partitions(self) -> dict[int, Delivery]:
        """One delivery per partition the checkpoint writes states to."""
        return {delivery.partition: delivery for _key, delivery, _state in self.states}


@dataclass(slots=True)
class CheckpointLedger:
    """Dirty states and ackable messages between checkpoints.

    Args:
        interval_s: Time between checkpoints (``pipeline.checkpoint_interval_s``).
    """

    interval_s: float = 1.0
    # A checkpoint falls due for changed states alone, with no message behind them
    # (the bookkeeping of a renewed vector, with a local store).
    states_alone: bool = False
    dirty: dict[str, tuple[Delivery, Any]] = field(default_factory=dict)
    ready: list[Delivery] = field(default_factory=list)
    last_at: float = 0.0
    running: Checkpoint | None = None
    # partition -> offsets received and not yet acked (oldest first)
    _pending: dict[int, dict[int, int]] = field(default_factory=dict)
    _next: dict[int, int] = field(default_factory=dict)

    def received(self, delivery: Delivery) -> None:
        """A message was consumed (it is pending until a checkpoint acks it)."""
        offsets = self._pending.setdefault(delivery.partition, {})
        offsets[delivery.offset] = offsets.get(delivery.offset, 0) + 1

    def written(
        self, deliveries: Iterable[Delivery], states: Iterable[tuple[str, Delivery, Any]]
    ) -> None:
        """A batch is in the cache: its states await the changelog, its messages an ack."""
        for key, delivery, state in states:
            self.dirty[key] = (delivery, state)
        self.ready.extend(deliveries)

    def changed(self, key: str, delivery: Delivery, state: Any) -> None:
        """A state changed without a message (its bookkeeping): it awaits the
        changelog under ``delivery`` (its partition) unless it already does."""
        self.dirty.setdefault(key, (delivery, state))

    def due(self, now: float) -> bool:
        """True when a checkpoint should start: messages wait, the interval has passed,
        and none is running."""
        due_at = self.due_at()
        return due_at is not None and now >= due_at

    def due_at(self) -> float | None:
        """When the next checkpoint falls due; None while nothing waits for one (or one
        is running: its end is the next event)."""
        if self.running is not None or not (self.ready or (self.states_alone and self.dirty)):
            return None
        return self.last_at + self.interval_s

    def begin(self, now: float) -> Checkpoint:
        """Take what the next checkpoint writes and acks.

        Raises:
            RuntimeError: a checkpoint is already running (a bug in the caller).
        """
        if self.running is not None:
            raise RuntimeError("a checkpoint is already running")
        self.last_at = now
        checkpoint = Checkpoint(
            [(key, delivery, state) for key, (delivery, state) in self.dirty.items()],
            self.ready,
        )
        self.dirty, self.ready = {}, []
        self.running = checkpoint
        return checkpoint

    def complete(self, checkpoint: Checkpoint) -> list[Delivery]:
        """The checkpoint's states are in the changelog: the messages to ack now."""
        self._finish(checkpoint)
        for delivery in checkpoint.acks:
            offsets = self._pending.get(delivery.partition)
            if offsets is None or delivery.offset not in offsets:
                continue
            offsets[delivery.offset] -= 1
            if offsets[delivery.offset] <= 0:
                del offsets[delivery.offset]
            self._next[delivery.partition] = max(
                self._next.get(delivery.partition, 0), delivery.offset + 1
            )
        return checkpoint.acks

    def abort(self, checkpoint: Checkpoint) -> None:
        """The checkpoint failed: its states and messages wait for the next one."""
        self._finish(checkpoint)
        for key, delivery, state in checkpoint.states:
            self.dirty.setdefault(key, (delivery, state))  # a newer state of it wins
        self.ready[:0] = checkpoint.acks

    def _finish(self, checkpoint: Checkpoint) -> None:
        if self.running is not checkpoint:
            raise RuntimeError("not the running checkpoint")
        self.running = None

    def safe_offsets(self) -> dict[int, int]:
        """Per partition, the offset a restarted consumer must resume from: the oldest
        one not yet checkpointed, else one past the newest checkpointed."""
        safe = dict(self._next)
        for partition, offsets in self._pending.items():
            if offsets:
                safe[partition] = min(offsets)
        return safe

    def revoked(self, partitions: Iterable[int]) -> None:
        """Partitions moved away: forget their pending offsets (their messages will be
        consumed again by the new owner from its committed offset)."""
        for partition in partitions:
            self._pending.pop(partition, None)
            self._next.pop(partition, None)
