"""Read consumer group offsets, partition offsets and record timestamps from Kafka.

kafka-python's synchronous clients (edgefeed_base.kafkaclients), in a worker
thread of the monitor's round: one admin client and one group-less consumer per
round. The committed offsets are fetched with explicit partitions (every
partition of every non-internal topic): Kafka answers ``-1`` where a group has
none, and some Kafka-protocol brokers (Tansu) cannot answer the "all
partitions" form. Lag in seconds comes from the timestamp of the next
unconsumed record, fetched by seeking a group-less consumer to the committed
offset: it is read, not estimated.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from edgefeed_base.kafkaclients import KafkaClientError, KafkaClients, in_daemon_thread
from monitoring.deadletters import ReasonTally
from monitoring.exceptions import SourceUnavailableError

__all__ = ["GroupOffsets", "KafkaSnapshot", "partition_offsets", "read_kafka", "read_kafka_sync"]

TopicPartitionKey = tuple[str, int]


@dataclass(frozen=True, slots=True)
class GroupOffsets:
    """A group's coordinator state, live members (None: unknown) and committed offsets."""

    group: str
    state: str
    members: int | None
    committed: dict[TopicPartitionKey, int]


@dataclass(frozen=True, slots=True)
class KafkaSnapshot:
    """One read of the cluster.

    Attributes:
        at: When (seconds since the epoch) the offsets were read.
        oldest: First offset still stored, per partition.
        end: End offset (high watermark), per partition.
        groups: The selected groups.
        next_timestamp_ms: ``(group, topic, partition) -> timestamp`` (ms) of the
            record at the group's committed offset, where it lags.
        brokers: Brokers in the cluster metadata.
    """

    at: float
    oldest: dict[TopicPartitionKey, int]
    end: dict[TopicPartitionKey, int]
    groups: tuple[GroupOffsets, ...]
    next_timestamp_ms: dict[tuple[str, str, int], int]
    brokers: int


def _is_internal(topic: str) -> bool:
    # __consumer_offsets, __transaction_state, Connect's and Schema Registry's own topics.
    return topic.startswith("_")


async def read_kafka(
    bootstrap_servers: Sequence[str],
    *,
    select_group: Callable[[str], bool],
    client_id: str = "edgefeed-monitor",
    request_timeout_ms: int = 10_000,
    fetch_deadline_s: float = 3.0,
    client_options: Mapping[str, Any] | None = None,
    read_records_of: Callable[[str], bool] | None = None,
    reasons: ReasonTally | None = None,
) -> KafkaSnapshot:
    """Read offsets and next-record timestamps of the groups ``select_group`` accepts.

    kafka-python's clients are synchronous: the read runs in a worker thread, so a
    monitor's round reads Kafka while it reads the caches and the database.
    ``read_records_of`` limits the groups whose next records are fetched (for their
    timestamps; None: every selected group): the others get offsets only, and no
    record of their topics is read. ``reasons``, when given, reads the dead letters
    written since its last round and counts them by reason.

    Raises:
        SourceUnavailableError: the cluster could not be reached or refused a request.
    """
    clients = KafkaClients(
        tuple(bootstrap_servers),
        client_id=client_id,
        request_timeout_ms=request_timeout_ms,
        options=client_options or {},
    )
    return await in_daemon_thread(
        read_kafka_sync,
        clients,
        select_group=select_group,
        read_records_of=read_records_of,
        fetch_deadline_s=fetch_deadline_s,
        reasons=reasons,
    )


def read_kafka_sync(
    clients: KafkaClients,
    *,
    select_group: Callable[[str], bool],
    read_records_of: Callable[[str], bool] | None = None,
    fetch_deadline_s: float = 3.0,
    reasons: ReasonTally | None = None,
) -> KafkaSnapshot:
    """:func:`read_kafka`, in the calling thread, with clients from ``clients``.

    Raises:
        SourceUnavailableError: the cluster could not be reached or refused a request.
    """
    try:
        with ExitStack() as stack:
            admin = clients.admin()
            stack.callback(admin.close)
            consumer = clients.consumer(fetch_max_wait_ms=50, max_partition_fetch_bytes=64 * 1024)
            stack.callback(consumer.close)
            with clients.errors("read offsets"):
                snapshot = _read(
                    admin, consumer, select_group, read_records_of or select_group, fetch_deadline_s
                )
                if reasons is not None:
                    wanted = reasons.to_read(snapshot.oldest, snapshot.end)
                    reasons.read(consumer, wanted, fetch_deadline_s)
            return snapshot
    except KafkaClientError as exc:
        raise SourceUnavailableError("kafka", str(exc)) from None


