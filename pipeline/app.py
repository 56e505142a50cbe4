"""The Faust apps: the router, and one feature app per region (thin wiring).

``edgefeed pipeline run --role router`` and ``--region NAME`` start these as
Faust workers. Each app is its own consumer group (pipeline.names); a region
scales by running more workers, up to the number of partitions of its change
topic. The processing itself lives in pipeline.routing (the router's logic) and
pipeline.runtime (the regional worker: batches, checkpoints, acks); this module
only connects them to Faust's topics, table, timers and signals. Everything that
reaches into Faust's internals is in pipeline.faustcompat.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faust
import orjson
import redis.exceptions
from aiokafka.partitioner import DefaultPartitioner
from prometheus_client import CollectorRegistry

from edge_cache import AsyncFeatureWriter, Delete, RegionSettings, Upsert
from edge_cache.registry import marker_value
from pipeline.config import PipelineConfig
from pipeline.exceptions import SinkUnavailableError
from pipeline.faustcompat import (
    FetchWait,
    LeanMonitor,
    PartitionWriter,
    StuckHeads,
    fence_recovery,
    partition_offsets,
    patch_eager_delivery,
    patch_fetch_wait,
    patch_recovery_handover,
    patch_seek_every_partition,
    patch_strict_commits,
    relieve_producer,
    use_state_codec,
    wait_delivered,
)
from pipeline.faustlocal import LocalChangelog, LocalTableStore, changelog_record_at
from pipeline.features import EntityState, FeatureEngine
from pipeline.gctune import GcTuner
from pipeline.history import (
    HistoryGuard,
    HistoryNeed,
    SourceRows,
    StreamStart,
    history_needs,
    stream_start,
    topic_ends,
)
from pipeline.history import read_records as read_history_records
from pipeline.homes import HomeBook
from pipeline.localstore import LocalStates
from pipeline.metrics import PipelineMetrics
from pipeline.names import HOMES_TABLE, STATE_TABLE
from pipeline.probes import Readiness, RegionReadiness, partition_marks
from pipeline.routing import Router
from pipeline.runtime import BatchPolicy, Delivery, QuietBatches, RegionRuntime
from pipeline.runtime.region import renewal_due
from pipeline.runtime.router import RouterRuntime, SourceRecord, dead_letter_headers
from pipeline.statestore import (
    ChangelogFence,
    checkpoint_key,
    fence_key,
    rebuild_states,
    store_state,
)

__all__ = [
    "HistorySource",
    "PipelineConfig",
    "build_region_app",
    "build_router_app",
    "faust_app",
]

log = logging.getLogger("edgefeed.pipeline")


def faust_app(
    app_id: str, config: PipelineConfig, *, eager_delivery: bool = False, **overrides: Any
) -> faust.App:
    """A Faust app with the pipeline's Kafka and timing settings.

    ``eager_delivery``: its consumer hands a message to the streams without
    Faust's tasks per message (:func:`pipeline.faustcompat.patch_eager_delivery`;
    the router's, which reads one small message per change)."""
    kafka, pipeline = config.kafka, config.pipeline
    patch_fetch_wait(kafka.fetch_max_wait_ms)
    patch_eager_delivery()
    # A rebalance must read again every message it cleared from the streams.
    patch_recovery_handover()
    patch_seek_every_partition()
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
        "Monitor": LeanMonitor,
    }
    credentials = kafka.security.faust_credentials()
    if credentials is not None:
        options["broker_credentials"] = credentials
    options.update(overrides)
    options.update(config.extra_faust)
    app = faust.App(app_id, **options)
    app.edgefeed_eager_delivery = eager_delivery  # type: ignore[attr-defined]
    tuner = GcTuner(full_every_s=pipeline.gc_full_interval_s)
    fetch_wait = FetchWait(app, kafka.fetch_max_wait_ms, kafka.idle_fetch_max_wait_ms)
    app.edgefeed_fetch_wait = fetch_wait  # type: ignore[attr-defined]  # the agents report traffic
    stuck_heads = StuckHeads(app)

    @app.timer(interval=1.0)  # type: ignore[untyped-decorator]
    async def housekeeping() -> None:
        tuner.tick()
        fetch_wait.tick()
        await stuck_heads.tick()

    return app


def _metrics(metrics: PipelineMetrics | None) -> PipelineMetrics:
    # A private registry when the caller serves none (tests, benchmarks).
    return metrics if metrics is not None else PipelineMetrics.create(CollectorRegistry())


