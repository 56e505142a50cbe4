"""The local state store (pipeline.localstore) behind Faust's table of entity states.

Faust still runs the recovery: on an assignment it pauses the stream, reads each
changelog partition from the offset the store reports (``persisted_offset``) to
its end, hands the records to the store (``apply_changelog_batch``), then calls
the table's recovery callbacks and resumes. What changes is what it reads: only
the tail after the offset the store saved, and what it keeps: nothing in memory.

Faust's own ``rocksdb://`` store is not used: its writes go to the partition of
the current stream event and it keeps an index of every key in memory; this one
writes a checkpoint's records only once the broker acknowledged them, with the
offset the broker gave them, and holds no per-key structure.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import faust
import orjson
from faust.stores.base import Store

from pipeline.exceptions import StateStoreError
from pipeline.faustcompat import record_epoch, relieve_producer
from pipeline.features import EntityState
from pipeline.localstore import ChangelogWriter, LocalStates, record_mark
from pipeline.runtime.ledger import Delivery
from pipeline.statestore import EPOCH_HEADER, checkpoint_key, fence_key, store_state

__all__ = ["LocalChangelog", "LocalTableStore", "changelog_record_at"]

log = logging.getLogger("edgefeed.pipeline")


class LocalTableStore(Store[Any, Any]):
    """The table's storage as Faust sees it: offsets and recovery batches go to the
    partition databases; nothing is read through Faust's mapping interface."""

    def __init__(self, app: faust.App, table: Any, local: LocalStates) -> None:
        super().__init__("edgefeed-local://", app, table)
        self.local = local
        self.read: dict[int, int] = defaultdict(int)  # partition -> records recovered

    def persisted_offset(self, tp: Any) -> int | None:
        store = self.local.partition(tp.partition)
        offset = store.offset()
        if offset is None:
            log.warning(
                "state partition %d: no local state in %s; rebuilding it from the "
                "changelog (read whole)",
                tp.partition,
                store.path,
            )
        else:
            log.info(
                "state partition %d: local state in %s at changelog offset %d; reading "
                "the changelog's tail after it",
                tp.partition,
                store.path,
                offset,
            )
        return offset

    def set_persisted_offset(self, tp: Any, offset: int) -> None:
        """Ignored: the offset is saved with the records it covers (LocalChangelog)."""

    def apply_changelog_batch(self, batch: Iterable[Any], to_key: Any, to_value: Any) -> None:
        by_partition: dict[int, list[tuple[bytes, bytes | None]]] = defaultdict(list)
        offsets: dict[int, int] = {}
        marks: dict[int, bytes] = {}
        for event in batch:
            message = event.message
            partition = message.partition
            if message.offset > offsets.get(partition, -1):
                offsets[partition] = message.offset
                marks[partition] = record_mark(message.key, message.value)
            store = self.local.partition(partition)
            if store.admit(record_epoch(event)):
                # The key as the worker writes it (the table's key serializer is
                # JSON on the wire: the event's key is the decoded string).
                by_partition[partition].append((_key(event), message.value))
        for partition, offset in offsets.items():
            records = by_partition.get(partition, [])
            self.local.records_applied(partition, records, offset, marks[partition])
            self.read[partition] += len(records)

    def reset_state(self) -> None:
        """Nothing: the partition databases stay (the changelog brings them up to date)."""

    async def need_active_standby_for(self, tp: Any) -> bool:
        return True

    async def on_rebalance(self, *args: Any, **kwargs: Any) -> None:
        self.read.clear()

    async def on_recovery_completed(self, *args: Any, **kwargs: Any) -> None:
        for partition, count in sorted(self.read.items()):
            log.info("state partition %d: %d changelog records recovered", partition, count)

    async def backup_partition(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to back up: the changelog is the backup."""

    def restore_backup(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to restore: the changelog is the backup."""

    # Faust's mapping interface: the worker reads the partition databases itself.
    def __getitem__(self, key: Any) -> Any:
        raise KeyError(key)

    def __setitem__(self, key: Any, value: Any) -> None:
        raise TypeError("the entity states are written by the worker's checkpoints")

    def __delitem__(self, key: Any) -> None:
        raise TypeError("the entity states are written by the worker's checkpoints")

    def __iter__(self) -> Iterator[Any]:
        return iter(())

    def __len__(self) -> int:
        return 0

    def _clear(self) -> None:
        """Nothing: see reset_state."""


def _key(event: Any) -> bytes:
    key = event.key
    if isinstance(key, str):
        return key.encode()
    raw = event.message.key
    if isinstance(raw, bytes) and raw.startswith(b'"'):
        decoded = orjson.loads(raw)
        if isinstance(decoded, str):
            return decoded.encode()
    return raw if isinstance(raw, bytes) else str(raw).encode()


class LocalChangelog:
    """ChangelogSink with a local store: records to the changelog, then, once the
    broker has them, to the partition's database with the offset of the last."""

    def __init__(
        self,
        app: faust.App,
        table: Any,
        local: LocalStates,
        bootstrap: Sequence[str] = (),
        options: Mapping[str, Any] | None = None,
    ) -> None:
        self.app, self.table, self.local = app, table, local
        # To read the changelog back (see _deliver): the brokers, aiokafka's options.
        self.bootstrap, self.options = list(bootstrap), dict(options or {})
        self.epochs: dict[int, int] = {}  # partition -> the epoch this worker owns it in
        self._sent: list[tuple[int, bytes, bytes | None, Any]] = []

    def send(self, partition: int, key: str, value: bytes | None) -> None:
        epoch = self.epochs.get(partition)
        future = self.table.changelog_topic.send_soon(
            key=key,
            value=value,
            partition=partition,
            headers={EPOCH_HEADER: str(epoch).encode()} if epoch is not None else None,
            key_serializer=self.table.key_serializer,
            value_serializer="raw",
            eager_partitioning=True,
        )
        self._sent.append((partition, key.encode(), value, future))

    async def own(self, partitions: Sequence[int]) -> None:
        """After a recovery: open a new owner epoch on each partition now ours."""
        for partition in partitions:
            epoch = self.epochs[partition] = self.local.partition(partition).next_epoch()
            self.send(partition, fence_key(partition), orjson.dumps({"epoch": epoch}))
        await self._deliver()

    def store(self, key: str, state: EntityState, delivery: Delivery) -> None:
        store_state(ChangelogWriter(self, delivery.partition), key, state)

    async def relieve(self) -> None:
        await relieve_producer(self.app)

    async def close(self, partitions: Mapping[int, Delivery]) -> None:
        # The closing record in a batch of its own, as in app._FaustChangelog.close
        # (Tansu reports a partition's end as the start of its last record batch).
        await self._deliver()
        now_ms = int(time.time() * 1000)
        for partition in partitions:
            self.send(partition, checkpoint_key(partition), orjson.dumps({"at_ms": now_ms}))
        await self._deliver()

    async def _deliver(self) -> None:
        """Wait until the broker has every record sent, then write them to the local
        store, per partition in one batch with the offset of the last.

        The database must hold the changelog applied in order through the owner
        fence. When this worker's records directly follow its saved offset, they
        are that. When not, another writer's records lie between (a newer owner,
        after this worker stalled past its session: its late checkpoint lands
        after the new owner's records), so the range is read back from the
        changelog and applied through the fence: the newer owner's epoch wins and
        this worker's late records are ignored, as any recovery ignores them.
        """
        sent, self._sent = self._sent, []
        if not sent:
            return
        await self.app.producer.flush()
        records: dict[int, list[tuple[bytes, bytes | None]]] = defaultdict(list)
        offsets: dict[int, list[int]] = defaultdict(list)
        marks: dict[int, bytes] = {}
        for partition, key, value, future in sent:
            metadata = await future
            records[partition].append((key, value))
            offset = int(metadata.offset)
            if not offsets[partition] or offset > max(offsets[partition]):
                marks[partition] = record_mark(self._wire_key(key), value)
            offsets[partition].append(offset)
        for partition, found in records.items():
            saved = self.local.partition(partition).offset()
            written = sorted(offsets[partition])
            first = (saved if saved is not None else -1) + 1
            if written == list(range(first, first + len(written))):
                self.local.records_applied(partition, found, written[-1], marks[partition])
            else:
                await self._catch_up(partition, first, written[-1])

    async def _catch_up(self, partition: int, first: int, last: int) -> None:
        """Apply the changelog's records ``first``..``last`` of ``partition`` as read
        back from it, through the fence (see :meth:`_deliver`)."""
        store = self.local.partition(partition)
        read = await self.read_range(partition, first, last)
        mine = self.epochs.get(partition)
        foreign = [e for _o, _k, _v, e in read if e is not None and mine is not None and e > mine]
        admitted = [(k, v) for _o, k, v, e in read if store.admit(e)]
        if read:
            offset, key, value, _epoch = read[-1]
            self.local.records_applied(
                partition, admitted, offset, record_mark(self._wire_key(key), value)
            )
        log.warning(
            "state partition %d: other records than this worker's in the changelog at "
            "%d..%d%s; applied in order through the owner fence",
            partition,
            first,
            last,
            f" (a newer owner, epoch {max(foreign)}: this worker's late records ignored)"
            if foreign
            else "",
        )

    async def read_range(
        self, partition: int, first: int, last: int
    ) -> list[tuple[int, bytes, bytes | None, int | None]]:
        """The changelog's records ``first``..``last`` as (offset, key as the worker
        writes it, value, owner epoch)."""
        topic = self.table.changelog_topic.get_topic_name()
        return await changelog_range(self.bootstrap, topic, self.options, partition, first, last)

    def _wire_key(self, key: bytes) -> bytes:
        """The key as the changelog holds it (the table's key serializer: JSON)."""
        from faust.serializers import codecs

        return bytes(codecs.dumps(self.table.key_serializer or "raw", key.decode()))


async def changelog_record_at(
    bootstrap: Sequence[str], topic: str, options: Mapping[str, Any], partition: int, offset: int
) -> tuple[bytes | None, bytes | None] | None:
    """The changelog record at ``offset`` of ``partition`` as (raw key, raw value); None
    when the partition has no record there (it ends before it, or begins after)."""
    from aiokafka import TopicPartition
    from aiokafka.errors import OffsetOutOfRangeError

    consumer = await _consumer(bootstrap, options, "edgefeed-state-check", "none")
    try:
        tp = TopicPartition(topic, partition)
        if topic not in await consumer.topics():
            return None
        consumer.assign([tp])
        start = (await consumer.beginning_offsets([tp]))[tp]
        end = (await consumer.end_offsets([tp]))[tp]
        # Tansu reports the end as the start of the last batch: a record at the end
        # offset itself may exist, so it is fetched, not ruled out.
        if offset < start or offset > end:
            return None
        consumer.seek(tp, offset)
        for _ in range(3):
            try:
                batch = await consumer.getmany(tp, timeout_ms=1000, max_records=50)
            except OffsetOutOfRangeError:
                return None
            for message in batch.get(tp, []):
                if message.offset == offset:
                    return message.key, message.value
                if message.offset > offset:
                    return None
        return None
    finally:
        await consumer.stop()


async def changelog_range(
    bootstrap: Sequence[str],
    topic: str,
    options: Mapping[str, Any],
    partition: int,
    first: int,
    last: int,
) -> list[tuple[int, bytes, bytes | None, int | None]]:
    """The records ``first``..``last`` of a changelog partition as (offset, key as the
    worker writes it, raw value, owner epoch), in order (from the partition's start
    when ``first`` is before it)."""
    from aiokafka import TopicPartition

    consumer = await _consumer(bootstrap, options, "edgefeed-state-catch-up", "earliest")
    found: list[tuple[int, bytes, bytes | None, int | None]] = []
    try:
        tp = TopicPartition(topic, partition)
        consumer.assign([tp])
        start = (await consumer.beginning_offsets([tp]))[tp]
        consumer.seek(tp, max(first, start))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            batch = await consumer.getmany(tp, timeout_ms=500, max_records=1000)
            for message in batch.get(tp, []):
                if message.offset > last:
                    return found
                if message.offset >= first:
                    found.append(
                        (
                            message.offset,
                            _wire_to_key(message.key),
                            message.value,
                            record_epoch(message),
                        )
                    )
                if message.offset == last:
                    return found
        raise StateStoreError(
            f"could not read back {topic}[{partition}] {first}..{last} within 60 s"
        )
    finally:
        await consumer.stop()


def _wire_to_key(raw: bytes | None) -> bytes:
    if raw is not None and raw.startswith(b'"'):
        decoded = orjson.loads(raw)
        if isinstance(decoded, str):
            return decoded.encode()
    return raw or b""


async def _consumer(
    bootstrap: Sequence[str], options: Mapping[str, Any], client_id: str, reset: str
) -> Any:
    """A started aiokafka consumer that commits nothing (the caller stops it)."""
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(
        bootstrap_servers=list(bootstrap),
        client_id=client_id,
        enable_auto_commit=False,
        auto_offset_reset=reset,
        **dict(options),
    )
    await asyncio.wait_for(consumer.start(), 30)
    return consumer
