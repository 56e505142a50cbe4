"""Incremental snapshot progress, from Debezium's notifications.

Each connector writes its snapshot notifications (Debezium's sink notification
channel, ``notification.sink.topic.name``) to its own topic:
``STARTED`` (the tables), ``IN_PROGRESS`` per chunk (the table being read, the
last key read and the table's largest key), ``TABLE_SCAN_COMPLETED`` per table
(the rows read), then ``COMPLETED``, or ``PAUSED``/``RESUMED``/``ABORTED``.
The newest incremental snapshot of each connector is folded into one
:class:`~monitoring.model.SnapshotReport`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from edgefeed_base.kafkaclients import KafkaClientError, KafkaClients, in_daemon_thread
from monitoring.exceptions import SourceUnavailableError
from monitoring.model import SnapshotReport, SnapshotTable

__all__ = [
    "TAIL",
    "fold_notifications",
    "read_notifications",
    "read_notifications_sync",
    "read_snapshots",
]

TAIL = 2000
"""Notifications read per partition (the newest): one per chunk of 1024 rows, so
a snapshot of up to ~2 million rows is seen whole."""

_INCREMENTAL = "Incremental Snapshot"
PACED_WITHIN_MS = 30_000
"""A paused snapshot resumed before reads as PACED for this long after its newest
notification (the pacer's pulses come far more often)."""
_STATES = {
    "STARTED": "RUNNING",
    "RESUMED": "RUNNING",
    "IN_PROGRESS": "RUNNING",
    "TABLE_SCAN_COMPLETED": "RUNNING",
    "PAUSED": "PAUSED",
    "ABORTED": "ABORTED",
    "COMPLETED": "COMPLETED",
}


def _tables(text: str | None) -> list[str]:
    return [t.strip() for t in (text or "").split(",") if t.strip()]


def fold_notifications(
    connector: str, notifications: Iterable[Mapping[str, Any]], now_ms: int | None = None
) -> SnapshotReport | None:
    """The newest incremental snapshot of ``connector`` (None if it never ran one).

    A snapshot held by edgefeed's pacer (connectors.pacing) between its pulses
    reads ``PACED``, not ``PAUSED``: paused after being resumed before, with its
    newest notification less than ``PACED_WITHIN_MS`` old. One paused longer (a
    pacer killed while it held it) reads ``PAUSED``.

    Args:
        notifications: Debezium notifications in the order they were written.
        now_ms: The time to judge "recent" by (default: now).
    """
    resumed = False
    report: dict[str, Any] | None = None
    tables: dict[str, SnapshotTable] = {}
    for note in notifications:
        if note.get("aggregate_type") != _INCREMENTAL:
            continue
        kind = str(note.get("type", ""))
        data = note.get("additional_data") or {}
        if not isinstance(data, Mapping):
            data = {}
        if kind == "STARTED" or report is None:
            report = {"id": str(note.get("id", "")), "current": None, "last": None, "max": None}
            resumed = False
            tables = {
                t: SnapshotTable(t, None, "PENDING") for t in _tables(data.get("data_collections"))
            }
        if kind in _STATES:
            report["state"] = _STATES[kind]
        resumed = resumed or kind == "RESUMED"
        report["at"] = note.get("timestamp")
        if kind == "IN_PROGRESS":
            current = data.get("current_collection_in_progress")
            report.update(current=current, last=data.get("last_processed_key"))
            report["max"] = data.get("maximum_key")
            if current:
                tables[current] = SnapshotTable(current, None, "RUNNING")
        elif kind == "TABLE_SCAN_COMPLETED":
            table = str(data.get("scanned_collection") or data.get("data_collection") or "")
            try:
                rows: int | None = int(data.get("total_rows_scanned", ""))
            except ValueError:
                rows = None
            tables[table] = SnapshotTable(table, rows, str(data.get("status") or "SUCCEEDED"))
            if report["current"] == table:
                report.update(current=None, last=None, max=None)
    if report is None:
        return None
    at = report.get("at")
    updated = int(at) if isinstance(at, int | float | str) and str(at).isdigit() else None
    state = report.get("state", "RUNNING")
    if state == "PAUSED" and resumed and updated is not None:
        now = int(time.time() * 1000) if now_ms is None else now_ms
        if now - updated <= PACED_WITHIN_MS:
            state = "PACED"
    return SnapshotReport(
        connector=connector,
        id=report["id"],
        state=state,
        tables=tuple(tables.values()),
        current_table=report["current"],
        last_key=report["last"],
        max_key=report["max"],
        updated_ms=updated,
    )


async def read_notifications(
    bootstrap_servers: Sequence[str],
    topics: Sequence[str],
    *,
    client_id: str = "edgefeed-monitor",
    timeout_s: float = 10.0,
    tail: int = TAIL,
    client_options: Mapping[str, Any] | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """The newest ``tail`` notifications of each partition of ``topics``, in order.

    A topic that does not exist yet (no snapshot was ever signalled) reads as empty.
    kafka-python's consumer is synchronous: the read runs in a worker thread.

    Raises:
        SourceUnavailableError: the cluster could not be reached.
    """
    clients = KafkaClients(
        tuple(bootstrap_servers),
        client_id=client_id,
        request_timeout_ms=int(timeout_s * 1000),
        options=client_options or {},
    )
    return await in_daemon_thread(
        read_notifications_sync, clients, topics, timeout_s=timeout_s, tail=tail
    )


def read_notifications_sync(
    clients: KafkaClients, topics: Sequence[str], *, timeout_s: float = 10.0, tail: int = TAIL
) -> dict[str, list[dict[str, Any]]]:
    """:func:`read_notifications` in the calling thread, with a consumer from ``clients``.

    Raises:
        SourceUnavailableError: the cluster could not be reached.
    """
    try:
        consumer = clients.consumer(fetch_max_wait_ms=50)
        try:
            with clients.errors("read snapshot notifications"):
                records = _tails(consumer, topics, timeout_s, tail)
        finally:
            consumer.close()
    except KafkaClientError as exc:
        raise SourceUnavailableError("kafka", str(exc)) from None
    found: dict[str, list[dict[str, Any]]] = {topic: [] for topic in topics}
    ordered = sorted(
        (r.timestamp, tp.partition, r.offset, tp.topic, r.value)
        for tp, got in records.items()
        for r in got
    )
    for _, _, _, topic, raw in ordered:
        try:
            value = json.loads(raw) if raw else None
        except ValueError:
            continue
        if isinstance(value, dict) and "schema" in value and "payload" in value:
            value = value["payload"]  # a JsonConverter with schemas enabled
        if isinstance(value, dict):
            found[topic].append(value)
    return found


def _tails(
    consumer: Any, topics: Sequence[str], timeout_s: float, tail: int
) -> dict[Any, list[Any]]:
    """The newest ``tail`` records of each partition of the ``topics`` that exist."""
    from kafka import TopicPartition

    existing = consumer.topics()
    partitions = [
        TopicPartition(topic, p)
        for topic in topics
        if topic in existing
        for p in sorted(consumer.partitions_for_topic(topic) or ())
    ]
    if not partitions:
        return {}
    consumer.assign(partitions)
    ends = consumer.end_offsets(partitions)
    starts = consumer.beginning_offsets(partitions)
    pending = {}
    for tp in partitions:
        first = max(starts[tp], ends[tp] - tail)
        if ends[tp] > first:
            consumer.seek(tp, first)
            pending[tp] = ends[tp]
        else:
            consumer.pause(tp)  # nothing to read: no fetch for it
    records: dict[Any, list[Any]] = {tp: [] for tp in pending}
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        batch = consumer.poll(timeout_ms=200)
        for tp, got in batch.items():
            if tp not in pending:
                continue
            records[tp].extend(got)
            if got and got[-1].offset + 1 >= pending[tp]:
                del pending[tp]
                consumer.pause(tp)
    return records


async def read_snapshots(
    bootstrap_servers: Sequence[str],
    connectors: Mapping[str, str],
    **options: Any,
) -> tuple[SnapshotReport, ...]:
    """The newest incremental snapshot of each connector (``{connector: topic}``)."""
    if not connectors:
        return ()
    notes = await read_notifications(bootstrap_servers, list(connectors.values()), **options)
    reports = (fold_notifications(name, notes.get(topic, [])) for name, topic in connectors.items())
    return tuple(report for report in reports if report is not None)