def _raw_topic(app: faust.App, name: str, partitions: int) -> Any:
    return app.topic(name, partitions=partitions, key_serializer="raw", value_serializer="raw")


class _FaustRegional:
    """RegionalSink: the regional topics."""

    def __init__(self, app: faust.App, outputs: Mapping[str, Any]) -> None:
        self.app, self.outputs = app, outputs

    async def send(self, region: str, partition: int, pack: bytes) -> Any:
        return await self.outputs[region].send(value=pack, partition=partition)

    async def delivered(self, handles: Sequence[Any]) -> None:
        await wait_delivered(self.app, list(handles))


class _FaustRouterDeadLetters:
    """RouterDeadLetters: the central dead-letter topic and each region's own; each
    dead letter is waited for, so a refusal reaches the runtime's retry."""

    def __init__(self, app: faust.App, central: Any, regional: Mapping[str, Any]) -> None:
        self.app, self.central, self.regional = app, central, regional

    async def send(
        self, region: str | None, key: bytes | None, value: bytes, headers: dict[str, bytes]
    ) -> None:
        topic = self.central if region is None else self.regional[region]
        sent = await topic.send(key=key, value=value, headers=headers)
        await wait_delivered(self.app, [sent])


class _FaustHomeRecords:
    """HomeRecords: the book of homes' changelog (a table of one partition)."""

    def __init__(self, app: faust.App, records: PartitionWriter, sent: list[Any]) -> None:
        self.app, self.records, self.sent = app, records, sent

    async def close(self) -> None:
        await wait_delivered(self.app, self.sent)
        # Closed by a lone record, as the regional changelogs are (Tansu reports a
        # partition's end as the start of its last batch; _FaustChangelog.close).
        self.records[checkpoint_key(0)] = {"at_ms": int(time.time() * 1000)}
        await wait_delivered(self.app, self.sent)


class _FaustRecordAcker:
    """RecordAcker: acks the Faust event behind each source record."""

    def __init__(self) -> None:
        self.stream: Any = None

    async def ack(self, record: SourceRecord) -> None:
        await self.stream.ack(record.handle)


@dataclass(frozen=True, slots=True)
class HistorySource:
    """The source side of the router's history check (pipeline.history), built by the
    CLI from the settings: both calls block (they run in a thread).

    Attributes:
        rows: (need, cutoff ms, homes) -> what the source holds of the rows the
            features need (of the regions ``homes`` only, for a personal table).
        snapshot: (table, filter) -> the final state of a paced incremental snapshot.
    """

    rows: Callable[[HistoryNeed, int, Sequence[str] | None], SourceRows]
    snapshot: Callable[[str, str | None], str]


class _RouterHistory:
    """HistoryPorts on the router's Faust app, its Kafka and the source."""

    def __init__(
        self,
        app: faust.App,
        config: PipelineConfig,
        source: HistorySource,
        runtime: RouterRuntime,
    ) -> None:
        self.app, self.config, self.source = app, config, source
        # The routing runtime: its regional sink, and how far it has routed.
        self.regional = runtime.regional
        self.routed, self.progress = runtime.routed, runtime.progress
        self.records = _raw_topic(app, config.names.history_topic, 1)
        self.bootstrap = list(config.kafka.bootstrap_servers)
        self.options = config.kafka.security.aiokafka_options()

    async def read_records(self) -> dict[str, dict[str, Any]]:
        return await read_history_records(
            self.bootstrap, self.config.names.history_topic, self.options
        )

    async def write_record(self, key: str, record: Mapping[str, Any]) -> None:
        sent = await self.records.send(key=key.encode(), value=orjson.dumps(record), partition=0)
        await wait_delivered(self.app, [sent])

    async def source_rows(
        self, need: HistoryNeed, cutoff_ms: int, homes: Sequence[str] | None = None
    ) -> SourceRows:
        return await asyncio.to_thread(self.source.rows, need, cutoff_ms, homes)

    async def stream_start(self, table: str) -> StreamStart | None:
        topic = self.config.source_topics[table]
        return await stream_start(self.bootstrap, topic, self.options)

    async def send_markers(self, body: bytes, regions: Sequence[str]) -> None:
        sent = [
            await self.regional.send(region, partition, body)
            for region in regions
            for partition in range(self.config.pipeline.partitions)
        ]
        await self.regional.delivered(sent)

    async def snapshot(self, table: str, filter_sql: str | None) -> str:
        return await asyncio.to_thread(self.source.snapshot, table, filter_sql)

    async def routed_to_end(self, table: str) -> None:
        topic = self.config.source_topics[table]
        ends = await topic_ends(self.bootstrap, topic, self.options)
        log.info("history rebuild of %s: routing %s up to %s", table, topic, ends)
        said = time.monotonic()
        while any(self.routed.get((topic, p), -1) < last for p, last in ends.items()):
            if time.monotonic() - said > 10:
                said = time.monotonic()
                routed = {p: self.routed.get((topic, p), -1) for p in ends}
                log.info("history rebuild of %s: routed %s of %s", table, routed, ends)
            self.progress.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.progress.wait(), 1.0)


