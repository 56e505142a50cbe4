"""Every place edgefeed works around Faust (faust-streaming 0.15.3), in one module.

Each function names the upstream behaviour it works around. When Faust changes,
this is the file to re-check; nothing else in edgefeed reaches into Faust's
internals.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from typing import Any

import faust
import orjson
from faust.sensors.monitor import Monitor
from faust.serializers import codecs

from pipeline.statestore import EPOCH_HEADER, ChangelogFence

__all__ = [
    "STATE_CODEC",
    "STRICT_TOPICS",
    "FetchWait",
    "LeanMonitor",
    "PartitionWriter",
    "StuckHeads",
    "fence_recovery",
    "partition_offsets",
    "patch_eager_delivery",
    "patch_fetch_wait",
    "patch_recovery_handover",
    "patch_seek_every_partition",
    "patch_strict_commits",
    "record_epoch",
    "register_state_codec",
    "relieve_producer",
    "seek_every_partition",
    "use_state_codec",
    "wait_delivered",
]

STATE_CODEC = "edgefeed-json"

log = logging.getLogger("edgefeed.pipeline")


class _OrjsonCodec(codecs.Codec):
    """JSON through orjson: the entity states in the changelog are large and written
    once per entity per checkpoint, and orjson encodes them about 9x faster than the
    json module."""

    def _dumps(self, obj: Any) -> bytes:
        return orjson.dumps(obj)

    def _loads(self, s: bytes) -> Any:
        return orjson.loads(s)


def register_state_codec() -> str:
    """Register the orjson codec with Faust (idempotent); returns its name.

    Faust looks codecs up by name in a process-wide registry; there is no way to pass
    a codec object to a table.
    """
    if STATE_CODEC not in codecs.codecs:
        codecs.register(STATE_CODEC, _OrjsonCodec())
    return STATE_CODEC


def use_state_codec(table: Any) -> None:
    """Make ``table`` (and its changelog) use the orjson codec.

    Faust 0.15.3 derives a table's value serializer from its ``value_type`` and
    ignores the app's ``value_serializer`` (``Collection.__init__``:
    ``self.value_serializer = self._serializer_from_type(self.value_type)``); the
    ``Table()`` factory takes no serializer. Setting the attribute before the
    changelog topic is first used is the only way in.
    """
    table.value_serializer = register_state_codec()


def patch_fetch_wait(ms: int) -> None:
    """Make Faust's consumers use a short fetch wait.

    Faust 0.15.3 hard-codes ``fetch_max_wait_ms=1500`` when it creates its aiokafka
    consumer (``AIOKafkaConsumerThread._create_worker_consumer``) and has no setting
    for it, and a broker may hold a waiting fetch for all of it; freshness is
    counted in milliseconds, so ``kafka.fetch_max_wait_ms`` must win. The consumer
    factory is wrapped once per process.
    """
    from faust.transport.drivers import aiokafka as driver

    thread_class: Any = driver.AIOKafkaConsumerThread
    if getattr(thread_class, "_edgefeed_fetch_wait_ms", None) == ms:
        return
    original = getattr(thread_class, "_edgefeed_original_create", None)
    if original is None:
        original = thread_class._create_worker_consumer
        thread_class._edgefeed_original_create = original

    def create(self: Any, transport: Any) -> Any:
        consumer = original(self, transport)
        consumer._fetch_max_wait_ms = ms
        return consumer

    thread_class._create_worker_consumer = create
    thread_class._edgefeed_fetch_wait_ms = ms


class FetchWait:
    """The consumer's fetch wait, following the traffic: short while messages flow,
    long once none came for ``idle_after_s``.

    An aiokafka consumer sends its next fetch as soon as one returns, and a fetch
    returns after the wait when no data came: with a 20 ms wait, an idle worker and
    the broker each handle 50 empty fetches a second per consumer (most of their
    idle CPU). aiokafka reads the wait from its fetcher for every request
    (``Fetcher._fetch_max_wait_ms``, aiokafka 0.12), which Faust 0.15.3 builds in
    its consumer thread (``app.consumer._thread._consumer``): set there, the next
    fetch uses it. Setting an int attribute from the event loop's thread is safe.

    Args:
        app: The Faust app whose consumer is governed.
        busy_ms: The wait while messages flow (``kafka.fetch_max_wait_ms``).
        idle_ms: The wait when idle (``kafka.idle_fetch_max_wait_ms``; 0: never).
        idle_after_s: Seconds without a message before the long wait.
    """

    def __init__(
        self,
        app: faust.App,
        busy_ms: int,
        idle_ms: int,
        idle_after_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.app, self.busy_ms, self.idle_ms = app, busy_ms, idle_ms
        self.idle_after_s, self.clock = idle_after_s, clock
        self.current_ms = busy_ms
        self._last = clock()

    def seen(self) -> None:
        """A message arrived: the short wait from the next fetch on."""
        self._last = self.clock()
        if self.current_ms != self.busy_ms:
            self._set(self.busy_ms)

    def tick(self) -> None:
        """Called now and then (every second): the long wait once idle long enough."""
        if (
            self.idle_ms
            and self.current_ms != self.idle_ms
            and self.clock() - self._last >= self.idle_after_s
        ):
            self._set(self.idle_ms)

    def _set(self, ms: int) -> None:
        fetcher = _fetcher(self.app)
        if fetcher is None:  # not started yet, or another transport: leave it be
            return
        fetcher._fetch_max_wait_ms = ms
        self.current_ms = ms


def _fetcher(app: faust.App) -> Any:
    thread = getattr(app.consumer, "_thread", None)
    consumer = getattr(thread, "_consumer", None)
    fetcher = getattr(consumer, "_fetcher", None)
    return fetcher if hasattr(fetcher, "_fetch_max_wait_ms") else None


async def relieve_producer(app: faust.App, above: int = 50) -> None:
    """Let the producer send what table writes queued, before Faust stalls for it.

    Table writes are synchronous and only queue changelog records in the
    producer's buffer; Faust 0.15.3 stalls the whole stream
    (``ProducerBuffer.wait_until_ebb``) once more than 100 wait. A checkpoint
    writes hundreds, so it drains the buffer itself between slices.
    """
    buffer = app.producer.buffer
    if buffer.size > above:
        await buffer.flush_atmost(buffer.size)


async def wait_delivered(app: faust.App, sent: list[Any]) -> None:
    """Return once every record in ``sent`` is acknowledged by the broker.

    ``Producer.flush`` is not enough in Faust 0.15.3: it drains the producer's
    buffer with ``ProducerBuffer.flush_atmost``, which returns as soon as no record
    left the buffer for 0.1 s, with records still queued under load. A checkpoint
    that trusted it acked messages whose changelog records were never written, and
    a worker killed then lost those updates (found by scripts/fault_suite.py).
    """
    await app.producer.flush()
    for future in sent:
        await future
    sent.clear()


class PartitionWriter(MutableMapping[str, Any]):
    """A table as seen by a checkpoint writing one changelog partition.

    Faust's ``table[key] = value`` sends the changelog record to the partition of
    the *current stream event* (``Collection.partition_for_key``), which a
    checkpoint running beside the stream does not have. This writes the table's
    store and sends the record to the given partition through the public
    ``send_changelog``.
    """

    def __init__(
        self,
        table: Any,
        partition: int,
        sent: list[Any] | None = None,
        epoch: int | None = None,
    ) -> None:
        self.table = table
        self.partition = partition
        # The owner epoch (pipeline.statestore), sent as a header of every record;
        # Faust's send_changelog takes no headers, so those records go through the
        # changelog topic's send_soon with the arguments send_changelog passes.
        self.epoch = epoch
        # The records' futures, resolved once the broker acknowledged each one: Faust's
        # own producer flush may return with records still queued (see
        # wait_delivered), so a checkpoint waits for these.
        self.sent = sent if sent is not None else []

    def __getitem__(self, key: str) -> Any:
        return self.table.data[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self.table.data[key] = value
        self.sent.append(self._send(key, value))

    def __delitem__(self, key: str) -> None:
        del self.table.data[key]
        self.sent.append(self._send(key, None, value_serializer="raw"))

    def _send(self, key: str, value: Any, value_serializer: Any = None) -> Any:
        if self.epoch is None:
            return self.table.send_changelog(
                self.partition, key, value, value_serializer=value_serializer
            )
        return self.table.changelog_topic.send_soon(
            key=key,
            value=value,
            partition=self.partition,
            headers={EPOCH_HEADER: str(self.epoch).encode()},
            key_serializer=self.table.key_serializer,
            value_serializer=value_serializer or self.table.value_serializer,
            callback=self.table._on_changelog_sent,
            eager_partitioning=True,
        )

    def __contains__(self, key: object) -> bool:
        return key in self.table.data

    def __iter__(self) -> Iterator[str]:
        return iter(self.table.data)

    def __len__(self) -> int:
        return len(self.table.data)


class LeanMonitor(Monitor):
    """Faust's Monitor without the statistics it keeps per message and per event.

    Faust 0.15.3 calls its Monitor sensor for every message in and out and every
    stream event in and out: counters by topic, stream and task (keyed by
    ``str(stream)``), timestamps on the message, a deque of event run times, a
    dict per event. edgefeed exports its own metrics (pipeline.metrics) and
    serves no Faust web views, so nothing reads them; in the router, which
    consumes one Debezium record per change, they were ~4% of its CPU (what is
    left per event: Faust's SensorDelegate still builds a dict per event, and
    the send hooks are kept). Kept: what Faust itself reads back
    (``stream_inbound_time`` for its slow-processing warnings, the read
    offsets), and everything that is not per message.
    """

    def on_message_in(self, tp: Any, offset: int, message: Any) -> None:
        self.tp_read_offsets[tp] = offset

    def on_stream_event_in(self, tp: Any, offset: int, stream: Any, event: Any) -> None:
        self.stream_inbound_time[tp] = time.monotonic()

    def on_stream_event_out(
        self, tp: Any, offset: int, stream: Any, event: Any, state: Any = None
    ) -> None:
        return None

    def on_message_out(self, tp: Any, offset: int, message: Any) -> None:
        return None


class _Resumed:
    """The rest of a coroutine stepped once outside any task that suspended on
    ``pending``: awaiting this drives it on from there (what Python 3.12's eager
    task start does). Results, exceptions and cancellation pass through."""

    __slots__ = ("coro", "pending")

    def __init__(self, coro: Any, pending: Any) -> None:
        self.coro, self.pending = coro, pending

    def __await__(self) -> Any:
        coro, pending = self.coro, self.pending
        while True:
            try:
                sent = yield pending
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # thrown in by the task: cancellation
                try:
                    pending = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    pending = coro.send(sent)
                except StopIteration as stop:
                    return stop.value


def patch_eager_delivery() -> None:
    """Hand each consumed message to the streams without four tasks per message.

    Faust 0.15.3's fetch loop (``Consumer._drain_messages``) delivers every message
    with ``wait_first(callback(message), suspend_flow.wait())``, and mode's
    ``Service.wait_first`` wraps each argument and the service's ``stopped`` and
    ``crashed`` events in a task, then ``asyncio.wait``s them: four tasks, their
    loop callbacks and their cancellation per message. The callback (the
    conductor putting the event on a stream's queue) nearly always completes
    without suspending. In the router, which consumes one Debezium record per
    change, this was ~15% of its CPU (py-spy, 2,000 changes/s).

    Patched, ``Consumer.wait_first`` called in that shape (a coroutine and one
    more waitable, the consumer neither stopped nor crashed, the flow not
    suspended) by the consumer of an app that asks for it
    (``app.edgefeed_eager_delivery``, set by :func:`pipeline.app.faust_app`)
    first runs the coroutine up to its first suspension, in the caller: finished
    there, it returns as the original would have, with the other waitables
    closed unstarted; suspended (a full stream queue, a paused flow), the rest
    of it goes through the original ``wait_first`` with the other waitables, so
    a suspension of the flow still cuts it short. Every other call is the
    original's. Once per process.

    Only the router asks: its messages are small and one per change. The
    regional workers read packs of changes (a few messages a second, up to
    256 KiB each), where the saving is nil and a fuller stream queue would only
    hold more memory: handed over at once, up to ~100 messages reach the
    stream's queue per turn of the event loop while the agent takes about one,
    so under a backlog the queue fills to Faust's ``stream_buffer_maxsize``
    (which then pauses the partition's fetching, as designed) where the
    original's tasks kept it shallower.

    The first step runs in the fetch loop's task, so anything in it bound to
    the current task (``asyncio.timeout``, a ``TaskGroup``, a context variable
    set) would bind to that task; in Faust 0.15.3 that step is the conductor's
    handler (a lock, flow control, the producer's ebb, decoding, a queue put),
    and none of it is.
    """
    from faust.transport.consumer import Consumer
    from mode.services import WaitResults

    consumer_class: Any = Consumer
    if getattr(consumer_class, "_edgefeed_eager", False):
        return
    original = consumer_class.wait_first

    async def wait_first(self: Any, *coros: Any, timeout: Any = None) -> Any:  # noqa: ASYNC109
        first = coros[0] if len(coros) == 2 else None
        if (
            first is None
            or not inspect.iscoroutine(first)
            or not getattr(self.app, "edgefeed_eager_delivery", False)
            or self._stopped.is_set()
            or self._crashed.is_set()
            or self.suspend_flow.is_set()
        ):
            return await original(self, *coros, timeout=timeout)
        try:
            pending = first.send(None)
        except StopIteration as stop:
            _close_unstarted(coros[1])
            return WaitResults([first], [stop.value], False)
        except BaseException:
            _close_unstarted(coros[1])
            raise
        return await original(self, _Resumed(first, pending), coros[1], timeout=timeout)

    consumer_class.wait_first = wait_first
    consumer_class._edgefeed_eager = True


def _close_unstarted(waitable: Any) -> None:
    if inspect.iscoroutine(waitable):
        waitable.close()  # never started: no "never awaited" warning


def patch_recovery_handover() -> None:
    """Deliver no stream message between a recovery's end and its seek.

    Faust 0.15.3 ends a recovery (``Recovery.on_recovery_completed``) with: the
    tables' recovery callbacks, ``resume_partitions`` of the stream partitions,
    ``perform_seek`` (to the committed offsets), then ``flow_control.resume()``,
    which clears every stream queue, and ``resume_flow``. When the changelog had
    anything to read, the fetcher runs from the recovery on, so messages fetched
    while ``perform_seek`` awaits the broker went into a stream queue with their
    read offsets recorded, and the clear threw them away: a partition with a
    committed offset read them again but dropped the older ones as already read
    (``DROPPED MESSAGE ROFF``), a partition without one (before the worker's first
    commit) was not sought at all and lost them. Seen as a regional worker killed
    -9 before its first commit that, restarted, never processed the pack at offset
    0 of a partition (test_hostile_values_are_dead_lettered_and_never_crash_a_region).

    Patched, the consumer's flow is stopped when the recovery ends, before the
    callbacks; the recovery's own ``resume_flow`` starts it again after the seek and
    the clear (a recovery cut short by a new rebalance leaves it to the next one,
    which resumes the flow itself). Once per process.
    """
    from faust.tables.recovery import Recovery

    recovery_class: Any = Recovery
    if getattr(recovery_class, "_edgefeed_handover", False):
        return
    recovery_class._edgefeed_original_on_recovery_completed = recovery_class.on_recovery_completed

    async def on_recovery_completed(self: Any, generation_id: int = 0) -> None:
        self.app.consumer.stop_flow()
        await recovery_class._edgefeed_original_on_recovery_completed(self, generation_id)

    recovery_class.on_recovery_completed = on_recovery_completed
    recovery_class._edgefeed_handover = True


async def seek_every_partition(consumer: Any) -> dict[Any, int | None]:
    """``consumer.seek_to_committed()`` (an aiokafka consumer) for every assigned
    partition: those without a committed offset go to the reset position
    (``auto_offset_reset``), those committed at 0 to 0. Returns the committed offsets
    as aiokafka does (None: none)."""
    from aiokafka.consumer.fetcher import OffsetResetStrategy

    committed: dict[Any, int | None] = await consumer.seek_to_committed()
    for tp, offset in committed.items():
        if offset == 0:
            consumer.seek(tp, 0)
    unknown = [tp for tp, offset in committed.items() if offset is None or offset < 0]
    if unknown:
        strategy = consumer._fetcher._default_reset_strategy
        if strategy == OffsetResetStrategy.EARLIEST:
            await consumer.seek_to_beginning(*unknown)
        elif strategy == OffsetResetStrategy.LATEST:
            await consumer.seek_to_end(*unknown)
    return committed


def patch_seek_every_partition() -> None:
    """Make Faust's seek to the committed offsets seek every partition.

    Faust 0.15.3 reads a partition again after a rebalance by seeking to its
    committed offset (``Consumer.perform_seek`` -> ``seek_to_committed``), and
    clears the messages it had queued for the streams. aiokafka 0.14's
    ``AIOKafkaConsumer.seek_to_committed`` seeks only partitions committed past 0
    (``if offset and offset > 0``): a partition never committed (a worker's first
    minutes, a new partition) kept its fetch position, after the cleared messages,
    which were then never processed, and a later commit went past them. Patched
    (:func:`seek_every_partition`), such a partition goes back to where a new
    consumer would start: ``auto_offset_reset`` (earliest for edgefeed). Once per
    process.
    """
    from faust.transport.drivers import aiokafka as driver

    thread_class: Any = driver.AIOKafkaConsumerThread
    if getattr(thread_class, "_edgefeed_seek_every_partition", False):
        return

    async def seek_to_committed(self: Any) -> Any:
        return await self.call_thread(seek_every_partition, self._ensure_consumer())

    thread_class._edgefeed_original_seek_to_committed = thread_class.seek_to_committed
    thread_class.seek_to_committed = seek_to_committed
    thread_class._edgefeed_seek_every_partition = True


# Topics whose offsets have no holes (written by edgefeed's own non-transactional
# producers, never compacted): the only ones the strict commit rule applies to.
STRICT_TOPICS: set[str] = set()


def head_missing(consumer: Any, tp: Any) -> bool:
    """True when ``tp`` (of a topic in :data:`STRICT_TOPICS`) has acknowledged messages
    but not the one at its committed offset (the next to read), which no known gap in
    the log explains.

    Faust's consumer keeps, per partition, the committed offset (``_committed_offset``,
    None when unknown or 0), the acknowledged offsets not yet committed (``_acked``)
    and the offset ranges the log does not have (``_gap``).
    """
    if str(tp.topic) not in STRICT_TOPICS:
        return False
    committed = consumer._committed_offset.get(tp)
    acked = consumer._acked.get(tp)
    if committed is None or not acked or min(acked) <= committed:
        return False
    gaps = consumer._gap.get(tp)
    return not (gaps and gaps.overlaps(committed))


def partition_offsets(app: faust.App, topic: str) -> dict[int, tuple[int | None, int | None]]:
    """Per partition of ``topic`` assigned to ``app``'s consumer: (committed offset,
    highwater), each None when unknown; empty before the consumer started.

    Faust 0.15.3 has no public reading of the committed offsets: its consumer keeps
    them in ``Consumer._committed_offset`` (the next offset to read; None when
    unknown or 0), as :func:`head_missing` reads them. The highwater is Faust's
    public ``Consumer.highwater`` (aiokafka's: the log end offset of the last fetch
    response; None before the first), read from the consumer's own thread's state
    without a request, as Faust's own monitor does.
    """
    consumer = getattr(app, "_consumer", None)
    if consumer is None:
        return {}
    try:
        assignment = consumer.assignment()
    except Exception:  # ConsumerNotStarted, or a consumer stopping
        return {}
    found: dict[int, tuple[int | None, int | None]] = {}
    for tp in assignment:
        if str(tp.topic) != topic:
            continue
        try:
            highwater = consumer.highwater(tp)
        except Exception:  # unassigned meanwhile (a rebalance)
            highwater = None
        found[tp.partition] = (consumer._committed_offset.get(tp), highwater)
    return found


def patch_strict_commits(topics: Iterable[str] = ()) -> None:
    """Never commit past a message of ``topics`` that was not acknowledged.

    Faust 0.15.3 commits the first run of consecutive acknowledged offsets
    (``Consumer._new_offset``) and checks that the run starts at the committed
    offset loosely: ``min(acked) - committed > 1`` lets one unacknowledged message
    at the head through (the committed offset is the next one to read, so the head
    must equal it), and the check is skipped when the committed offset is 0. A
    message that was never acknowledged, such as one whose delivery Faust abandons
    when a rebalance suspends the flow
    (``wait_first(callback(message), suspend_flow.wait())`` in
    ``Consumer._drain_messages``), was then committed past and its change lost for
    good: a restarted worker resumes after it. Patched, the commit waits at that
    message (and :class:`StuckHeads` reads it again).

    Only for ``topics`` whose offsets have no holes Faust does not know of: the
    regional change topics, which edgefeed's router writes without transactions.
    Not for Debezium's topics: a Connect worker with exactly-once source support
    writes transaction markers, and a committed offset that points at one would
    stall the commit for good. The class is patched once per process; each call
    adds its topics.
    """
    from faust.transport.consumer import Consumer

    STRICT_TOPICS.update(topics)
    consumer_class: Any = Consumer
    if getattr(consumer_class, "_edgefeed_strict_commits", False):
        return
    original = consumer_class._new_offset

    def new_offset(self: Any, tp: Any) -> int | None:
        if head_missing(self, tp):
            return None
        result: int | None = original(self, tp)
        return result

    consumer_class._new_offset = new_offset
    consumer_class._edgefeed_original_new_offset = original
    consumer_class._edgefeed_strict_commits = True


class StuckHeads:
    """Reads again a message the consumer skipped: when a partition's committed
    offset has stayed unacknowledged for ``after_s`` while later messages were
    acknowledged (:func:`head_missing`), seeks every partition back to its
    committed offset (Faust's ``Consumer.perform_seek``, as after a rebalance).

    Watches the topics of :data:`STRICT_TOPICS` only. The messages after the missing
    one are delivered again; the regional workers apply changes idempotently (every
    state change carries its source position).

    Args:
        app: The Faust app whose consumer is watched.
        after_s: How long a missing head is tolerated (acks lag deliveries by up to a
            checkpoint interval and a commit interval).
    """

    def __init__(
        self, app: faust.App, after_s: float = 15.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.app, self.after_s, self.clock = app, after_s, clock
        self.since: dict[Any, float] = {}
        self.reseeks = 0

    async def tick(self) -> None:
        """Called now and then (every second)."""
        consumer = getattr(self.app, "_consumer", None)
        if consumer is None or not hasattr(consumer, "_acked"):
            return
        now = self.clock()
        stuck = {tp for tp in list(consumer._acked) if head_missing(consumer, tp)}
        self.since = {tp: self.since.get(tp, now) for tp in stuck}
        overdue = sorted(
            (str(tp.topic), tp.partition, consumer._committed_offset.get(tp))
            for tp, since in self.since.items()
            if now - since >= self.after_s
        )
        if not overdue:
            return
        log.warning(
            "the message at the committed offset of %s was never acknowledged while "
            "later ones were (a delivery the consumer skipped); reading again from the "
            "committed offsets",
            ", ".join(f"{topic}[{partition}]@{offset}" for topic, partition, offset in overdue),
        )
        self.since.clear()
        self.reseeks += 1
        await consumer.perform_seek()


def record_epoch(event: Any) -> int | None:
    """The owner epoch of a changelog record read in a recovery (None: no header)."""
    headers = getattr(event, "headers", None) or getattr(event.message, "headers", None)
    if not headers:
        return None
    items = headers.items() if isinstance(headers, Mapping) else headers
    for name, value in items:
        if name == EPOCH_HEADER:
            try:
                return int(value)
            except (TypeError, ValueError):
                return None
    return None


def fence_recovery(table: Any, fence: ChangelogFence) -> None:
    """Make ``table``'s recovery skip the records a fenced owner wrote late.

    Faust's recovery applies changelog records with ``Table.apply_changelog_batch``,
    last record per key wins. This filters each batch through ``fence`` first
    (pipeline.statestore: owner epochs), keeping the partition order.
    """
    apply = table.apply_changelog_batch

    def apply_fenced(batch: Iterable[Any]) -> None:
        apply([e for e in batch if fence.admit(e.message.partition, record_epoch(e))])

    table.apply_changelog_batch = apply_fenced
