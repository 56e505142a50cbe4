"""The forwarder: a region's changes from the central broker to the region's own broker.

The MirrorMaker 2 pattern, one process per region: it consumes the region's
change topic on the central broker (consumer group ``<prefix>-forward-<region>``)
and produces every record, unchanged and to the same partition, to the topic of
the same name on the region's broker, across the WAN link. The router never
talks to a regional broker, so a partitioned or dead region stalls only its own
forwarder: the router and the other regions' forwarders do not wait for it.

Delivery is at least once: a batch's offsets are committed on the central
broker only after the region's broker acknowledged every record of it and of
every batch fetched before it. Batches are pipelined (``max_in_flight`` of
them sent and not yet acknowledged), so records do not wait for the previous
batch's round trip across the link before they are sent. A batch
that fails (a cut link times out) is sent again, whole, until it is
acknowledged; records the region's broker got twice are harmless, because a
regional worker applies a change only over an older position of the same row
(pipeline.features), so duplicates and late copies change nothing.

It forwards the region's dead-letter topic the same way: the router writes the
poison of a personal row whose home is this region to
``<dead_letter_topic>.<region>`` on the central broker, and the forwarder
carries it to the topic of that name on the region's broker, beside the
regional worker's own dead letters, so a region's poison is in the region.

The producer compresses its batches (``compression``: zstd by default): the
records cross the WAN link, and cross-region bytes cost money.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.codec import has_zstd as has_cramjam  # zstd, lz4 and snappy all need cramjam
from aiokafka.errors import KafkaError, TopicAlreadyExistsError

from pipeline.exceptions import PipelineConfigError

__all__ = ["ForwardSpec", "ForwardStats", "Forwarder", "route_through"]

log = logging.getLogger("edgefeed.forward")

_RETRY_BACKOFF_S = (0.2, 0.5, 1.0, 2.0)


def route_through(client: Any, address_map: Mapping[str, str]) -> None:
    """Make an aiokafka client reach brokers through other addresses (a WAN link).

    A broker advertises one address (Tansu has a single advertised listener),
    which its own site's workers use directly; only the clients on the far side
    of a link must dial the link instead. aiokafka looks every broker up through
    ``ClusterMetadata.broker_metadata`` before connecting, so this wraps that one
    method of this one client; nothing else of aiokafka is changed.
    """
    if not address_map:
        return
    cluster = client.cluster
    lookup = cluster.broker_metadata

    def mapped(broker_id: Any) -> Any:
        broker = lookup(broker_id)
        if broker is None:
            return None
        target = address_map.get(f"{broker.host}:{broker.port}")
        if target is None:
            return broker
        host, _, port = target.rpartition(":")
        return broker._replace(host=host, port=int(port))

    cluster.broker_metadata = mapped


def _through(servers: Sequence[str], address_map: Mapping[str, str]) -> list[str]:
    return [address_map.get(server, server) for server in servers]


@dataclass(frozen=True, slots=True)
class ForwardSpec:
    """What one region's forwarder does.

    Attributes:
        region: The region.
        topic: Its change topic (the same name on both brokers).
        partitions: Partitions of that topic (the same on both brokers).
        dead_letter_topic: The region's dead-letter topic (one partition on both
            brokers), forwarded too; None: only the change topic.
        group: Consumer group on the central broker.
        source: The central broker.
        target: The region's broker, as it advertises itself.
        address_map: Advertised ``host:port`` -> the link's address (empty: direct).
        compression: Producer batch compression (None: none).
        batch_max: Most records forwarded (and committed) at once.
        linger_ms: How long the producer gathers records into a batch.
        fetch_max_wait_ms: How long a fetch from the central broker waits for data.
        request_timeout_ms: How long a produce across the link may take before it
            is retried (a cut link: this long, then again).
        from_beginning: Forward the whole central topic again, from its first
            record, whatever the group committed (rebuilding a lost site).
        max_batch_bytes: Producer batch size per partition.
        max_in_flight: Batches sent and not yet acknowledged at once: the
            forwarder keeps fetching and sending while earlier batches cross the
            link (a batch per round trip would add up to a round trip of waiting
            to every record), and commits each batch's offsets only once it and
            every batch before it are acknowledged.
        kafka_options: Security options of aiokafka's clients (TLS, SASL: the
            settings' ``kafka.security``), for both brokers; never logged.
    """

    region: str
    topic: str
    partitions: int
    group: str
    source: Sequence[str]
    target: Sequence[str]
    address_map: Mapping[str, str] = field(default_factory=dict)
    compression: str | None = "zstd"
    batch_max: int = 5000
    linger_ms: int = 5
    fetch_max_wait_ms: int = 20
    request_timeout_ms: int = 10_000
    client_id: str = "edgefeed"
    dead_letter_topic: str | None = None
    from_beginning: bool = False
    max_batch_bytes: int = 4 * 1024 * 1024
    max_in_flight: int = 8
    kafka_options: Mapping[str, Any] = field(default_factory=dict, repr=False)


_TIMINGS_KEPT = 4096  # recent batches whose timings the quantiles cover


@dataclass(slots=True)
class ForwardStats:
    """What a forwarder has done (logged, and read by tests and benchmarks).

    Where a record's time goes, per batch (the oldest record of each): ``waited``
    is the router's write on the central broker -> the forwarder fetched it;
    ``crossed`` is fetched -> the region's broker acknowledged the whole batch
    (a round trip across the link, plus the broker's own time).
    """

    records: int = 0
    value_bytes: int = 0  # uncompressed record values delivered
    batches: int = 0
    retries: int = 0
    last_delivered_at: float | None = None  # wall clock
    failing_since: float | None = None  # wall clock of the first failure of the current batch
    waited_ms: deque[float] = field(default_factory=lambda: deque(maxlen=_TIMINGS_KEPT))
    crossed_ms: deque[float] = field(default_factory=lambda: deque(maxlen=_TIMINGS_KEPT))
    batch_records: deque[int] = field(default_factory=lambda: deque(maxlen=_TIMINGS_KEPT))

    def timings(self) -> dict[str, float]:
        """p50 and p99 of the recent batches' waits and crossings (ms), and their size."""
        found: dict[str, float] = {}
        for name, values in (
            ("waited", self.waited_ms),
            ("crossed", self.crossed_ms),
            ("records", self.batch_records),
        ):
            ordered = sorted(values)
            if ordered:
                found[f"{name}_p50"] = float(ordered[len(ordered) // 2])
                found[f"{name}_p99"] = float(
                    ordered[min(len(ordered) - 1, len(ordered) * 99 // 100)]
                )
        return found


class _Rewind(ConsumerRebalanceListener):  # type: ignore[misc]  # aiokafka is untyped
    """With ``from_beginning``, the first assignment starts at each partition's first record."""

    def __init__(self, consumer: AIOKafkaConsumer, rewind: bool) -> None:
        self.consumer, self.rewind = consumer, rewind

    async def on_partitions_revoked(self, revoked: Any) -> None:
        return None

    async def on_partitions_assigned(self, assigned: Any) -> None:
        if self.rewind and assigned:
            await self.consumer.seek_to_beginning(*assigned)
            self.rewind = False
            log.info("rewound to the first record of %s", sorted(tp.partition for tp in assigned))


class Forwarder:
    """Runs one region's forwarder until :meth:`stop` (see the module docstring).

    Raises:
        PipelineConfigError: (at construction) the compression's codec is not installed.
    """

    def __init__(self, spec: ForwardSpec) -> None:
        # Checked here, not at the first send: a missing codec is a setup error.
        if spec.compression is not None and spec.compression != "gzip" and not has_cramjam():
            raise PipelineConfigError(
                f"compression {spec.compression!r} needs the cramjam package: "
                "pip install 'edgefeed[pipeline]' (or set sites.compression: gzip or none)"
            )
        self.spec = spec
        self.stats = ForwardStats()
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    @property
    def topics(self) -> dict[str, int]:
        """The topics forwarded, with their partitions (the same on both brokers)."""
        found = {self.spec.topic: self.spec.partitions}
        if self.spec.dead_letter_topic is not None:
            found[self.spec.dead_letter_topic] = 1
        return found

    async def ensure_target_topic(self) -> None:
        """Create the forwarded topics on the region's broker (through the link) if missing."""
        spec = self.spec
        admin = AIOKafkaAdminClient(
            bootstrap_servers=_through(spec.target, spec.address_map),
            client_id=f"{spec.client_id}-forward-{spec.region}-admin",
            request_timeout_ms=spec.request_timeout_ms,
            **spec.kafka_options,
        )
        route_through(admin._client, spec.address_map)
        await admin.start()
        try:
            existing = set(await admin.list_topics())
            for topic, partitions in self.topics.items():
                if topic not in existing:
                    with contextlib.suppress(TopicAlreadyExistsError):
                        await admin.create_topics(
                            [NewTopic(topic, partitions, replication_factor=1)]
                        )
        finally:
            await admin.close()

    async def run(self, *, ready: asyncio.Event | None = None) -> None:
        """Forward until stopped. Retries every failure; never gives up on a batch."""
        spec = self.spec
        consumer = AIOKafkaConsumer(
            bootstrap_servers=list(spec.source),
            group_id=spec.group,
            client_id=f"{spec.client_id}-forward-{spec.region}",
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            fetch_max_wait_ms=spec.fetch_max_wait_ms,
            max_poll_records=spec.batch_max,
            # A batch may wait for a cut link for as long as the cut lasts: the
            # group must not evict the forwarder meanwhile (heartbeats go on).
            max_poll_interval_ms=24 * 3600 * 1000,
            **spec.kafka_options,
        )
        producer = AIOKafkaProducer(
            bootstrap_servers=_through(spec.target, spec.address_map),
            client_id=f"{spec.client_id}-forward-{spec.region}",
            acks="all",
            compression_type=spec.compression,
            linger_ms=spec.linger_ms,
            request_timeout_ms=spec.request_timeout_ms,
            max_request_size=16 * 1024 * 1024,
            # aiokafka keeps one request in flight per partition, and a record bigger
            # than a batch (a router pack) would be a batch of its own: one pack per
            # round trip, 5 packs/s across a 200 ms RTT link. Batches this size
            # carry everything queued in one round trip (and compress better).
            max_batch_size=spec.max_batch_bytes,
            **spec.kafka_options,
        )
        route_through(producer.client, spec.address_map)
        await self.retrying(producer.start, "connect to the region's broker")
        await consumer.start()
        consumer.subscribe(list(self.topics), listener=_Rewind(consumer, spec.from_beginning))
        if ready is not None:
            ready.set()
        # Batches sent and not yet acknowledged, oldest first, with the offsets that
        # each one's acknowledgement lets the group commit.
        inflight: deque[tuple[dict[Any, int], asyncio.Task[None]]] = deque()
        stopping = asyncio.ensure_future(self._stop.wait())
        try:
            while not self._stop.is_set():
                # While batches are in flight, come back soon to commit the ones done.
                wait_ms = spec.fetch_max_wait_ms if inflight else 100
                batch = await consumer.getmany(timeout_ms=wait_ms, max_records=spec.batch_max)
                if batch:
                    offsets = {tp: part[-1].offset + 1 for tp, part in batch.items()}
                    records = [record for part in batch.values() for record in part]
                    task = asyncio.create_task(self._timed_delivery(producer, records))
                    inflight.append((offsets, task))
                if len(inflight) >= spec.max_in_flight:
                    # The oldest batch may wait out a cut link: a stop ends the wait.
                    await asyncio.wait(
                        [inflight[0][1], stopping], return_when=asyncio.FIRST_COMPLETED
                    )
                done: dict[Any, int] = {}
                while inflight and inflight[0][1].done():
                    offsets, task = inflight.popleft()
                    task.result()  # a delivery ends only acknowledged (or with a bug)
                    done.update(offsets)
                if done:
                    await consumer.commit(done)
        finally:
            # Not acknowledged: not committed, so forwarded again at the next start.
            stopping.cancel()
            for _offsets, task in inflight:
                task.cancel()
            await asyncio.gather(*(task for _offsets, task in inflight), return_exceptions=True)
            with contextlib.suppress(KafkaError, OSError):
                await consumer.stop()
            with contextlib.suppress(KafkaError, OSError):
                await producer.stop()

    async def _timed_delivery(self, producer: AIOKafkaProducer, records: Sequence[Any]) -> None:
        fetched = time.time()
        oldest = min(record.timestamp for record in records)
        await self._deliver(producer, records)
        self.stats.waited_ms.append(max(fetched * 1000 - oldest, 0.0))
        self.stats.crossed_ms.append((time.time() - fetched) * 1000)
        self.stats.batch_records.append(len(records))

    async def retrying(self, start: Any, what: str) -> None:
        """Await ``start()`` until it succeeds (the region may be unreachable for now)."""
        attempt = 0
        while True:
            try:
                await start()
                return
            except (KafkaError, OSError) as exc:
                backoff = _RETRY_BACKOFF_S[min(attempt, len(_RETRY_BACKOFF_S) - 1)]
                log.warning("region %s: cannot %s (%s); retrying", self.spec.region, what, exc)
                attempt += 1
                await asyncio.sleep(backoff)

    async def _deliver(self, producer: AIOKafkaProducer, records: Sequence[Any]) -> None:
        """Produce ``records`` to the same partitions on the region's broker; return
        once all are acknowledged, sending the whole batch again after a failure."""
        spec, stats = self.spec, self.stats
        attempt = 0
        while True:
            try:
                futures = [
                    await producer.send(
                        record.topic,
                        value=record.value,
                        key=record.key,
                        partition=record.partition,
                        # The router's write time, as MirrorMaker 2 keeps it: the
                        # region's lag in seconds counts from there.
                        timestamp_ms=record.timestamp,
                        headers=list(record.headers or ()),
                    )
                    for record in records
                ]
                # Every outcome, not the first failure: none is left unobserved.
                outcomes = await asyncio.gather(*futures, return_exceptions=True)
                failed = next((o for o in outcomes if isinstance(o, BaseException)), None)
                if failed is not None:
                    raise failed
            except (KafkaError, OSError) as exc:
                stats.retries += 1
                if stats.failing_since is None:
                    stats.failing_since = time.time()
                backoff = _RETRY_BACKOFF_S[min(attempt, len(_RETRY_BACKOFF_S) - 1)]
                log.warning(
                    "region %s: %d records not acknowledged by the region's broker (%s: %s); "
                    "sending them again in %.1f s",
                    spec.region,
                    len(records),
                    type(exc).__name__,
                    exc,
                    backoff,
                )
                attempt += 1
                await asyncio.sleep(backoff)
                continue
            if stats.failing_since is not None:
                log.info(
                    "region %s: the region's broker acknowledges again after %.1f s",
                    spec.region,
                    time.time() - stats.failing_since,
                )
            stats.failing_since = None
            stats.records += len(records)
            stats.value_bytes += sum(len(record.value or b"") for record in records)
            stats.batches += 1
            stats.last_delivered_at = time.time()
            return
