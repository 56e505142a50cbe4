"""The Faust apps: the router, and one feature app per region.

``edgefeed pipeline run --role router`` and ``--region NAME`` start these as
Faust workers. Each app is its own consumer group (``<prefix>-router``,
``<prefix>-region-<name>``); a region scales by running more workers, up to
the number of partitions of its change topic.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import faust
import orjson
from aiokafka.partitioner import DefaultPartitioner
from faust.serializers import codecs
from prometheus_client import Counter, Histogram

from connectors.settings import TableSettings
from edge_cache import AsyncFeatureWriter, Delete, RegionSettings, Upsert
from pipeline.envelope import decode_change
from pipeline.exceptions import PoisonEventError
from pipeline.features import EntityState, FeatureEngine
from pipeline.gctune import GcTuner
from pipeline.routing import Router
from pipeline.settings import EntitySettings, KafkaSettings, PipelineSettings
from pipeline.statestore import checkpoint_key, rebuild_states, store_state

__all__ = ["PipelineConfig", "build_region_app", "build_router_app", "faust_app"]

log = logging.getLogger("edgefeed.pipeline")

EVENTS = Counter("edgefeed_pipeline_events_total", "Events processed", ["app", "outcome"])
DEAD_LETTERS = Counter(
    "edgefeed_pipeline_dead_letters_total", "Events dead-lettered", ["app", "reason"]
)
WRITES = Counter(
    "edgefeed_pipeline_cache_writes_total", "Vectors written to Redis", ["region", "applied"]
)
BATCH = Histogram(
    "edgefeed_pipeline_batch_size",
    "Events per batch",
    ["app"],
    buckets=(1, 5, 10, 50, 100, 250, 500, 1000, 5000),
)
FRESHNESS = Histogram(
    "edgefeed_pipeline_freshness_seconds",
    "Source commit to Redis write, per vector written",
    ["region"],
    buckets=(
        0.01,
        0.02,
        0.03,
        0.05,
        0.075,
        0.1,
        0.15,
        0.2,
        0.25,
        0.3,
        0.4,
        0.5,
        0.75,
        1.0,
        1.5,
        2.0,
        3.0,
        5.0,
        10.0,
        30.0,
    ),
)
BATCH_SECONDS = Histogram(
    "edgefeed_pipeline_batch_seconds",
    "Time to process one batch (state, vectors, Redis write)",
    ["app"],
)
WRITE_SECONDS = Histogram(
    "edgefeed_pipeline_cache_write_seconds",
    "Latency of one pipelined batch write to Redis",
    ["region"],
)


class _OrjsonCodec(codecs.Codec):
    """JSON through orjson: the entity states in the changelog are large and written
    once per entity per batch, and orjson encodes them about 9x faster than json."""

    def _dumps(self, obj: Any) -> bytes:
        return orjson.dumps(obj)

    def _loads(self, s: bytes) -> Any:
        return orjson.loads(s)


STATE_CODEC = "edgefeed-json"
codecs.register(STATE_CODEC, _OrjsonCodec())


@dataclass(frozen=True, slots=True)
class PipelineConfig:
    """Everything the apps need, composed from the settings file by the CLI."""

    kafka: KafkaSettings
    pipeline: PipelineSettings
    entities: Sequence[EntitySettings]
    tables: Mapping[str, TableSettings]
    source_topics: Mapping[str, str]  # table -> Debezium topic
    regions: Sequence[RegionSettings]
    extra_faust: Mapping[str, Any] = field(default_factory=dict)

    @property
    def region_names(self) -> list[str]:
        return [region.name for region in self.regions]

    def region(self, name: str) -> RegionSettings:
        for region in self.regions:
            if region.name == name:
                return region
        raise PoisonEventError("unknown-region", f"region {name!r} not in regions")

    def fed_topics(self) -> list[str]:
        """The Debezium topics of tables that feed some entity."""
        tables = {table for entity in self.entities for table in entity.tables}
        return sorted({self.source_topics[table] for table in tables})


def _patch_fetch_wait(ms: int) -> None:
    """Make Faust's consumers use a short fetch wait.

    Faust hard-codes ``fetch_max_wait_ms=1500`` for its consumers, and a broker
    may hold a waiting fetch for all of it; freshness is counted in
    milliseconds, so the setting (kafka.fetch_max_wait_ms) must win.
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


