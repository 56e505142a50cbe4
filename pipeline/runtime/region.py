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
import contextlib
import heapq
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol

import orjson

from edge_cache import Delete, Upsert
from pipeline.exceptions import PoisonEventError, SinkUnavailableError, StateStoreError
from pipeline.features import EntityState, FeatureEngine
from pipeline.messages import RegionalChange, decode_pack
from pipeline.metrics import PipelineMetrics
from pipeline.runtime.batch import BatchPolicy, RegionBatch, SnapshotLane, Touched
from pipeline.runtime.ledger import Checkpoint, CheckpointLedger, Delivery
from pipeline.runtime.states import StateCache

__all__ = [
    "Acker",
    "CacheSink",
    "ChangelogSink",
    "DeadLetterSink",
    "LocalStore",
    "RegionRuntime",
    "renewal_due",
]

log = logging.getLogger("edgefeed.pipeline")

CHECKPOINT_SLICE = 16  # entity states written between yields to the event loop
RETRY_FIRST_S, RETRY_MAX_S = 0.1, 2.0  # backoff while the cache is unavailable
INTACT_CHECK_S = 5.0  # how often the worker checks that its cache kept its data
IDLE_TICK_S = 1.0  # longest sleep of the duty loop (wait_for_duty)
REFILL_SLICE = 500  # vectors per write when refilling a cache that lost its data
RENEW_SLICE = 500  # vectors per write when renewing schedules that ran out


class CacheSink(Protocol):
    """The region's feature cache."""

    async def write(
        self, ops: Sequence[Upsert | Delete], now_us: int, *, freshness: bool = True
    ) -> Sequence[bool]:
        """Write the ops (position-checked) and, with ``freshness``, the freshness of
        their entity types in one round trip; per op, whether it was applied. (Vectors
        written again, renewed or refilled, are not news: no freshness.)

        Raises:
            SinkUnavailableError: the cache did not answer (retried by the caller).
            ValueError: a value the cache refuses (the caller quarantines its entity).
        """
        ...

    async def quarantine(self, quarantined: Mapping[str, str], released: Sequence[str]) -> None:
        """List entities whose vectors cannot be written (key -> why), take released
        ones off the list: what ``edgefeed lag`` and the exporter show.

        Raises:
            SinkUnavailableError: the cache did not answer (the next flush tries again).
        """
        ...

    async def rebuilding(self, marks: Mapping[str, str | None]) -> None:
        """List (a value) or take off the list (None) the rebuilds of entity types in
        progress, field ``<entity>|<partition>``: what ``edgefeed lag``, the exporter
        and the lookup client read (pipeline.history).

        Raises:
            SinkUnavailableError: the cache did not answer (retried by the caller).
        """
        ...

    async def intact(self) -> bool:
        """False when the cache lost what the worker wrote (a restart without
        persistence): the worker then writes every vector again.

        Raises:
            SinkUnavailableError: the cache did not answer.
        """
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


class LocalStore(Protocol):
    """The worker's states on local disk (pipeline.localstore.LocalStates): what the
    changelog holds up to a saved offset, per partition, with the renewal index."""

    def load(self, key: str, partition: int) -> EntityState | None:
        """The entity's state as stored (None: none)."""
        ...

    def due(
        self, partition: int, after: bytes | None, now_us: int, limit: int
    ) -> list[tuple[int, str, bytes]]:
        """Renewal index entries due by ``now_us`` after ``after``: (until, key, index key)."""
        ...

    def entity_keys(self, partition: int) -> Iterator[str]:
        """Every entity stored for ``partition``."""
        ...

    def check(self) -> None:
        """Raise StateStoreError unless the store takes writes again."""
        ...


def renewal_due(engine: FeatureEngine, key: str, record: Mapping[str, Any]) -> int | None:
    """When the vector of the entity whose record is ``record`` must be written
    again (microseconds; 0: at once), None: not before it changes. At once: a
    state that went ahead of the vector the cache holds (``wrev`` is not its
    ``rev``), or that was written under another feature-set version."""
    try:
        version = engine.engine(key.split(":", 1)[0]).schema.version
    except Exception:  # an entity type no longer declared: nothing to write
        return None
    if record.get("wrev") != record.get("rev") or record.get("v") != version:
        return 0
    until = record.get("until")
    return until if isinstance(until, int) else None


