"""Pacing an incremental snapshot, so that a backfill never starves streaming.

Debezium reads an incremental snapshot's chunks as fast as PostgreSQL returns them
(on the local stack it ramps to ~16,000 rows/s), and the reads share the change
topics' partitions with the streamed changes. Downstream, the router and the
regional workers then work through a burst of reads that a streamed change waits
behind: measured on the 2-core stack, a 30,000-row snapshot held streamed views
1.2-3.4 s while their baseline was 0.11 s. Debezium has no rate limit of its own,
so edgefeed adds one from outside with its ``pause-snapshot`` and
``resume-snapshot`` signals. The snapshot is held from its start and let read in
pulses: a resume, then a pause ``pulse_s`` later (5-200 ms, halved when a pulse
read more than 4 chunks, doubled when one read none). The next pulse goes once the
last one's chunks have shown up in the progress notifications (one per chunk of
``snapshot_chunk_rows`` rows) and the rows read leave room for another chunk in
``snapshot_rows_per_s`` times the time elapsed. A signal is a row read from the
WAL, like the snapshot's own watermarks, so a pause sent only once the snapshot
got ahead let it read on for 100-200 ms (bursts of 2,000-4,000 rows); a pulse
bounds every burst to a few chunks.

The pacer must not leave a snapshot paused: it resumes on every exit (a return,
an exception, Ctrl-C). A pacer killed with -9 while paused leaves it paused:
``edgefeed lag`` shows the snapshot ``PAUSED`` and ``edgefeed connectors
snapshot --resume`` resumes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import psycopg
from psycopg import sql

from connectors.config import notification_topic, signal_table
from connectors.database import _connect
from connectors.exceptions import SnapshotUnavailableError
from connectors.settings import DatabaseSettings, SourceSettings

__all__ = ["PaceReport", "SnapshotPacer", "write_signal"]

T = TypeVar("T")
_INCREMENTAL = "Incremental Snapshot"
_POLL_MS = 50
_PULSE_S = (0.005, 0.2)  # how long a pulse leaves the snapshot reading: from, up to
_PULSE_CHUNKS = 4  # a pulse that read more chunks than this is shortened
_SETTLE_S = 0.1  # a pulse's chunks are counted once none came for this long
_QUIET_S = 0.5  # a pulse that showed no chunk in this long read none


def write_signal(
    database: DatabaseSettings,
    source: SourceSettings,
    kind: str,
    data: Any,
    conn: psycopg.Connection[Any] | None = None,
) -> str:
    """Insert one Debezium signal (``kind``: execute-snapshot, pause-snapshot, ...)
    into the source's signal table (on ``conn`` when given, autocommit); its id.

    Raises:
        SnapshotUnavailableError: the signal table does not exist.
        SourceValidationError: the database cannot be reached.
    """
    signal_id = f"edgefeed-{uuid.uuid4()}"
    statement = sql.SQL("INSERT INTO {} (id, type, data) VALUES (%s, %s, %s)").format(
        sql.Identifier(*signal_table(source).split("."))
    )
    with contextlib.ExitStack() as stack:
        if conn is None:
            conn = stack.enter_context(_connect(database))
        try:
            conn.execute(statement, (signal_id, kind, json.dumps(data)))
        except psycopg.errors.UndefinedTable:
            raise SnapshotUnavailableError(
                f"the signal table {signal_table(source)} does not exist; run "
                "`edgefeed connectors apply` to create it"
            ) from None
    return signal_id


@dataclass
class PaceReport:
    """What the pacer saw.

    Attributes:
        state: ``COMPLETED``, ``ABORTED``, or ``TIMEOUT`` (the pacer stopped
            waiting; the snapshot goes on unpaced).
        chunks: Chunks read (progress notifications).
        pauses: Times the pacer paused the snapshot.
        seconds: From the signal to the end.
        tables: The tables scanned to their end, with the rows Debezium counted.
    """

    state: str = "RUNNING"
    chunks: int = 0
    pauses: int = 0
    seconds: float = 0.0
    tables: dict[str, int | None] = field(default_factory=dict)

    @property
    def rows_per_s(self) -> float | None:
        rows = sum(r for r in self.tables.values() if r is not None)
        return rows / self.seconds if rows and self.seconds > 0 else None

    def summary(self) -> str:
        """One line for the CLI."""
        rate = self.rows_per_s
        return (
            f"snapshot {self.state.lower()} in {self.seconds:.1f} s: {self.chunks} chunks, "
            f"paused {self.pauses} times" + (f", {rate:,.0f} rows/s" if rate is not None else "")
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "chunks": self.chunks,
            "pauses": self.pauses,
            "seconds": round(self.seconds, 3),
            "tables": dict(self.tables),
            "rows_per_s": None if self.rows_per_s is None else round(self.rows_per_s),
        }


@dataclass
class SnapshotPacer:
    """Signal snapshots of one source and pace them to ``rows_per_s`` until they end.

    Attributes:
        rows_per_s: The budget; 0 follows the snapshot without pausing it.
        chunk_rows: Rows per chunk (the connector's ``incremental.snapshot.chunk.size``).
    """

    database: DatabaseSettings
    source: SourceSettings
    bootstrap_servers: Sequence[str]
    rows_per_s: int
    chunk_rows: int
    client_options: dict[str, Any] = field(default_factory=dict)
    clock: Callable[[], float] = time.monotonic
    _conn: psycopg.Connection[Any] | None = field(default=None, init=False, repr=False)

    def run(
        self,
        signal: Callable[[], T],
        tables: Sequence[str],
        *,
        timeout_s: float | None = None,
        on_signalled: Callable[[T], None] | None = None,
    ) -> tuple[T, PaceReport]:
        """Start following the notifications, call ``signal`` (it writes the
        execute-snapshot signals of ``tables``), then pace until every table was
        scanned (or the snapshot was aborted, or ``timeout_s`` passed)."""
        return asyncio.run(self._run(signal, tables, timeout_s, on_signalled))

    def _signal(self, kind: str) -> None:
        write_signal(self.database, self.source, kind, {"type": "INCREMENTAL"}, self._conn)

    def _pulse(self, open_s: float) -> None:
        """Let the snapshot read for about ``open_s``: a resume, then a pause."""
        self._signal("resume-snapshot")
        time.sleep(open_s)
        self._signal("pause-snapshot")

    async def _run(
        self,
        signal: Callable[[], T],
        tables: Sequence[str],
        timeout_s: float | None,
        on_signalled: Callable[[T], None] | None,
    ) -> tuple[T, PaceReport]:
        from aiokafka import AIOKafkaConsumer, TopicPartition
        from aiokafka.errors import KafkaError

        topic = notification_topic(self.source)
        consumer = AIOKafkaConsumer(
            bootstrap_servers=list(self.bootstrap_servers),
            client_id="edgefeed-snapshot-pacer",
            enable_auto_commit=False,
            fetch_max_wait_ms=_POLL_MS,
            auto_offset_reset="earliest",  # a topic created by this snapshot: all of it
            metadata_max_age_ms=500,  # and notice its creation at once
            **self.client_options,
        )
        report = PaceReport()
        pacing = self.rows_per_s > 0
        self._conn = _connect(self.database) if pacing else None
        try:
            try:
                await asyncio.wait_for(consumer.start(), 30)
                # Debezium creates the topic with its first notification: read from the
                # start of a new topic, from its end otherwise (older snapshots' notes).
                existing = await consumer.topics()
                partitions = [
                    TopicPartition(topic, p)
                    for p in sorted(consumer.partitions_for_topic(topic) or ())
                ]
                ends = await consumer.end_offsets(partitions) if partitions else {}
            except (TimeoutError, KafkaError, OSError) as exc:
                raise SnapshotUnavailableError(
                    f"cannot follow the snapshot's notifications on {topic}: "
                    f"{type(exc).__name__}: {exc}"
                ) from None
            result = signal()
            if pacing:
                # Held from the start: the snapshot reads only in pulses (below).
                await asyncio.to_thread(self._pulse, _PULSE_S[0])
            if on_signalled is not None:
                on_signalled(result)
            began = self.clock()
            if topic in existing and partitions:
                consumer.assign(partitions)
                for tp in partitions:
                    consumer.seek(tp, ends[tp])
            else:
                consumer.subscribe([topic])
            wanted = set(tables)
            pulse_s = _PULSE_S[0]
            pulsed_at, chunks_at_pulse, last_chunk_at = began, 0, began
            while True:
                now = self.clock()
                report.seconds = now - began
                if timeout_s is not None and report.seconds > timeout_s:
                    report.state = "TIMEOUT"
                    break
                seen = report.chunks
                batch = await consumer.getmany(timeout_ms=_POLL_MS)
                for records in batch.values():
                    for record in records:
                        self._fold(record.value, report)
                now = self.clock()
                if report.chunks > seen:
                    last_chunk_at = now
                done = report.state in ("COMPLETED", "ABORTED") and all(
                    any(_same_table(t, name) for name in report.tables) for t in wanted
                )
                if report.state == "ABORTED" or done:
                    break
                if not pacing:
                    continue
                # The last pulse has shown its chunks (or none came): the next may go
                # once the rows read leave room for a chunk in the budget.
                got = report.chunks - chunks_at_pulse
                settled = (got and now - last_chunk_at >= _SETTLE_S) or (
                    now - pulsed_at >= _QUIET_S
                )
                read = report.chunks * self.chunk_rows
                if not settled or read + self.chunk_rows > self.rows_per_s * (now - began):
                    continue
                if not got:  # the snapshot read nothing in that pulse: open longer
                    pulse_s = min(pulse_s * 2, _PULSE_S[1])
                elif got > _PULSE_CHUNKS:
                    pulse_s = max(pulse_s / 2, _PULSE_S[0])
                await asyncio.to_thread(self._pulse, pulse_s)
                report.pauses += 1
                pulsed_at, chunks_at_pulse = self.clock(), report.chunks
            report.seconds = self.clock() - began
            return result, report
        finally:
            try:
                if pacing:
                    # Never leave a snapshot paused (Ctrl-C and errors included).
                    await asyncio.to_thread(self._signal, "resume-snapshot")
            finally:
                try:
                    await consumer.stop()
                finally:
                    if self._conn is not None:
                        self._conn.close()
                        self._conn = None

    @staticmethod
    def _fold(raw: bytes | None, report: PaceReport) -> None:
        try:
            note = json.loads(raw) if raw else None
        except ValueError:
            return
        if isinstance(note, dict) and "payload" in note and "schema" in note:
            note = note["payload"]
        if not isinstance(note, dict) or note.get("aggregate_type") != _INCREMENTAL:
            return
        kind = str(note.get("type", ""))
        data = note.get("additional_data") or {}
        if not isinstance(data, dict):
            data = {}
        if kind == "IN_PROGRESS":
            report.chunks += 1
        elif kind == "TABLE_SCAN_COMPLETED":
            table = str(data.get("scanned_collection") or data.get("data_collection") or "")
            try:
                report.tables[table] = int(data.get("total_rows_scanned", ""))
            except ValueError:
                report.tables[table] = None
        if kind in ("COMPLETED", "ABORTED"):
            report.state = kind
        elif kind in ("STARTED", "RESUMED", "IN_PROGRESS", "PAUSED", "TABLE_SCAN_COMPLETED"):
            report.state = "RUNNING"


def _same_table(wanted: str, seen: str) -> bool:
    """Debezium names a PostgreSQL table ``schema.table``, some versions with the
    database in front."""
    return seen == wanted or seen.endswith("." + wanted)