def faust_app(app_id: str, config: PipelineConfig, **overrides: Any) -> faust.App:
    kafka, pipeline = config.kafka, config.pipeline
    _patch_fetch_wait(kafka.fetch_max_wait_ms)
    session_s = kafka.session_timeout_ms / 1000.0
    options: dict[str, Any] = {
        "broker": [f"kafka://{server}" for server in kafka.bootstrap_servers],
        "broker_client_id": f"{kafka.client_id}-{app_id}",
        "store": "memory://",
        "broker_session_timeout": session_s,
        "broker_heartbeat_interval": max(0.5, session_s / 6),
        "broker_request_timeout": max(40.0, session_s + 10),
        "broker_commit_interval": pipeline.commit_interval_s,
        "consumer_auto_offset_reset": "earliest",
        "topic_partitions": pipeline.partitions,
        "topic_replication_factor": pipeline.replication_factor,
        "topic_disable_leader": True,
        "table_standby_replicas": 0,
        "web_enabled": False,
        "stream_wait_empty": False,
        "producer_linger": kafka.linger_ms / 1000.0,
    }
    options.update(overrides)
    options.update(config.extra_faust)
    app = faust.App(app_id, **options)
    tuner = GcTuner(full_every_s=pipeline.gc_full_interval_s)

    @app.timer(interval=1.0)  # type: ignore[untyped-decorator]
    async def tune_gc() -> None:
        tuner.tick()

    return app


def _dead_letter_headers(reason: str, message: str, event: Any, stage: str) -> dict[str, bytes]:
    msg = event.message
    return {
        "edgefeed-reason": reason.encode(),
        "edgefeed-error": message.encode()[:2000],
        "edgefeed-stage": stage.encode(),
        "edgefeed-topic": str(msg.topic).encode(),
        "edgefeed-partition": str(msg.partition).encode(),
        "edgefeed-offset": str(msg.offset).encode(),
    }


PACK_BYTES = 256 * 1024
CHECKPOINT_SLICE = 16  # entity states written between yields to the event loop


def pack_changes(bodies: Sequence[bytes], limit: int = PACK_BYTES) -> list[bytes]:
    """Regional messages carrying the encoded changes, in order: JSON arrays of at most
    ``limit`` bytes (one change alone may exceed it).

    The router sends one message per region and partition per batch instead of one per
    change: per-message costs (Faust's send and delivery, the broker's per-record work)
    are then paid per batch. Workers also accept a single change (a JSON object).
    """
    packs: list[bytes] = []
    current: list[bytes] = []
    size = 2
    for body in bodies:
        if current and size + len(body) + 1 > limit:
            packs.append(b"[" + b",".join(current) + b"]")
            current, size = [], 2
        current.append(body)
        size += len(body) + 1
    if current:
        packs.append(b"[" + b",".join(current) + b"]")
    return packs


def build_router_app(config: PipelineConfig) -> faust.App:
    """The router: Debezium topics in, per-region change topics out (data residency)."""
    app_id = config.pipeline.router_app_id
    app = faust_app(app_id, config)
    router = Router(config.entities, config.tables, config.region_names)
    batch_max, within = config.pipeline.batch_max, config.pipeline.batch_within_ms / 1000.0
    partitions = config.pipeline.partitions
    source = app.topic(*config.fed_topics(), key_serializer="raw", value_serializer="raw")
    outputs = {
        name: app.topic(
            config.pipeline.region_topic(name),
            partitions=partitions,
            key_serializer="raw",
            value_serializer="raw",
        )
        for name in config.region_names
    }
    dead = app.topic(
        config.pipeline.dead_letter_topic,
        partitions=1,
        key_serializer="raw",
        value_serializer="raw",
    )

    partitioner = DefaultPartitioner()
    all_partitions = list(range(partitions))
    routed_events = EVENTS.labels(app_id, "routed")
    ignored_events = EVENTS.labels(app_id, "ignored")
    tombstones = EVENTS.labels(app_id, "tombstone")
    batch_sizes = BATCH.labels(app_id)

    @app.agent(source, name="route")
    async def route(stream: Any) -> None:
        async for events in stream.take_events(batch_max, within):
            batch_sizes.observe(len(events))
            # (region, partition) -> the encoded changes bound there, in source order.
            packs: dict[tuple[str, int], list[bytes]] = {}
            for event in events:
                try:
                    change = decode_change(event.value or b"", offset=event.message.offset)
                    if change is None:
                        tombstones.inc()
                        continue
                    messages = router.route(change)
                except PoisonEventError as exc:
                    DEAD_LETTERS.labels(app_id, exc.reason).inc()
                    log.warning(
                        "dead-lettered %s:%s@%s: %s",
                        event.message.topic,
                        event.message.partition,
                        event.message.offset,
                        exc,
                    )
                    await dead.send(
                        key=event.key,
                        value=event.value,
                        headers=_dead_letter_headers(exc.reason, str(exc), event, "router"),
                    )
                    continue
                if not messages:
                    ignored_events.inc()
                    continue
                for message in messages:
                    body = orjson.dumps(message.value)
                    if message.key is None:  # a truncate reaches every partition
                        for partition in all_partitions:
                            packs.setdefault((message.region, partition), []).append(body)
                    else:
                        # The partition Kafka's default partitioner gives the entity key,
                        # so each regional partition owns whole entities.
                        partition = partitioner(
                            message.key.encode(), all_partitions, all_partitions
                        )
                        packs.setdefault((message.region, partition), []).append(body)
                routed_events.inc()
            for (region_name, partition), bodies in packs.items():
                for pack in pack_changes(bodies):
                    await outputs[region_name].send(value=pack, partition=partition)

    return app