class _Loader:
    def __init__(self, store: LocalStore, partition_of: Callable[[str], int]) -> None:
        self.store, self.partition_of = store, partition_of

    def load(self, key: str) -> EntityState | None:
        return self.store.load(key, self.partition_of(key))


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
        wall: Seconds since the epoch: the read time vectors are written as of, and
            when their schedules run out (tests pass a fake).
        store: The states on local disk (None: every state in memory, recovered
            whole from the changelog).
        memory_bytes: With ``store``: the estimated memory of the states kept in
            memory, above which the least recently used clean ones are dropped
            (read again from the store when needed).
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
        wall: Callable[[], float] = time.time,
        store: LocalStore | None = None,
        memory_bytes: int | None = None,
    ) -> None:
        self.region = region
        self.store = store
        self.wall = wall
        self.engine = engine
        self.partition_of = partition_of
        self.cache, self.changelog = cache, changelog
        self.dead_letters, self.acker = dead_letters, acker
        self.batch = RegionBatch(policy or BatchPolicy())
        self.lane = SnapshotLane(self.batch.policy.lane_s, self.batch.policy.max_changes)
        self.clock = clock
        # The first checkpoint comes one interval after the start, like every other.
        # With a store, changed bookkeeping (a vector renewed) is checkpointed too.
        self.ledger = CheckpointLedger(
            checkpoint_interval_s, last_at=clock(), states_alone=store is not None
        )
        self.live = StateCache(
            _Loader(store, partition_of) if store is not None else None, memory_bytes
        )
        # With a store: partition -> the last renewal index entry read (None: none).
        self._cursors: dict[int, bytes | None] = {}
        self.store_error: BaseException | None = None  # the last failed local write
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
        self._non_finite = metrics.non_finite.labels(region)
        self._cache_up = metrics.cache_up.labels(region)
        self._cache_up.set(1)
        self._retries = metrics.cache_retries.labels(region)
        self._quarantine_gauge = metrics.quarantined.labels(region)
        self._refills = metrics.cache_refills.labels(region)
        # Entity key -> why its vector cannot be written; its changes still apply to
        # the state (so it is right once the cause is fixed), its writes are skipped.
        self.quarantined: dict[str, str] = {}
        # What the cache's quarantine list still lacks: keys to list, keys to release.
        self._to_list: set[str] = set()
        self._to_release: set[str] = set()
        self._next_intact_check = clock() + INTACT_CHECK_S
        self._wake = asyncio.Event()  # set: the next duty may be earlier than thought
        self.retry_first_s, self.retry_max_s = RETRY_FIRST_S, RETRY_MAX_S
        self._written = {
            flag: metrics.cache_writes.labels(region, str(flag).lower()) for flag in (True, False)
        }
        # Windows read as of the read time: each written vector carries its schedule up
        # to ``until``; by then the vector is written again (renewed). Entity key ->
        # the until of its last write, and a heap of (until, key) (stale entries are
        # skipped when popped).
        self._renew_at: dict[str, int] = {}
        self._renewals: list[tuple[int, str]] = []
        self._renewed = metrics.renewals.labels(region)
        self._renewal_lag = metrics.renewal_lag.labels(region)
        self._held = metrics.held.labels(region)
        # Partition -> (the offset after the newest message taken, the source commit
        # time in ms of the newest change in it; 0: none yet) since the last recovery:
        # what the readiness probe compares with the log's end (pipeline.probes).
        self.progress: dict[int, tuple[int, int]] = {}
        self._next_store_due = 0.0  # when the store's renewal index is read next

    # -- recovery ------------------------------------------------------------------------------

    def recovered(self, states: Mapping[str, EntityState]) -> None:
        """The working states after a (re)assignment, rebuilt from the changelog.

        Each entity record keeps the revision of the state whose vector the cache
        holds (``wrev``) and when that vector's schedule runs out (``until``). An
        entity whose recovered state is that one is renewed at its ``until``, as a
        running worker would, not rewritten now. Written now: entities whose state
        went ahead of the cache (a checkpoint stores the state as it stands, and
        changes of a batch or lane not yet written may be in it: replayed, they are
        no-ops, so nothing else would write them), whose record lacks the two
        fields, or that were written under another feature-set version. Whether the
        cache lost its data while the worker was down is checked at once (a lost
        cache is refilled whole).
        """
        self.live.clear()
        self.live.update(states)
        self.progress.clear()
        self.batch.reassigned()
        self._renew_at.clear()
        now_us = self._now_us()
        for key, state in self.live.items():
            engine = self.engine.engine(key.split(":", 1)[0])
            until = state.get("until")
            if state.get("wrev") != state.get("rev") or state.get("v") != engine.schema.version:
                self._renew_at[key] = now_us
            elif isinstance(until, int):
                self._renew_at[key] = max(now_us, until)
        self._renewals = [(until, key) for key, until in self._renew_at.items()]
        heapq.heapify(self._renewals)
        self._next_intact_check = self.clock()
        self._wake.set()

    def resumed(self, partitions: Sequence[int]) -> None:
        """After a (re)assignment, with a store: the states of ``partitions`` are on
        local disk up to the changelog's end; nothing is read now. Each is read
        when a change or a renewal first needs it; what is due (the renewal index,
        pipeline.localstore) is found by range reads from its start."""
        self.live.clear()
        self.progress.clear()
        self.batch.reassigned()
        self._renew_at.clear()
        self._renewals = []
        self._cursors = dict.fromkeys(sorted(partitions))
        self._next_store_due = 0.0
        self._next_intact_check = self.clock()
        self._wake.set()

    # -- messages ------------------------------------------------------------------------------

    async def on_message(self, delivery: Delivery, value: bytes) -> None:
        """Apply one regional message (a pack of changes, or one change)."""
        if self.store_error is not None:
            await self._until_store_writable()
        if self.live.over:
            await self._until_dirty_stored()
            if self.store_error is not None:  # a checkpoint met a full disk meanwhile
                await self._until_store_writable()
        self.ledger.received(delivery)
        if self.batch.opened_at is None:
            self._wake.set()  # a batch opens: its due time is the next duty
        try:
            entries, is_pack = decode_pack(value)
        except PoisonEventError as exc:
            self.batch.add(delivery, 0, self.clock())
            await self._dead_letter(delivery, value, exc, None)
            entries, is_pack = [], False
        else:
            self.batch.add(delivery, len(entries), self.clock())
        _, newest_ms = self.progress.get(delivery.partition, (0, 0))
        for index, entry in enumerate(entries):
            try:
                change = RegionalChange.from_wire(entry)
                if change.commit_ms > newest_ms:
                    newest_ms = change.commit_ms
                if change.op == "h":
                    await self._history_marker(change, delivery)
                    continue
                await self._apply_stored(change, delivery)
            except Exception as exc:
                # PoisonEventError for a bad change; anything else is a bug this change
                # met: dead-lettered with the reason, never a crash (a crash would
                # replay the same change after every restart).
                if not isinstance(exc, PoisonEventError):
                    log.exception("worker failed on %s@%s", delivery.partition, delivery.offset)
                    exc = PoisonEventError("worker-error", f"{type(exc).__name__}: {exc}")
                await self._dead_letter(
                    delivery, _encode_entry(entry), exc, index if is_pack else None
                )
        self.progress[delivery.partition] = (delivery.offset + 1, newest_ms)
        if self.batch.due(self.clock()):
            await self.flush()

    async def _apply_stored(self, change: RegionalChange, delivery: Delivery) -> None:
        """Apply ``change``; a state the local store cannot read is waited for (the
        change is never dead-lettered for the disk's fault)."""
        while True:
            try:
                self._apply(change, delivery)
                return
            except StateStoreError as exc:
                self._store_failed(exc)
                await self._until_store_writable()

    def _store_failed(self, exc: StateStoreError) -> None:
        if self.store_error is None:
            log.error("region %s: %s", self.region, exc)
        self.store_error = exc

    def _apply(self, change: RegionalChange, delivery: Delivery) -> None:
        if change.op == "t":
            self._truncate(change, delivery)
            return
        entity = self.engine.engine(change.entity)
        key = change.key or ""
        non_finite = entity.non_finite
        new_state, changed = entity.apply(self.live.get(key), change)
        if entity.non_finite != non_finite:
            self._non_finite.inc(entity.non_finite - non_finite)
        if changed and new_state is not None:
            self.live[key] = new_state
            self.batch.touch(
                key,
                Touched(change.entity, change.entity_id, delivery, new_state),
                snapshot_read=change.op == "r",
            )
            self._applied.inc()
        else:
            self._duplicates.inc()

    async def _history_marker(self, change: RegionalChange, delivery: Delivery) -> None:
        """A history rebuild of ``change.table`` begins or ends (pipeline.history): the
        entity types it feeds are listed as rebuilding in the cache until the end
        marker, which the router sends after the rebuild's rows on this partition;
        those rows are written before the listing ends."""
        row = change.row or {}
        begin = row.get("state") == "begin"
        await self.flush(lane=True)  # what came before the marker is in the cache first
        value = orjson.dumps(
            {"id": row.get("id"), "table": change.table, "at_ms": change.commit_ms}
        ).decode()
        marks = {f"{e}|{delivery.partition}": value if begin else None for e in row["entities"]}
        delay = self.retry_first_s
        while True:
            try:
                await self.cache.rebuilding(marks)
                break
            except SinkUnavailableError as exc:
                log.warning("region %s: cache unavailable (%s); retrying", self.region, exc)
                await asyncio.sleep(delay)
                delay = min(self.retry_max_s, delay * 2)
        log.warning(
            "region %s: history rebuild %s of %s %s on partition %d (%s)",
            self.region,
            row.get("id"),
            change.table,
            "begins" if begin else "ended",
            delivery.partition,
            ", ".join(row["entities"]),
        )

    def _truncate(self, change: RegionalChange, delivery: Delivery) -> None:
        for key in self._keys(delivery.partition):
            # The router sends a truncate to every partition; each copy handles only
            # the entities of its own partition.
            if self.partition_of(key) != delivery.partition:
                continue
            current = self.live.get(key)
            if current is None:
                continue
            entity_type, entity_id = key.split(":", 1)
            if self.engine.engine(entity_type).truncate(current, change):
                self.live[key] = current
                self.batch.touch(key, Touched(entity_type, entity_id, delivery, current))

    def _keys(self, partition: int | None = None) -> Iterator[str]:
        """The entity keys of ``partition`` (None: of all), stored or in memory only
        (new since the last checkpoint); a key may come twice."""
        if self.store is None:
            yield from [
                k for k in self.live if partition is None or self.partition_of(k) == partition
            ]
            return
        dirty = [k for k in self.live if self.live.generation(k) is not None]
        for p in sorted(self._cursors) if partition is None else [partition]:
            yield from self.store.entity_keys(p)
        yield from (k for k in dirty if partition is None or self.partition_of(k) == partition)

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
        """Close a batch no further message will close (the stream went quiet),
        checkpoint once the interval has passed, and now and then check that the cache
        still holds what was written."""
        try:
            await self._tick()
        except StateStoreError as exc:  # a renewal or a refill could not read a state
            self._store_failed(exc)

    async def _tick(self) -> None:
        now = self.clock()
        if self.batch.due(now) or self._checkpoint_due(now) or self.lane.due(now):
            await self.flush()
        if self._renewals and self._renewals[0][0] <= self._now_us():
            await self.renew()
        elif self.store is not None and now >= self._next_store_due:
            self._next_store_due = now + IDLE_TICK_S
            # Renewals dirty the states they write (their schedules): a slice at a
            # time while the memory budget has room for them.
            while await self.renew() >= RENEW_SLICE and not self.live.over:
                pass
        if now >= self._next_intact_check:
            if self._flush_lock.locked():  # a write is retrying: ask again soon
                self._next_intact_check = now + IDLE_TICK_S
            else:
                self._next_intact_check = now + INTACT_CHECK_S
                await self.check_cache()

    def seconds_to_duty(self) -> float:
        """How long :meth:`tick` has nothing to do: until the open batch falls due, the
        next checkpoint, or the next cache check, and at most :data:`IDLE_TICK_S`."""
        now = self.clock()
        times = [self._next_intact_check, now + IDLE_TICK_S]
        checkpoint_at = None if self._checkpoint_pending() else self.ledger.due_at()
        times += [
            t for t in (self.batch.due_at(), checkpoint_at, self.lane.due_at()) if t is not None
        ]
        if self._renewals:
            times.append(now + (self._renewals[0][0] - self._now_us()) / 1e6)
        return max(0.0, min(times) - now)

    def _checkpoint_pending(self) -> bool:
        """A checkpoint task was started and has not ended (it may not have begun: the
        ledger shows it running only once it has)."""
        return self._checkpoint_task is not None and not self._checkpoint_task.done()

    def _checkpoint_due(self, now: float) -> bool:
        if self._checkpoint_pending():
            return False
        # With a store: dirty states over their share of the memory budget are
        # checkpointed at once (they cannot be evicted before), not at the interval.
        return self.ledger.due(now) or (self.live.full and self.ledger.due_at() is not None)

    async def wait_for_duty(self) -> None:
        """Sleep until :meth:`tick` has something to do, or a message or a flush changed
        when that is (an idle worker wakes once a second, not once per batch window)."""
        delay = self.seconds_to_duty()
        if delay > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay)
        self._wake.clear()

    async def check_cache(self) -> bool:
        """Refill the cache if it lost its data; True if it had to."""
        async with self._flush_lock:
            try:
                if await self.cache.intact():
                    return False
            except SinkUnavailableError:
                return False  # the next write retries; the next check asks again
            log.warning(
                "region %s: the cache lost its data; writing every vector again", self.region
            )
            self._refills.inc()
            keys: list[str] = []
            for key in self._keys():
                if key not in self.quarantined:
                    keys.append(key)
                if len(keys) >= REFILL_SLICE:
                    await self._refill(keys)
                    keys = []
            await self._refill(keys)
            self._to_list.update(self.quarantined)  # the list went with the data
            await self._report_quarantine()
            return True

    async def _refill(self, keys: list[str]) -> None:
        ops: list[Upsert | Delete] = []
        written: list[str] = []
        for key in keys:
            state = self.live.get(key)
            if state is None:
                continue
            entity_type, entity_id = key.split(":", 1)
            ops.append(self.engine.engine(entity_type).write_op(entity_id, state, self._now_ms()))
            written.append(key)
        if ops:
            await self._write(ops, written, again=True)

    async def flush(self, *, lane: bool = False) -> None:
        """Write the open batch's vectors to the cache (those of entities only snapshot
        reads changed go to the lane), the lane's once it is due (or with ``lane``),
        then start a checkpoint if due."""
        async with self._flush_lock:
            closed = self.batch.close()
            if closed.deliveries:
                started = time.perf_counter()
                later = {key: closed.touched.pop(key) for key in closed.read_only}
                self.lane.superseded(closed.touched)  # written now, with newer states
                if later:
                    # The batch's messages are acked once the lane's vectors are written.
                    self.lane.hold(later, closed.deliveries, self.clock())
                await self._write_touched(closed.touched, [] if later else closed.deliveries)
                elapsed = time.perf_counter() - started
                self.batch.flushed(elapsed)
                self._batch_sizes.observe(closed.changes)
                self._batch_seconds.observe(elapsed)
                self._wake.set()  # messages await a checkpoint: its due time changed
            if lane or self.lane.due(self.clock()):
                touched, deliveries = self.lane.take()
                if deliveries:
                    await self._write_touched(touched, deliveries)
                    self._wake.set()
            await self._report_quarantine()
            if self._checkpoint_due(self.clock()) and not self._checkpoint_lock.locked():
                # One task at a time: until the task begins, the ledger still shows the
                # checkpoint due, and a duty loop that started one per tick never
                # yielded to the event loop (it spun until the next cache check, up
                # to INTACT_CHECK_S, stalling the stream).
                task = asyncio.ensure_future(self._checkpoint_or_fail())
                task.add_done_callback(lambda _task: self._wake.set())
                self._checkpoint_task = task

    async def _write_touched(
        self, touched: Mapping[str, Touched], deliveries: Sequence[Delivery]
    ) -> None:
        """Write the vectors of ``touched`` and hand the ledger their states and
        ``deliveries`` (the messages whose changes are all in the cache now)."""
        ops: list[Upsert | Delete] = []
        keys: list[str] = []
        states: list[tuple[str, Delivery, EntityState]] = []
        retry: list[tuple[Upsert | Delete, str]] = []
        now_ms = self._now_ms()
        for key, entry in touched.items():
            states.append((key, entry.delivery, entry.state))
            op = self.engine.engine(entry.entity).write_op(entry.entity_id, entry.state, now_ms)
            if key in self.quarantined:
                retry.append((op, key))  # alone: its failure must not slow the rest
                continue
            ops.append(op)
            keys.append(key)
        if ops:
            await self._write(ops, keys)
        for op, key in retry:  # a change may have cured it
            await self._write([op], [key])
        # In the cache now: the states await the changelog, the messages an ack.
        self.ledger.written(deliveries, states)

    async def _write(
        self, ops: list[Upsert | Delete], keys: list[str], *, again: bool = False
    ) -> None:
        """Write ``ops`` (of entities ``keys``): retried while the cache is unavailable;
        an entity whose value the cache refuses is quarantined, the rest written.
        ``again``: vectors written before (renewed or refilled), not news of the source."""
        try:
            await self._write_retrying(ops, again)
        except (ValueError, TypeError, OverflowError) as exc:
            if len(ops) == 1:
                self._quarantine(keys[0], exc)
                return
            # Find the entities at fault: each op alone (writes are position-checked,
            # so writing the good ones again changes nothing).
            for op, key in zip(ops, keys, strict=True):
                await self._write([op], [key], again=again)
            return
        self._schedule_renewals(ops, keys)
        for key in keys:
            if self.quarantined.pop(key, None) is not None:
                log.warning(
                    "region %s: entity %s written again, out of quarantine", self.region, key
                )
                self._to_list.discard(key)
                self._to_release.add(key)
                self._quarantine_gauge.set(len(self.quarantined))

    # -- renewals (windows read as of the read time) -----------------------------------------

    def _now_us(self) -> int:
        return int(self.wall() * 1_000_000)

    def _now_ms(self) -> int:
        return int(self.wall() * 1000)

    def _schedule_renewals(self, ops: Sequence[Upsert | Delete], keys: Sequence[str]) -> None:
        for op, key in zip(ops, keys, strict=True):
            schedule = op.schedule if isinstance(op, Upsert) else None
            until = schedule.until_us if schedule is not None else None
            state = self.live.get(key)
            if state is not None:
                # Kept in the entity record: after a restart, a vector the cache holds
                # is renewed when its schedule runs out, not rewritten at once.
                if self.store is not None and (
                    state.get("wrev") != op.position.seq or state.get("until") != until
                ):
                    # On disk, the record is the schedule (the renewal index): it
                    # goes to the next checkpoint, and stays in memory until then.
                    self.live.changed(key)
                    self.ledger.changed(key, Delivery(self.partition_of(key), -1), state)
                state["wrev"] = op.position.seq  # the revision this vector is of
                state["until"] = until  # None: its schedule never runs out
            if until is None:
                self._renew_at.pop(key, None)
                continue
            if self._renew_at.get(key) != until:
                self._renew_at[key] = until
                heapq.heappush(self._renewals, (until, key))
        if len(self._renewals) > 2 * len(self._renew_at) + 1000:  # drop stale entries
            self._renewals = [(until, key) for key, until in self._renew_at.items()]
            heapq.heapify(self._renewals)

    async def renew(self) -> int:
        """Write again the vectors whose schedules ran out (at most :data:`RENEW_SLICE`
        per call), each with its next schedule; how many were written."""
        async with self._flush_lock:
            now_us = self._now_us()
            ops: list[Upsert | Delete] = []
            keys: list[str] = []
            untils: list[int] = []
            while self._renewals and self._renewals[0][0] <= now_us and len(ops) < RENEW_SLICE:
                until, key = heapq.heappop(self._renewals)
                if self._renew_at.get(key) != until:
                    continue  # written since, with a later schedule
                del self._renew_at[key]
                state = self.live.get(key)
                if state is None or key in self.quarantined:
                    continue
                entity_type, entity_id = key.split(":", 1)
                ops.append(
                    self.engine.engine(entity_type).write_op(entity_id, state, now_us // 1000)
                )
                keys.append(key)
                untils.append(until)
            if self.store is not None:
                self._due_from_store(now_us, ops, keys, untils)
            if ops:
                await self._write(ops, keys, again=True)
                self._renewed.inc(len(ops))
                # the lag ends when the renewal is in the cache, not when it was computed
                written_us = self._now_us()
                for until in untils:
                    self._renewal_lag.observe(max(0.0, (written_us - until) / 1e6))
            return len(ops)

    def _due_from_store(
        self, now_us: int, ops: list[Upsert | Delete], keys: list[str], untils: list[int]
    ) -> None:
        """Add to ``ops`` the renewals the store's index says are due (up to the slice),
        skipping entries that no longer hold: the entity changed since (its state in
        memory decides), or its vector is written by other means."""
        assert self.store is not None
        for partition, cursor in list(self._cursors.items()):
            room = RENEW_SLICE - len(ops)
            if room <= 0:
                return
            for until, key, index_key in self.store.due(partition, cursor, now_us, room):
                self._cursors[partition] = index_key
                if key in self._renew_at or key in self.quarantined or key in keys:
                    continue  # scheduled in memory since (the newer schedule)
                if self.live.generation(key) is not None:
                    continue  # changed: its batch writes it, its checkpoint indexes it
                state = self.live.get(key)
                if state is None or renewal_due(self.engine, key, state) != until:
                    continue  # an entry its next checkpoint removes
                entity_type, entity_id = key.split(":", 1)
                ops.append(
                    self.engine.engine(entity_type).write_op(entity_id, state, now_us // 1000)
                )
                keys.append(key)
                untils.append(until)

    def _quarantine(self, key: str, exc: BaseException) -> None:
        reason = f"{type(exc).__name__}: {exc}"
        state = self.live.get(key)
        # Its vector is not in the cache: written after a restart.
        if state is not None and state.pop("wrev", None) is not None and self.store is not None:
            self.live.changed(key)
            self.ledger.changed(key, Delivery(self.partition_of(key), -1), state)
        if key not in self.quarantined:
            log.error("region %s: entity %s quarantined: %s", self.region, key, reason)
        self.quarantined[key] = reason[:500]
        self._to_list.add(key)
        self._to_release.discard(key)
        self._quarantine_gauge.set(len(self.quarantined))

    async def _report_quarantine(self) -> None:
        """Bring the cache's quarantine list up to date (best effort: a cache that does
        not answer gets it at the next flush)."""
        if not self._to_list and not self._to_release:
            return
        listed = {key: self.quarantined[key] for key in self._to_list if key in self.quarantined}
        released = sorted(self._to_release)
        try:
            await self.cache.quarantine(listed, released)
        except SinkUnavailableError:
            return
        self._to_list.difference_update(listed)
        self._to_release.difference_update(released)

    async def _write_retrying(self, ops: list[Upsert | Delete], again: bool = False) -> None:
        delay = self.retry_first_s
        while True:
            try:
                await self._write_once(ops, again)
            except SinkUnavailableError as exc:
                # Nothing of this batch is acked until it is written: the stream
                # waits here (the consumer pauses) and resumes where it was.
                self._cache_up.set(0)
                self._retries.inc()
                log.warning(
                    "region %s: cache unavailable (%s); retrying in %.1f s", self.region, exc, delay
                )
                await asyncio.sleep(delay)
                delay = min(self.retry_max_s, delay * 2)
                continue
            self._cache_up.set(1)
            return

    async def _write_once(self, ops: list[Upsert | Delete], again: bool = False) -> None:
        started = time.perf_counter()
        now_us = int(time.time() * 1_000_000)
        applied = await self.cache.write(ops, now_us, freshness=not again)
        self._write_seconds.observe(time.perf_counter() - started)
        now_s = now_us / 1e6
        for op, written in zip(ops, applied, strict=True):
            self._written[bool(written)].inc()
            if written and not again:
                self._freshness.observe(max(0.0, now_s - commit_seconds(op)))

    # -- checkpoints ---------------------------------------------------------------------------

    async def _checkpoint_or_fail(self) -> None:
        try:
            await self.checkpoint()
        except StateStoreError as exc:
            # A full disk: stop consuming (on_message waits) and retry, acking
            # nothing meanwhile; a restart would only meet the same disk.
            self._store_failed(exc)
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
            self._wake.set()  # the next checkpoint's due time is known now

    async def _store(self, checkpoint: Checkpoint) -> None:
        states = checkpoint.states
        generations: list[tuple[str, int | None]] = []
        for start in range(0, len(states), CHECKPOINT_SLICE):
            for key, delivery, state in states[start : start + CHECKPOINT_SLICE]:
                self.engine.engine(key.split(":", 1)[0]).prune(state)
                generations.append((key, self.live.generation(key)))
                self.changelog.store(key, state, delivery)
            await self.changelog.relieve()
            await asyncio.sleep(0)
        if states:
            await self.changelog.close(checkpoint.partitions)
        if self.store is not None:
            # On disk now: clean again unless changed since; a schedule the store's
            # index holds (ahead of what its reads have passed) leaves memory.
            # Looked at before the states are made evictable (a state evicted and
            # read back here would cost a load per entity of the checkpoint).
            now_us = self._now_us()
            for key, generation in generations:
                until = self._renew_at.get(key)
                state = self.live.peek(key) if until is not None else None
                if (
                    until is not None
                    and until > now_us
                    and state is not None
                    and self.live.generation(key) == generation
                    and state.get("until") == until
                ):
                    del self._renew_at[key]  # its heap entry is skipped as stale
            self.live.stored(generations)

    async def _until_dirty_stored(self) -> None:
        """Backpressure: the changed states, not yet stored, fill the memory budget
        (the stream came faster than checkpoints stored it). Take no message until
        checkpoints stored them, by the checkpoint's own path (the broker's acks,
        then the store): a dirty state is never dropped, and the estimate passes the
        budget by one message's changes at most."""
        started = time.perf_counter()
        log.info("region %s: changed states fill the memory budget; checkpointing", self.region)
        while self.live.over and self.store_error is None:
            before = self.live.dirty_weight
            # The open batch and the lane to the cache: every dirty state is then in
            # the ledger, and a checkpoint starts (it is due: the cache is full).
            await self.flush(lane=True)
            task = self._checkpoint_task
            if task is not None and not task.done():
                await asyncio.wait([task])
                if task.cancelled() or task.exception() is not None:
                    break  # the worker stops (on_fatal); waiting would not end
            elif self._checkpoint_lock.locked():  # one called directly (a revoke)
                async with self._checkpoint_lock:
                    pass
            if self.live.dirty_weight >= before:
                # Nothing a checkpoint could store (a bug): go on rather than hang.
                log.warning("region %s: changed states over the memory budget", self.region)
                break
        self._held.inc(time.perf_counter() - started)

    async def _until_store_writable(self) -> None:
        """Wait, consuming nothing, until a checkpoint reaches the local store again
        (retried with backoff; logged once per minute)."""
        delay = self.retry_first_s
        logged = self.clock()
        while self.store_error is not None:
            await asyncio.sleep(delay)
            delay = min(self.retry_max_s * 5, delay * 2)
            if self._checkpoint_pending():
                continue
            try:
                if self.store is not None:
                    self.store.check()
                await self.flush()
                await self.checkpoint()
            except StateStoreError as exc:
                if self.clock() - logged >= 60:
                    logged = self.clock()
                    log.error("region %s: still waiting for the state store: %s", self.region, exc)
                continue
            log.warning("region %s: the state store is writable again", self.region)
            self.store_error = None

    async def on_revoke(self) -> None:
        """Before partitions move: write the changed states and ack their messages.

        Every partition is revoked in a rebalance (and most come back): without this,
        redelivered messages would find their changes already in the in-memory
        states, and those states would never reach the changelog.
        """
        await self.flush(lane=True)
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