def _router_readiness(
    app: faust.App, config: PipelineConfig, homes: Any, readiness: Readiness
) -> None:
    """The router is ready once the table of homes is recovered after an assignment
    (it routes from then on), not during a rebalance (pipeline.probes)."""
    fed = set(config.fed_topics())

    @homes.on_recover  # type: ignore[untyped-decorator]
    async def homes_recovered() -> None:
        """Routing may start: the homes are known and the source partitions ours."""
        count = sum(1 for tp in app.assignor.assigned_actives() if tp.topic in fed)
        readiness.set(True, f"ready: {count} source partitions assigned")

    @app.on_partitions_revoked.connect  # type: ignore[arg-type]  # mode types it loosely
    async def router_rebalancing(sender: Any, *args: Any, **kwargs: Any) -> None:
        readiness.set(False, "recovering partitions (rebalance)")


def _router_history(
    app: faust.App, config: PipelineConfig, measured: PipelineMetrics, ports: _RouterHistory
) -> None:
    """The router's history check at start (pipeline.history), retried on a blip."""
    table_homes = {name: table.home_region_column for name, table in config.tables.items()}
    needs = [
        n for n in history_needs(config.entities, table_homes) if n.table in config.source_topics
    ]
    states = ("checking", "complete", "rebuilding", "gap")

    def on_state(need: HistoryNeed, state: str) -> None:
        for known in states:
            measured.history.labels(need.table, known).set(1 if known == state else 0)

    guard = HistoryGuard(
        needs,
        ports,
        regions=config.region_names,
        rebuild=config.pipeline.rebuild,
        on_state=on_state,
    )

    @app.task  # type: ignore[untyped-decorator]
    async def check_history() -> None:
        delay = 1.0
        while True:
            try:
                await guard.run()
                return
            except Exception:  # a broker or database blip: never the router's end
                log.exception("history check failed; trying again in %.0f s", delay)
                await asyncio.sleep(delay)
                delay = min(30.0, delay * 2)