def build_region_app(config: PipelineConfig, region_name: str) -> faust.App:
    """One region's feature app: its change topic in, feature vectors into its Redis."""
    region = config.region(region_name)
    app_id = config.pipeline.region_app_id(region_name)
    app = faust_app(app_id, config, value_serializer=STATE_CODEC)
    engine = FeatureEngine(config.entities)
    partitions = config.pipeline.partitions
    batch_max, within = config.pipeline.batch_max, config.pipeline.batch_within_ms / 1000.0
    changes = app.topic(
        config.pipeline.region_topic(region_name),
        partitions=partitions,
        key_serializer="raw",
        value_serializer="raw",
    )
    dead = app.topic(
        config.pipeline.dead_letter_topic,
        partitions=1,
        key_serializer="raw",
        value_serializer="raw",
    )
    # The states as the changelog holds them: one record per entity and one per row
    # (pipeline.statestore), so a checkpoint writes only what changed.
    state = app.Table("entities", partitions=partitions, key_type=str)
    # Faust picks a table's codec from its value type ("json" for plain dicts); the
    # states go through orjson instead (set before the changelog topic is made).
    state.value_serializer = STATE_CODEC  # type: ignore[attr-defined]
    # The working states of this worker's entities, rebuilt from the table after
    # every recovery, and the only ones the agent reads.
    live: dict[str, EntityState] = {}
    partitioner = DefaultPartitioner()
    all_partitions = list(range(partitions))
    holder: dict[str, AsyncFeatureWriter] = {}

    async def writer() -> AsyncFeatureWriter:
        if "w" not in holder:
            holder["w"] = AsyncFeatureWriter.from_region(region, engine.schemas)
            await holder["w"].publish_schemas()
        return holder["w"]

    applied_events = EVENTS.labels(app_id, "applied")  # changes, not messages
    duplicate_events = EVENTS.labels(app_id, "duplicate")
    batch_sizes = BATCH.labels(app_id)
    batch_seconds = BATCH_SECONDS.labels(app_id)

    # Continuous batching: state changes per change as messages arrive; the vectors
    # and one pipelined Redis write happen per entity per batch. A batch closes at
    # batch_max changes, or once it is batch_within_ms old and at least
    # batch_catch_up times as old as the last flush took, so a worker that falls
    # behind takes bigger batches (the fixed cost of a flush is shared by more
    # changes) instead of falling further behind.
    # Checkpoints: every checkpoint_interval_s what changed since the last one goes
    # to the changelog (each changed row once, however many batches touched it, and
    # each changed entity's position), and only then are the messages behind it
    # acked. A restarted worker recovers the states of the last checkpoint and
    # replays what came after (idempotently).
    batch: dict[str, Any] = {"events": [], "changes": 0, "touched": {}, "first": None}
    batch["last_flush"] = 0.0
    checkpoint_s = config.pipeline.checkpoint_interval_s
    # key -> (entity event, state): changed since the last checkpoint.
    dirty: dict[str, tuple[Any, EntityState]] = {}
    # Messages whose changes were flushed (their states are in dirty or written):
    # the next checkpoint acks them. A batch's messages join only when it flushes.
    ready: list[Any] = []
    last_checkpoint = [time.monotonic()]
    catch_up = config.pipeline.batch_catch_up
    flush_lock = asyncio.Lock()
    checkpoint_lock = asyncio.Lock()
    checkpoints: list[asyncio.Future[None]] = []  # the one running, kept referenced
    streams: list[Any] = []

    def _due(now: float) -> bool:
        first = batch["first"]
        if first is None:
            return False
        age = now - first
        return bool(batch["changes"] >= batch_max) or age >= max(
            within, catch_up * batch["last_flush"]
        )

    async def _flush() -> None:
        async with flush_lock:
            touched: dict[str, tuple[Any, Any, Any, EntityState]] = batch["touched"]
            changes = batch["changes"]
            events: list[Any] = batch["events"]
            batch.update(events=[], changes=0, touched={}, first=None)
            started = time.perf_counter()
            if events:
                ops: list[Upsert | Delete] = []
                for key, (entity, entity_id, event, new_state) in touched.items():
                    dirty[key] = (event, new_state)
                    ops.append(entity.write_op(entity_id, new_state))
                if ops:
                    await _write(ops)
                ready.extend(events)  # in Redis now: acked at the next checkpoint
                elapsed = time.perf_counter() - started
                batch["last_flush"] = elapsed
                batch_sizes.observe(changes)
                batch_seconds.observe(elapsed)
            elapsed_s = time.monotonic() - last_checkpoint[0]
            if ready and elapsed_s >= checkpoint_s and not checkpoint_lock.locked():
                checkpoints[:] = [asyncio.ensure_future(_checkpoint_or_crash())]

    async def _checkpoint_or_crash() -> None:
        try:
            await _checkpoint()
        except Exception as exc:  # the worker must not go on without its changelog
            log.exception("checkpoint failed")
            await app.crash(exc)

    async def _checkpoint() -> None:
        """What changed to the changelog, then ack the messages behind it.

        Runs beside the agent, a slice of entities at a time, so that it never
        stalls the stream for long; batches keep flushing to Redis meanwhile, and
        what they change waits for the next checkpoint.
        """
        async with checkpoint_lock:
            stream = streams[0]
            last_checkpoint[0] = time.monotonic()
            items = list(dirty.items())
            dirty.clear()
            acks = list(ready)
            ready.clear()
            by_partition: dict[int, Any] = {}
            for start in range(0, len(items), CHECKPOINT_SLICE):
                for key, (event, current) in items[start : start + CHECKPOINT_SLICE]:
                    engine.engine(key.split(":", 1)[0]).prune(current)
                    # The records go to the partition its entity's messages use.
                    stream._set_current_event(event)
                    store_state(state, key, current)
                    by_partition[event.message.partition] = event
                stream._set_current_event(None)
                # Let the producer catch up here, rather than have Faust stall the
                # stream once its buffer of table records passes 100.
                buffer = app.producer.buffer
                if buffer.size > 50:
                    await buffer.flush_atmost(buffer.size)
                await asyncio.sleep(0)
            if by_partition:
                # Close each changelog partition written to with a record in a batch
                # of its own. Tansu (the local broker) reports a partition's end as
                # the start of its last record batch, and Faust's recovery reads
                # only up to that end: anything after the first record of a final
                # batch would be lost on restart. Harmless on Kafka.
                await app.producer.flush()
                for partition, event in by_partition.items():
                    stream._set_current_event(event)
                    state[checkpoint_key(partition)] = {"at_ms": int(time.time() * 1000)}
                stream._set_current_event(None)
                await app.producer.flush()
            for event in acks:
                await stream.ack(event)

    @state.on_recover
    async def rebuild_live_states() -> None:
        """After a (re)assignment: the working states of the partitions now ours."""
        topic = changes.get_topic_name()
        ours = {tp.partition for tp in app.assignor.assigned_actives() if tp.topic == topic}
        live.clear()
        live.update(
            rebuild_states(
                state.items(),
                lambda key: partitioner(key.encode(), all_partitions, all_partitions) in ours,
            )
        )
        log.info("recovered %d entity states for partitions %s", len(live), sorted(ours))

    def _current(key: str) -> EntityState | None:
        return live.get(key)

    async def _dead_letter(event: Any, value: bytes, exc: Exception, index: int | None) -> None:
        reason = exc.reason if isinstance(exc, PoisonEventError) else "invalid"
        DEAD_LETTERS.labels(app_id, reason).inc()
        where = f"{event.message.partition}@{event.message.offset}"
        if index is not None:
            where += f"[{index}]"
        log.warning("dead-lettered %s: %s", where, exc)
        headers = _dead_letter_headers(reason, str(exc), event, f"region {region_name}")
        if index is not None:
            headers["edgefeed-index"] = str(index).encode()
        await dead.send(key=event.key, value=value, headers=headers)

    def _apply(message: Any, event: Any) -> None:
        if not isinstance(message, dict):
            raise PoisonEventError("undecodable", "a change must be a JSON object")
        if message.get("op") == "t":
            _truncate(message, event)
            return
        entity = engine.engine(str(message["e"]))
        key = f"{message['e']}:{message['id']}"
        new_state, changed = entity.apply(_current(key), message)
        if changed and new_state is not None:
            live[key] = new_state
            batch["touched"][key] = (entity, message["id"], event, new_state)
            applied_events.inc()
        else:
            duplicate_events.inc()

    @app.agent(changes, name="features")
    async def features(stream: Any) -> None:
        streams[:] = [stream]
        stream.enable_acks = False  # acked at checkpoints, after the cache write
        async for event in stream.events():
            if batch["first"] is None:
                batch["first"] = time.perf_counter()
            batch["events"].append(event)
            value = event.value or b""
            try:
                decoded = orjson.loads(value)
            except ValueError as exc:
                await _dead_letter(event, value, PoisonEventError("undecodable", str(exc)), None)
                decoded = []
            # A router's pack (a JSON array of changes), or a single change.
            entries = decoded if isinstance(decoded, list) else [decoded]
            batch["changes"] += len(entries)
            for index, message in enumerate(entries):
                try:
                    _apply(message, event)
                except (PoisonEventError, ValueError, KeyError, TypeError) as exc:
                    single = index if isinstance(decoded, list) else None
                    await _dead_letter(event, orjson.dumps(message), exc, single)
            if _due(time.perf_counter()):
                await _flush()

    @app.timer(interval=max(0.005, within / 2))  # type: ignore[untyped-decorator]
    async def flush_quiet_tail() -> None:
        """Close a batch that no further message will close (the stream went quiet),
        and checkpoint once the interval has passed."""
        now = time.perf_counter()
        if streams and (
            _due(now) or (ready and time.monotonic() - last_checkpoint[0] >= checkpoint_s)
        ):
            await _flush()

    @app.on_partitions_revoked.connect  # type: ignore[arg-type]  # mode types it loosely
    async def checkpoint_at_rebalance(sender: Any, *args: Any, **kwargs: Any) -> None:
        """Write the changed states and ack their messages before the partitions move.

        Every partition is revoked in a rebalance (and most come back): without this,
        redelivered messages would find their changes already in the in-memory
        states, and those states would never reach the changelog.
        """
        if streams:
            await _flush()
            await _checkpoint()

    def _truncate(message: dict[str, Any], event: Any) -> None:
        partition = event.message.partition
        for key in list(live):
            # The router's keys decide partitions; only this partition's entities are ours.
            if partitioner(key.encode(), all_partitions, all_partitions) != partition:
                continue  # another partition's copy of the truncate handles it
            current = live[key]
            entity_type, entity_id = key.split(":", 1)
            entity = engine.engine(entity_type)
            if entity.truncate(current, message):
                batch["touched"][key] = (entity, entity_id, event, current)

    async def _write(ops: list[Upsert | Delete]) -> None:
        cache = await writer()
        started = time.perf_counter()
        applied = await cache.write(ops)
        WRITE_SECONDS.labels(region_name).observe(time.perf_counter() - started)
        for flag in applied:
            WRITES.labels(region_name, str(flag).lower()).inc()
        newest: dict[str, tuple[int, int]] = {}
        for op in ops:
            commit_us = int(float(op.commit_time) * 1_000_000)  # type: ignore[arg-type]
            current = newest.get(op.entity, (0, 0))
            newest[op.entity] = max(current, (commit_us, op.position.lsn))
        now_us = int(time.time() * 1_000_000)
        freshness = FRESHNESS.labels(region_name)
        for op, written in zip(ops, applied, strict=True):
            if written:
                freshness.observe(max(0.0, now_us / 1e6 - float(op.commit_time)))  # type: ignore[arg-type]
        pipe = cache.client.pipeline(transaction=False)
        for entity_name, (commit_us, lsn) in newest.items():
            key = cache.core.layout.freshness_key(entity_name)
            pipe.hset(key, mapping={"commit_us": commit_us, "write_us": now_us, "lsn": lsn})
        await pipe.execute()

    return app