def _read(
    admin: Any,
    consumer: Any,
    select_group: Callable[[str], bool],
    read_records_of: Callable[[str], bool],
    fetch_deadline_s: float,
) -> KafkaSnapshot:
    from kafka import TopicPartition
    from kafka.errors import KafkaError

    group_ids = sorted(
        {str(g["group_id"]) for g in admin.list_groups() if select_group(str(g["group_id"]))}
    )
    topics = sorted(t for t in admin.list_topics() if not _is_internal(t))
    tps: list[Any] = []
    if topics:
        for described in admin.describe_topics(topics):
            if described.get("error_code", 0):
                continue
            for part in described["partitions"]:
                tps.append(TopicPartition(described["name"], int(part["partition_index"])))
    at = time.time()
    end_raw = partition_offsets(consumer.end_offsets, tps)
    oldest_raw = partition_offsets(consumer.beginning_offsets, tps)
    end = {(tp.topic, tp.partition): int(v) for tp, v in end_raw.items()}
    oldest = {(tp.topic, tp.partition): int(v) for tp, v in oldest_raw.items()}

    # One group per DescribeGroups request: some Kafka-protocol brokers (Tansu)
    # answer a multi-group request with a response clients cannot decode.
    states: dict[str, tuple[str, int | None]] = {}
    for group_id in group_ids:
        try:
            described = admin.describe_groups([group_id]).get(group_id)
        except KafkaError:
            continue  # membership unknown: the status rules then assume a live member
        if described and not described.get("error"):
            states[group_id] = (str(described["group_state"]), len(described["members"]))

    groups: list[GroupOffsets] = []
    for group_id in group_ids:
        committed: dict[TopicPartitionKey, int] = {}
        if tps:
            offsets = admin.list_group_offsets({group_id: tps}).get(group_id, {})
            for tp, meta in offsets.items():
                if meta.offset >= 0:
                    committed[(tp.topic, tp.partition)] = int(meta.offset)
        state, members = states.get(group_id, ("Unknown", None))
        groups.append(GroupOffsets(group_id, state, members, committed))

    wanted: dict[TopicPartitionKey, set[int]] = {}
    for g in groups:
        if not read_records_of(g.group):
            continue
        for key, offset in g.committed.items():
            if key in end and offset < end[key]:
                wanted.setdefault(key, set()).add(max(offset, oldest.get(key, 0)))
    found = _timestamps_at(consumer, wanted, fetch_deadline_s)
    next_ts: dict[tuple[str, str, int], int] = {}
    for g in groups:
        if not read_records_of(g.group):
            continue
        for key, offset in g.committed.items():
            ts = found.get((key, max(offset, oldest.get(key, 0))))
            if ts is not None and offset < end.get(key, 0):
                next_ts[(g.group, key[0], key[1])] = ts
    cluster = admin.describe_cluster()
    brokers = len(cluster.get("brokers", ()))
    return KafkaSnapshot(at, oldest, end, tuple(groups), next_ts, brokers)


def partition_offsets(
    read: Callable[[list[Any]], dict[Any, int]], tps: list[Any]
) -> dict[Any, int]:
    """``read`` (a consumer's ``end_offsets`` or ``beginning_offsets``) for ``tps``,
    without the partitions the broker's answer lacks.

    A topic deleted or still being created between DescribeTopics and ListOffsets
    is missing from the answer, and kafka-python then raises ``KeyError`` for the
    whole request: the partitions are asked one by one instead, and those missing
    are left out (the next collection sees the topic as it is then), so that one
    topic's race never hides every group's lag.
    """
    if not tps:
        return {}
    try:
        return read(tps)
    except KeyError:
        found: dict[Any, int] = {}
        for tp in tps:
            try:
                found.update(read([tp]))
            except KeyError:
                continue
        return found


def _timestamps_at(
    consumer: Any, wanted: dict[TopicPartitionKey, set[int]], deadline_s: float
) -> dict[tuple[TopicPartitionKey, int], int]:
    """Timestamp (ms) of the first record at or after each wanted offset.

    A consumer has one position per partition, so partitions wanted at several
    offsets (several groups) are read in rounds.
    """
    from kafka import TopicPartition

    pending = {key: sorted(offsets) for key, offsets in wanted.items() if offsets}
    found: dict[tuple[TopicPartitionKey, int], int] = {}
    while pending:
        round_ = {key: offsets.pop(0) for key, offsets in pending.items()}
        pending = {key: offsets for key, offsets in pending.items() if offsets}
        tps = {TopicPartition(t, p): (t, p) for t, p in round_}
        consumer.assign(list(tps))
        for tp, key in tps.items():
            consumer.seek(tp, round_[key])
        waiting = set(tps)
        deadline = time.monotonic() + deadline_s
        while waiting and time.monotonic() < deadline:
            batch = consumer.poll(timeout_ms=200)
            for tp, records in batch.items():
                key = tps[tp]
                for record in records:
                    if record.offset >= round_[key]:
                        if record.timestamp is not None and record.timestamp >= 0:
                            found[(key, round_[key])] = int(record.timestamp)
                        waiting.discard(tp)
                        consumer.pause(tp)
                        break
        consumer.resume(*tps)
    return found