def build_router_app(
    config: PipelineConfig,
    metrics: PipelineMetrics | None = None,
    history: HistorySource | None = None,
    readiness: Readiness | None = None,
) -> faust.App:
    """The router: Debezium topics in, per-region change topics out (data residency).

    With ``history``, the router also checks at start that the stream's history
    covers the windows, and rebuilds what it lacks (pipeline.history). With
    ``readiness``, the router says when it is ready (pipeline.probes): once the
    table of homes is recovered after an assignment, not during a rebalance."""
    names = config.names
    app_id = names.router_group
    app = faust_app(app_id, config, eager_delivery=True)
    fetch_wait: FetchWait = app.edgefeed_fetch_wait  # type: ignore[attr-defined]
    measured = _metrics(metrics)
    # The book of entity homes (pipeline.homes) lives in a table of one partition,
    # recovered from its changelog before the agent routes anything: one router
    # process holds every home (a second router would see only part of them).
    homes = app.Table(HOMES_TABLE, partitions=1, key_type=str)
    home_sent: list[Any] = []
    home_records = PartitionWriter(homes, 0, home_sent)
    router = Router(config.entities, config.tables, config.region_names, HomeBook(home_records))
    batch_max, within = config.pipeline.batch_max, config.pipeline.batch_within_ms / 1000.0
    partitions = config.pipeline.partitions
    source = app.topic(*config.fed_topics(), key_serializer="raw", value_serializer="raw")
    outputs = {
        name: _raw_topic(app, names.region_topic(name), partitions) for name in config.region_names
    }
    dead = _raw_topic(app, names.dead_letter_topic, 1)
    regional_dead = {
        name: _raw_topic(app, names.region_dead_letter_topic(name), 1)
        for name in config.region_names
    }
    # Source topic -> the home-region column of its table (None: shared data).
    home_columns = {
        topic: config.tables[table].home_region_column
        for table, topic in config.source_topics.items()
        if table in config.tables
    }
    partitioner = DefaultPartitioner()
    all_partitions = list(range(partitions))

    # Cached: aiokafka's murmur2 is pure Python (~3 us a key, two keys a change),
    # and the same entities change again and again.
    @functools.lru_cache(maxsize=1 << 16)
    def partition_of(key: str) -> int:
        # Kafka's default partitioner of the entity key: each regional partition
        # owns whole entities.
        return int(partitioner(key.encode(), all_partitions, all_partitions))

    acker = _FaustRecordAcker()
    runtime = RouterRuntime(
        router,
        home_columns=home_columns,
        partitions=partitions,
        partition_of=partition_of,
        regional=_FaustRegional(app, outputs),
        dead_letters=_FaustRouterDeadLetters(app, dead, regional_dead),
        homes=_FaustHomeRecords(app, home_records, home_sent),
        acker=acker,
        metrics=measured,
        app_id=app_id,
    )

    async def route_batch(events: list[Any]) -> None:
        await runtime.route_batch(
            [
                SourceRecord(
                    str(e.message.topic), e.message.partition, e.message.offset, e.key, e.value, e
                )
                for e in events
            ]
        )

    batches = QuietBatches(batch_max, within, route_batch)

    @app.agent(source, name="route")
    async def route(stream: Any) -> None:
        acker.stream = stream
        stream.enable_acks = False  # acked by route_batch, after the routed sends
        try:
            async for event in stream.events():
                fetch_wait.seen()
                await batches.add(event)
        except Exception as exc:
            # As in the regional agent: a restarted agent would resume past the
            # events of the failed batch; stopping the worker resumes at the
            # committed offset, which never passes an unrouted event.
            log.exception("the router's agent failed; stopping the worker")
            await app.crash(exc)
            raise

    if readiness is not None:
        _router_readiness(app, config, homes, readiness)

    @app.task  # type: ignore[untyped-decorator]
    async def close_quiet_batches() -> None:
        try:
            await batches.run()
        except Exception as exc:
            log.exception("the router's batch timer failed; stopping the worker")
            await app.crash(exc)
            raise

    if history is not None:
        _router_history(app, config, measured, _RouterHistory(app, config, history, runtime))

    return app


# What a Redis outage looks like to redis-py (refused, reset, timed out, still loading
# its data, or paused by a client pause); retried by the runtime, never fatal.
_UNAVAILABLE = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.BusyLoadingError,
    OSError,
)


_MARKER_TTL_S = 300  # refreshed every INTACT_CHECK_S; outlives a stalled worker


