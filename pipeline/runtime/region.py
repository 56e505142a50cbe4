"""A regional worker: regional changes in, feature vectors into the region's cache,
entity states into the changelog, acks only for what is stored.

The worker talks to the world through four ports, so that everything here runs
in unit tests without a broker (tests/unit/pipeline/test_runtime.py):

- :class:`CacheSink`: the region's Redis (edge_cache's position-checked writer);
- :class:`ChangelogSink`: the state table's changelog (a Faust table);
- :class:`DeadLetterSink`: where changes that cannot be applied go, with the reason;
- :class:`Acker`: acknowledges consumed messages (Faust commits acked offsets).

Flow: :meth:`RegionRuntime.on_message` applies each change of a pack to the
in-memory states and adds the message to the open batch; when the batch is due
(:class:`~pipeline.runtime.batch.RegionBatch`) :meth:`RegionRuntime.flush`
writes the touched entities' vectors in one pipelined round trip and hands the
batch to the ledger; once per checkpoint interval :meth:`RegionRuntime.checkpoint`
writes the changed states to the changelog and only then acks the messages
behind them (:class:`~pipeline.runtime.ledger.CheckpointLedger`). A restarted
worker recovers the states of its last checkpoint and replays what came after,
idempotently (every state change carries its source position).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime
from typing import Protocol

import orjson

from edge_cache import Delete, Upsert
from pipeline.exceptions import PoisonEventError
from pipeline.features import EntityState, FeatureEngine
from pipeline.messages import RegionalChange, decode_pack
from pipeline.metrics import PipelineMetrics
from pipeline.runtime.batch import BatchPolicy, RegionBatch, Touched
from pipeline.runtime.ledger import Checkpoint, CheckpointLedger, Delivery

__all__ = ["Acker", "CacheSink", "ChangelogSink", "DeadLetterSink", "RegionRuntime"]

log = logging.getLogger("edgefeed.pipeline")

CHECKPOINT_SLICE = 16  # entity states written between yields to the event loop


class CacheSink(Protocol):
    """The region's feature cache."""

    async def write(self, ops: Sequence[Upsert | Delete], now_us: int) -> Sequence[bool]:
        """Write the ops (position-checked) and the freshness of their entity types in one
        round trip; per op, whether it was applied."""
        ...


class ChangelogSink(Protocol):
    """The changelog of the entity states."""

    def store(self, key: str, state: EntityState, delivery: Delivery) -> None:
        """Queue the entity's changed records for the partition of ``delivery``."""
        ...

    async def relieve(self) -> None:
        """Let the producer catch up with what was queued (between slices)."""
        ...

    async def close(self, partitions: Mapping[int, Delivery]) -> None:
        """Make what was queued durable and mark each partition's checkpoint end."""
        ...


class DeadLetterSink(Protocol):
    async def send(
        self, delivery: Delivery, value: bytes, reason: str, error: str, index: int | None
    ) -> None:
        """Dead-letter ``value`` (a message, or one change of a pack at ``index``)."""
        ...


class Acker(Protocol):
    async def ack(self, delivery: Delivery) -> None: ...