class _FaustCache:
    """CacheSink: the region's Redis through edge_cache's writer (opened lazily)."""

    def __init__(self, region: RegionSettings, engine: FeatureEngine, worker_id: str) -> None:
        self.region, self.engine = region, engine
        self._writer: AsyncFeatureWriter | None = None
        self._worker_id = worker_id
        self._marked = False

    async def writer(self) -> AsyncFeatureWriter:
        if self._writer is None:
            self._writer = AsyncFeatureWriter.from_region(self.region, self.engine.schemas)
            await self._writer.publish_schemas()
            marker = self._writer.core.layout.writer_marker_key(self._worker_id)
            versions = marker_value(self.engine.schemas)  # what `features apply` waits for
            await self._writer.client.set(marker, versions, ex=_MARKER_TTL_S)
            self._marked = True  # from now on, a missing marker means lost data
        return self._writer

    async def write(
        self, ops: Sequence[Upsert | Delete], now_us: int, *, freshness: bool = True
    ) -> Sequence[bool]:
        try:
            return await self._write(ops, now_us, freshness)
        except _UNAVAILABLE as exc:
            raise SinkUnavailableError(f"redis of region {self.region.name}: {exc}") from exc

    async def quarantine(self, quarantined: Mapping[str, str], released: Sequence[str]) -> None:
        try:
            cache = await self.writer()
            await cache.mark_quarantined(quarantined, released)
        except _UNAVAILABLE as exc:
            raise SinkUnavailableError(f"redis of region {self.region.name}: {exc}") from exc

    async def rebuilding(self, marks: Mapping[str, str | None]) -> None:
        try:
            cache = await self.writer()
            key = cache.core.layout.rebuild_key()
            listed = {field: value for field, value in marks.items() if value is not None}
            gone = [field for field, value in marks.items() if value is None]
            pipe = cache.client.pipeline(transaction=False)
            if listed:
                pipe.hset(key, mapping=listed)  # type: ignore[arg-type]
            if gone:
                pipe.hdel(key, *gone)
            await pipe.execute()
        except _UNAVAILABLE as exc:
            raise SinkUnavailableError(f"redis of region {self.region.name}: {exc}") from exc

    async def intact(self) -> bool:
        """Whether the cache still holds what this worker wrote.

        Each worker keeps a marker key of its own alive (an expiry refreshed at every
        check; EXPIRE answers 0 once the key is gone): if it is gone, the Redis lost
        its data (restarted without persistence, or flushed) and this worker must write
        its states again. The schema registry is republished by whoever finds it gone.
        A marker per worker, because with several workers in a region the first to
        notice must not hide the loss from the others.
        """
        try:
            cache = await self.writer()
            keys = [key for key, _document, _schema in cache.core.schema_documents()]
            if await cache.client.exists(*keys) != len(keys):
                await cache.publish_schemas()
            marker = cache.core.layout.writer_marker_key(self._worker_id)
            if await cache.client.expire(marker, _MARKER_TTL_S):
                return True
            await cache.client.set(marker, marker_value(self.engine.schemas), ex=_MARKER_TTL_S)
            if not self._marked:  # this worker's first check: nothing written was lost
                self._marked = True
                return True
            return False
        except _UNAVAILABLE as exc:
            raise SinkUnavailableError(f"redis of region {self.region.name}: {exc}") from exc

    async def _write(
        self, ops: Sequence[Upsert | Delete], now_us: int, freshness: bool
    ) -> Sequence[bool]:
        cache = await self.writer()
        # The vectors and each entity type's freshness record, in one round trip.
        return await cache.write(list(ops), freshness=freshness)


class _FaustChangelog:
    """ChangelogSink: the Faust table of entity states."""

    def __init__(self, app: faust.App, table: Any) -> None:
        self.app, self.table = app, table
        self.sent: list[Any] = []  # this checkpoint's records, until the broker has them
        self.fence = ChangelogFence()  # read by the table's recovery (fence_recovery)
        self.epochs: dict[int, int] = {}  # partition -> the epoch this worker owns it in
        fence_recovery(table, self.fence)

    def writer(self, partition: int) -> PartitionWriter:
        return PartitionWriter(self.table, partition, self.sent, self.epochs.get(partition))

    async def own(self, partitions: Sequence[int]) -> None:
        """After a recovery: open a new owner epoch on each partition now ours."""
        for partition in partitions:
            self.epochs[partition] = epoch = self.fence.next_epoch(partition)
            self.writer(partition)[fence_key(partition)] = {"epoch": epoch}
        await wait_delivered(self.app, self.sent)

    def store(self, key: str, state: EntityState, delivery: Delivery) -> None:
        # The records go to the partition its entity's messages use.
        store_state(self.writer(delivery.partition), key, state)

    async def relieve(self) -> None:
        await relieve_producer(self.app)

    async def close(self, partitions: Mapping[int, Delivery]) -> None:
        # Close each changelog partition written to with a record in a batch of its
        # own. Tansu (the local broker) reports a partition's end as the start of
        # its last record batch, and Faust's recovery reads only up to that end:
        # anything after the first record of a final batch would be lost on
        # restart. Harmless on Kafka.
        await wait_delivered(self.app, self.sent)
        for partition in partitions:
            self.writer(partition)[checkpoint_key(partition)] = {"at_ms": int(time.time() * 1000)}
        await wait_delivered(self.app, self.sent)


class _FaustDeadLetters:
    def __init__(self, topic: Any, region: str) -> None:
        self.topic, self.stage = topic, f"region {region}"

    async def send(
        self, delivery: Delivery, value: bytes, reason: str, error: str, index: int | None
    ) -> None:
        headers = dead_letter_headers(
            reason, error, self.stage, delivery.topic, delivery.partition, delivery.offset
        )
        if index is not None:
            headers["edgefeed-index"] = str(index).encode()
        await self.topic.send(key=delivery.key, value=value, headers=headers)