class RegionRuntime:
    """One regional worker's processing, independent of Faust.

    Args:
        region: The region's name (metrics, logs).
        app_id: The worker's app id (metrics).
        engine: The feature engines.
        partition_of: Entity key -> the regional partition the router sends it to.
        cache, changelog, dead_letters, acker: The ports.
        metrics: Where to count.
        policy: Batching policy.
        checkpoint_interval_s: Time between checkpoints.
        on_fatal: Called when a checkpoint fails (the worker must not go on
            without its changelog); Faust's ``app.crash``.
        clock: Monotonic seconds (tests pass a fake).
    """

    def __init__(
        self,
        *,
        region: str,
        app_id: str,
        engine: FeatureEngine,
        partition_of: Callable[[str], int],
        cache: CacheSink,
        changelog: ChangelogSink,
        dead_letters: DeadLetterSink,
        acker: Acker,
        metrics: PipelineMetrics,
        policy: BatchPolicy | None = None,
        checkpoint_interval_s: float = 1.0,
        on_fatal: Callable[[BaseException], Awaitable[None]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.region = region
        self.engine = engine
        self.partition_of = partition_of
        self.cache, self.changelog = cache, changelog
        self.dead_letters, self.acker = dead_letters, acker
        self.batch = RegionBatch(policy or BatchPolicy())
        self.clock = clock
        # The first checkpoint comes one interval after the start, like every other.
        self.ledger = CheckpointLedger(checkpoint_interval_s, last_at=clock())
        self.live: dict[str, EntityState] = {}
        self.on_fatal = on_fatal
        self._flush_lock = asyncio.Lock()
        self._checkpoint_lock = asyncio.Lock()
        self._checkpoint_task: asyncio.Future[None] | None = None
        self._metrics = metrics
        self._applied = metrics.events.labels(app_id, "applied")  # changes, not messages
        self._duplicates = metrics.events.labels(app_id, "duplicate")
        self._dead = metrics.dead_letters
        self._app_id = app_id
        self._batch_sizes = metrics.batch_size.labels(app_id)
        self._batch_seconds = metrics.batch_seconds.labels(app_id)
        self._write_seconds = metrics.write_seconds.labels(region)
        self._freshness = metrics.freshness.labels(region)
        self._written = {
            flag: metrics.cache_writes.labels(region, str(flag).lower()) for flag in (True, False)
        }

    # -- recovery ------------------------------------------------------------------------------

    def recovered(self, states: Mapping[str, EntityState]) -> None:
        """The working states after a (re)assignment, rebuilt from the changelog."""
        self.live.clear()
        self.live.update(states)

    # -- messages ------------------------------------------------------------------------------

    async def on_message(self, delivery: Delivery, value: bytes) -> None:
        """Apply one regional message (a pack of changes, or one change)."""
        self.ledger.received(delivery)
        try:
            entries, is_pack = decode_pack(value)
        except PoisonEventError as exc:
            self.batch.add(delivery, 0, self.clock())
            await self._dead_letter(delivery, value, exc, None)
            entries, is_pack = [], False
        else:
            self.batch.add(delivery, len(entries), self.clock())
        for index, entry in enumerate(entries):
            try:
                self._apply(RegionalChange.from_wire(entry), delivery)
            except (PoisonEventError, ValueError, KeyError, TypeError, OverflowError) as exc:
                await self._dead_letter(
                    delivery, _encode_entry(entry), exc, index if is_pack else None
                )
        if self.batch.due(self.clock()):
            await self.flush()

    def _apply(self, change: RegionalChange, delivery: Delivery) -> None:
        if change.op == "t":
            self._truncate(change, delivery)
            return
        entity = self.engine.engine(change.entity)
        key = change.key or ""
        new_state, changed = entity.apply(self.live.get(key), change)
        if changed and new_state is not None:
            self.live[key] = new_state
            self.batch.touch(key, Touched(change.entity, change.entity_id, delivery, new_state))
            self._applied.inc()
        else:
            self._duplicates.inc()

    def _truncate(self, change: RegionalChange, delivery: Delivery) -> None:
        for key in list(self.live):
            # The router sends a truncate to every partition; each copy handles only
            # the entities of its own partition.
            if self.partition_of(key) != delivery.partition:
                continue
            current = self.live[key]
            entity_type, entity_id = key.split(":", 1)
            if self.engine.engine(entity_type).truncate(current, change):
                self.batch.touch(key, Touched(entity_type, entity_id, delivery, current))

    async def _dead_letter(
        self, delivery: Delivery, value: bytes, exc: Exception, index: int | None
    ) -> None:
        reason = exc.reason if isinstance(exc, PoisonEventError) else "invalid"
        self._dead.labels(self._app_id, reason).inc()
        where = f"{delivery.partition}@{delivery.offset}" + (
            f"[{index}]" if index is not None else ""
        )
        log.warning("dead-lettered %s: %s", where, exc)
        await self.dead_letters.send(delivery, value, reason, str(exc), index)

    # -- batches -------------------------------------------------------------------------------

    async def tick(self) -> None:
        """Timer: close a batch no further message will close (the stream went quiet),
        and checkpoint once the interval has passed."""
        if self.batch.due(self.clock()) or self.ledger.due(self.clock()):
            await self.flush()

    async def flush(self) -> None:
        """Write the open batch's vectors to the cache, then start a checkpoint if due."""
        async with self._flush_lock:
            closed = self.batch.close()
            if closed.deliveries:
                started = time.perf_counter()
                ops: list[Upsert | Delete] = []
                states: list[tuple[str, Delivery, EntityState]] = []
                for key, touched in closed.touched.items():
                    ops.append(
                        self.engine.engine(touched.entity).write_op(
                            touched.entity_id, touched.state
                        )
                    )
                    states.append((key, touched.delivery, touched.state))
                if ops:
                    await self._write(ops)
                # In the cache now: the states await the changelog, the messages an ack.
                self.ledger.written(closed.deliveries, states)
                elapsed = time.perf_counter() - started
                self.batch.flushed(elapsed)
                self._batch_sizes.observe(closed.changes)
                self._batch_seconds.observe(elapsed)
            if self.ledger.due(self.clock()) and not self._checkpoint_lock.locked():
                self._checkpoint_task = asyncio.ensure_future(self._checkpoint_or_fail())

    async def _write(self, ops: list[Upsert | Delete]) -> None:
        started = time.perf_counter()
        now_us = int(time.time() * 1_000_000)
        applied = await self.cache.write(ops, now_us)
        self._write_seconds.observe(time.perf_counter() - started)
        now_s = now_us / 1e6
        for op, written in zip(ops, applied, strict=True):
            self._written[bool(written)].inc()
            if written:
                self._freshness.observe(max(0.0, now_s - commit_seconds(op)))

    # -- checkpoints ---------------------------------------------------------------------------

    async def _checkpoint_or_fail(self) -> None:
        try:
            await self.checkpoint()
        except Exception as exc:
            log.exception("checkpoint failed")
            if self.on_fatal is None:
                raise
            await self.on_fatal(exc)

    async def checkpoint(self) -> None:
        """What changed to the changelog, then ack the messages behind it.

        Runs beside the stream, a slice of entities at a time, so that it never
        stalls it for long; batches keep flushing to the cache meanwhile, and what
        they change waits for the next checkpoint.
        """
        async with self._checkpoint_lock:
            if self.ledger.running is not None:  # pragma: no cover - the lock prevents it
                return
            checkpoint = self.ledger.begin(self.clock())
            try:
                await self._store(checkpoint)
            except BaseException:
                self.ledger.abort(checkpoint)
                raise
            for delivery in self.ledger.complete(checkpoint):
                await self.acker.ack(delivery)

    async def _store(self, checkpoint: Checkpoint) -> None:
        states = checkpoint.states
        for start in range(0, len(states), CHECKPOINT_SLICE):
            for key, delivery, state in states[start : start + CHECKPOINT_SLICE]:
                self.engine.engine(key.split(":", 1)[0]).prune(state)
                self.changelog.store(key, state, delivery)
            await self.changelog.relieve()
            await asyncio.sleep(0)
        if states:
            await self.changelog.close(checkpoint.partitions)

    async def on_revoke(self) -> None:
        """Before partitions move: write the changed states and ack their messages.

        Every partition is revoked in a rebalance (and most come back): without this,
        redelivered messages would find their changes already in the in-memory
        states, and those states would never reach the changelog.
        """
        await self.flush()
        if self._checkpoint_task is not None and not self._checkpoint_task.done():
            await asyncio.wait([self._checkpoint_task])
        if self.ledger.ready:
            await self.checkpoint()


def commit_seconds(op: Upsert | Delete) -> float:
    """The op's source commit time in seconds since the epoch (0 when unknown)."""
    commit = op.commit_time
    return commit.timestamp() if isinstance(commit, datetime) else float(commit)


def _encode_entry(entry: object) -> bytes:
    try:
        return orjson.dumps(entry)
    except TypeError:
        return repr(entry).encode("utf-8", "replace")