class _FaustAcker:
    def __init__(self) -> None:
        self.stream: Any = None

    async def ack(self, delivery: Delivery) -> None:
        await self.stream.ack(delivery.handle)


def _region_duties(
    app: faust.App,
    region_name: str,
    runtime: RegionRuntime,
    acker: _FaustAcker,
    changes: Any,
    readiness: RegionReadiness | None,
) -> None:
    """The regional worker's duties beside its agent: batches, checkpoints and cache
    checks when due, a checkpoint at each rebalance, progress for the probes."""

    @app.task  # type: ignore[untyped-decorator]
    async def duties() -> None:
        # Close quiet batches, start checkpoints, check the cache: each when due,
        # not on a fixed short timer (an idle worker wakes once a second).
        while True:
            if acker.stream is None:  # the agent has not started yet
                await asyncio.sleep(0.05)
                continue
            await runtime.wait_for_duty()
            try:
                await runtime.tick()
            except Exception as exc:  # a bug: stop the worker, as the agent does
                log.exception("region %s: a duty failed; stopping the worker", region_name)
                await app.crash(exc)
                raise

    @app.on_partitions_revoked.connect  # type: ignore[arg-type]  # mode types it loosely
    async def checkpoint_at_rebalance(sender: Any, *args: Any, **kwargs: Any) -> None:
        if readiness is not None:
            readiness.rebalancing()
        if acker.stream is not None:
            await runtime.on_revoke()

    if readiness is not None:
        topic_name = changes.get_topic_name()

        @app.timer(interval=1.0)  # type: ignore[untyped-decorator]
        async def report_progress() -> None:
            offsets = partition_offsets(app, topic_name)
            readiness.observe(partition_marks(offsets, runtime.progress))


def _check_lineage(config: PipelineConfig, topic: str, local: LocalStates) -> None:
    """Before Faust reads the changelog from the folder's saved offsets: discard the
    partitions whose changelog is no longer the one they reflect (pipeline.localstore,
    ``check_lineage``). Run in a thread of its own: the caller may be inside a loop."""
    bootstrap = config.kafka.bootstrap_servers
    options = config.kafka.security.aiokafka_options()

    async def fetch(partition: int, offset: int) -> tuple[bytes | None, bytes | None] | None:
        return await changelog_record_at(bootstrap, topic, options, partition, offset)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, local.check_lineage(fetch)).result()


def _state_sinks(
    app: faust.App, config: PipelineConfig, region_name: str, engine: FeatureEngine, state: Any
) -> tuple[LocalStates | None, _FaustChangelog | LocalChangelog]:
    """The state table's storage: on local disk with ``pipeline.state_dir``
    (pipeline.localstore, behind the same table), else Faust's memory store."""
    pipeline = config.pipeline
    names = config.names
    app_id = names.region_group(region_name)
    if pipeline.state_dir is None:
        return None, _FaustChangelog(app, state)
    # The states on local disk (pipeline.localstore), behind the same table.
    local = LocalStates(
        Path(pipeline.state_dir) / app_id,
        lambda key, record: renewal_due(engine, key, record),
        {e.name: e.version for e in config.entities},
        cache_mb=pipeline.state_cache_mb,
    )
    _check_lineage(config, names.changelog_topic(region_name), local)
    state._data = LocalTableStore(app, state, local)
    changelog = LocalChangelog(
        app,
        state,
        local,
        config.kafka.bootstrap_servers,
        config.kafka.security.aiokafka_options(),
    )
    log.info("region %s: entity states on local disk in %s", region_name, local.folder)
    return local, changelog


def build_region_app(
    config: PipelineConfig,
    region_name: str,
    metrics: PipelineMetrics | None = None,
    readiness: RegionReadiness | None = None,
) -> faust.App:
    """One region's feature app: its change topic in, feature vectors into its Redis.

    With ``readiness``, the worker reports its recoveries and, every second, where
    its partitions stand (pipeline.probes)."""
    region = config.region(region_name)
    names = config.names
    app_id = names.region_group(region_name)
    app = faust_app(app_id, config)
    fetch_wait: FetchWait = app.edgefeed_fetch_wait  # type: ignore[attr-defined]
    engine = FeatureEngine(config.entities, config.tables)
    partitions = config.pipeline.partitions
    changes = _raw_topic(app, names.region_topic(region_name), partitions)
    # The router writes it without transactions: no holes, so commits may wait for
    # the exact next offset (faustcompat.patch_strict_commits).
    patch_strict_commits([names.region_topic(region_name)])
    dead = _raw_topic(app, names.region_dead_letter_topic(region_name), 1)
    # The states as the changelog holds them: one record per entity and one per row
    # chunk (pipeline.statestore), so a checkpoint writes only what changed.
    state = app.Table(STATE_TABLE, partitions=partitions, key_type=str)
    use_state_codec(state)
    partitioner = DefaultPartitioner()
    all_partitions = list(range(partitions))

    def partition_of(key: str) -> int:
        return int(partitioner(key.encode(), all_partitions, all_partitions))

    acker = _FaustAcker()
    pipeline = config.pipeline
    local, changelog = _state_sinks(app, config, region_name, engine, state)
    runtime = RegionRuntime(
        region=region_name,
        app_id=app_id,
        engine=engine,
        partition_of=partition_of,
        cache=_FaustCache(region, engine, f"{app_id}:{uuid.uuid4().hex[:12]}"),
        changelog=changelog,
        dead_letters=_FaustDeadLetters(dead, region_name),
        acker=acker,
        metrics=_metrics(metrics),
        policy=BatchPolicy(
            pipeline.batch_max,
            pipeline.batch_within_ms / 1000.0,
            pipeline.batch_catch_up,
            pipeline.snapshot_lane_ms / 1000.0,
        ),
        checkpoint_interval_s=pipeline.checkpoint_interval_s,
        on_fatal=app.crash,
        store=local,
        memory_bytes=pipeline.state_memory_mb << 20,
    )

    @state.on_recover
    async def rebuild_live_states() -> None:
        """After a (re)assignment: the working states of the partitions now ours."""
        topic = changes.get_topic_name()
        ours = {tp.partition for tp in app.assignor.assigned_actives() if tp.topic == topic}
        if isinstance(changelog, LocalChangelog):
            runtime.resumed(sorted(ours))  # on disk: read when needed
            await changelog.own(sorted(ours))
            log.info("resumed partitions %s from the local state store", sorted(ours))
        else:
            runtime.recovered(rebuild_states(state.items(), lambda key: partition_of(key) in ours))
            # Before anything is processed: a new epoch on each partition, so that a
            # late checkpoint of a previous owner (out of the group, still running) is
            # ignored by every later recovery (pipeline.statestore, "Owner epochs").
            changelog.fence.keep(ours)  # Faust's memory store dropped the others' records
            await changelog.own(sorted(ours))
            log.info(
                "recovered %d entity states for partitions %s", len(runtime.live), sorted(ours)
            )
        if readiness is not None:
            readiness.recovered(ours)

    def backlog(tp: Any, offset: int) -> int | None:
        """Messages after ``offset`` on its partition as the consumer last heard (the
        log end offset of its last fetch response; read from its state, no request):
        the batch policy's "behind" (pipeline.runtime.batch). None when unknown."""
        try:
            highwater = app.consumer.highwater(tp)
        except Exception:  # not assigned (a rebalance), or the consumer is stopping
            return None
        return None if highwater is None else max(0, int(highwater) - offset - 1)

    @app.agent(changes, name="features")
    async def features(stream: Any) -> None:
        acker.stream = stream
        stream.enable_acks = False  # acked at checkpoints, after the cache write
        try:
            async for event in stream.events():
                fetch_wait.seen()
                msg = event.message
                delivery = Delivery(
                    msg.partition,
                    msg.offset,
                    event,
                    event.key,
                    str(msg.topic),
                    backlog(msg.tp, msg.offset),
                )
                await runtime.on_message(delivery, event.value or b"")
        except Exception as exc:
            # Faust would restart the agent in the same consumer, which has already
            # fetched past the messages of the lost batch: they would never be
            # processed nor acked, the committed offset would stick, and only a
            # restart would read them (a partition's backlog seemed skipped). Stop
            # the worker instead: restarted, it resumes at the committed offset,
            # which never passes an unwritten change.
            log.exception("region %s: the feature agent failed; stopping the worker", region_name)
            await app.crash(exc)
            raise

    _region_duties(app, region_name, runtime, acker, changes, readiness)
    app.edgefeed_runtime = runtime  # type: ignore[attr-defined]  # for tests and debugging
    return app
