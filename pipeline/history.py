"""Does the stream's history cover the windows? If not, rebuild it from the source.

A windowed feature needs every row of its table whose event time is still inside
its window (``occurred_at > now - longest window``). The regional workers build
their states from the change stream, so a row that is in PostgreSQL but not in
the stream's history is silently missing from every window that covers it:
after the broker lost its topics (an in-memory broker restarted, a lost
cluster), when the topic's retention is shorter than the longest window, for a
new deployment over a table that already holds recent rows, or after a
restored database. A table declared ``snapshot: false`` is never read again by
a new connector, so nothing else would ever bring those rows back.

The router checks it at start, for the whole source, per table the features read
(:class:`HistoryGuard`; a table without windows needs every row, and is covered
when its topic begins with the connector's snapshot of it; a region added since
the last check gets its own rows rebuilt, see :meth:`HistoryGuard.run`):

1. **Already covered?** The router's *history record* (a one-partition topic,
   ``<app_prefix>-router-history``, that lives and dies with the broker's other
   topics) says ``complete`` for the table: nothing to do. A lost broker loses
   the record with the history it describes.
2. **Detect.** Otherwise it asks PostgreSQL how many rows the windows still need
   (``time_column > now - window``) and when the oldest of them happened, and
   reads when the stream's history of the table begins (the source commit time
   of the first record on each partition of the table's Debezium topic). Rows
   the windows need that are older than the stream's history are a *gap*: it is
   logged once with what is missing, counted on ``edgefeed_pipeline_history_gap``
   and never served as complete.
3. **Rebuild** (``pipeline.rebuild: auto``, the default). The router tells every
   region, in band, that the entity types fed by the table are rebuilding (a
   ``h`` marker on every partition of every regional topic: each worker lists
   it in its Redis, where ``edgefeed lag``, the exporter and the lookup client
   read it), then signals a Debezium incremental snapshot of the table filtered
   to the rows the windows still need (``time_column > cutoff``), paced like
   every other snapshot (connectors/pacing.py) while streaming goes on. Once
   the snapshot completed and the router has routed every record of the table's
   topic up to its end, it sends the end marker (after those rows on every
   partition, so a region leaves "rebuilding" only once it holds them) and
   records the table ``complete``. A snapshot read of a row a state already
   holds with the same values changes nothing, so the rows the stream also
   carried are neither lost nor counted twice.
   With ``pipeline.rebuild: off`` a gap is an error in the log that names the
   command to run (``edgefeed connectors snapshot --table T --filter ...``).

Rows whose event time is later than the stream's first commit are taken to be
in the stream (an event is committed after it happened); a row recorded late
(older event time, later commit) makes the check see a gap that is not there,
which costs a needless (idempotent) rebuild, never a wrong value.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

import orjson

from pipeline.exceptions import PipelineConfigError
from pipeline.features import EntityEngine
from pipeline.messages import RegionalChange
from pipeline.settings import EntitySettings

__all__ = [
    "HISTORY_BEGIN",
    "HISTORY_END",
    "HistoryColumnError",
    "HistoryGuard",
    "HistoryNeed",
    "HistoryPorts",
    "SourceRows",
    "StreamStart",
    "history_marker",
    "history_needs",
    "rebuild_filter",
]

log = logging.getLogger("edgefeed.pipeline")

HISTORY_BEGIN, HISTORY_END = "begin", "end"
_TIME_TYPES = frozenset(("timestamp with time zone", "timestamp without time zone", "date"))
RETRY_FIRST_S, RETRY_MAX_S = 2.0, 30.0  # backoff while a rebuild cannot start


class HistoryColumnError(PipelineConfigError):
    """A windowed table's time column is missing or not a time: its rows cannot be
    selected by event time, so the history cannot be checked or rebuilt."""


@dataclass(frozen=True, slots=True)
class HistoryNeed:
    """The rows one windowed table must hold for the windows it feeds.

    Attributes:
        table: ``schema.table``.
        time_column: The column whose value places a row in a window; None for a
            table that feeds no window (latest values): every row is needed.
        window_ms: The longest window over it (a zone's day counts 25 hours); None
            with ``time_column``.
        entities: The entity types that read it.
        home_column: The column naming a personal row's home region (None: shared
            data, every region holds it).
    """

    table: str
    time_column: str | None
    window_ms: int | None
    entities: tuple[str, ...]
    home_column: str | None = None

    @property
    def key(self) -> str:
        """The history record's key."""
        return self.table if self.time_column is None else f"{self.table}.{self.time_column}"


@dataclass(frozen=True, slots=True)
class StreamStart:
    """Where the stream's history of a table begins: the source commit time of the
    first record of its topic (the earliest over its partitions), and whether every
    partition begins with the connector's initial snapshot of the table (its rows
    were all read then)."""

    commit_ms: int
    snapshotted: bool


@dataclass(frozen=True, slots=True)
class SourceRows:
    """What the source holds of the rows a window needs: how many, and the event time
    of the oldest (ms since the epoch; None when there are none); and the event time
    of the table's oldest row of all (None: empty, or a table without windows)."""

    count: int
    oldest_ms: int | None
    table_oldest_ms: int | None = None


def history_needs(
    entities: Iterable[EntitySettings], home_columns: Mapping[str, str | None] | None = None
) -> list[HistoryNeed]:
    """Every table the features read: a windowed one per (table, time column), with its
    longest window; one without windows (latest values) whole. With their entity types
    and, from ``home_columns`` (table -> column), the home-region column of each."""
    homes = home_columns or {}
    windowed: dict[tuple[str, str], tuple[int, list[str]]] = {}
    whole: dict[str, list[str]] = {}
    for entity in entities:
        for table, needs in EntityEngine(entity).needs.items():
            if needs.retention_ms is None or needs.time_column is None:
                whole.setdefault(table, []).append(entity.name)
                continue
            window, names = windowed.get((table, needs.time_column), (0, []))
            windowed[(table, needs.time_column)] = (
                max(window, needs.retention_ms),
                [*names, entity.name],
            )
    found = [
        HistoryNeed(table, column, window, tuple(sorted(set(names))), homes.get(table))
        for (table, column), (window, names) in windowed.items()
    ]
    found += [
        HistoryNeed(table, None, None, tuple(sorted(set(names))), homes.get(table))
        for table, names in whole.items()
        if not any(n.table == table for n in found)  # a windowed table is checked by time
    ]
    return sorted(found, key=lambda n: n.key)


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat()


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def rebuild_filter(
    need: HistoryNeed, cutoff_ms: int, homes: Sequence[str] | None = None
) -> str | None:
    """The snapshot filter selecting the rows the windows still need (None: every row,
    for a table without windows), of the regions ``homes`` only when the table is
    personal (a shared row is every region's)."""
    parts = []
    if need.time_column is not None:
        parts.append(f"{_quoted(need.time_column)} > '{_iso(cutoff_ms)}'::timestamptz")
    if homes is not None and need.home_column is not None:
        listed = ", ".join("'" + home.replace("'", "''") + "'" for home in homes)
        parts.append(f"{_quoted(need.home_column)} IN ({listed})")
    return " AND ".join(parts) or None


def history_marker(table: str, state: str, rebuild_id: str, entities: Sequence[str]) -> bytes:
    """The regional message that opens (``begin``) or closes (``end``) a rebuild of
    ``table`` for ``entities`` (a pack of one ``h`` change)."""
    change = RegionalChange(
        table,
        "h",
        0,
        0,
        int(time.time() * 1000),
        row={"state": state, "id": rebuild_id, "entities": list(entities)},
    )
    return b"[" + change.encode() + b"]"


class HistoryPorts(Protocol):
    """What the guard needs from the world (the router implements it on Faust, Kafka
    and PostgreSQL; the unit tests in memory)."""

    async def read_records(self) -> dict[str, dict[str, Any]]:
        """The history records (key -> record), the newest per key."""
        ...

    async def write_record(self, key: str, record: Mapping[str, Any]) -> None: ...

    async def source_rows(
        self, need: HistoryNeed, cutoff_ms: int, homes: Sequence[str] | None = None
    ) -> SourceRows:
        """What the source holds of the rows the features need (of the regions
        ``homes`` only, for a personal table).

        Raises:
            HistoryColumnError: the time column is missing or not a time.
        """
        ...

    async def stream_start(self, table: str) -> StreamStart | None:
        """Where the table's topic begins (None: it holds nothing yet)."""
        ...

    async def send_markers(self, body: bytes, regions: Sequence[str]) -> None:
        """Send ``body`` to every partition of the regional topics of ``regions``."""
        ...

    async def snapshot(self, table: str, filter_sql: str | None) -> str:
        """Signal a paced incremental snapshot and follow it to its end; its final
        state (``COMPLETED``, ``ABORTED``, ``TIMEOUT``).

        Raises:
            Exception: it could not be signalled (retried).
        """
        ...

    async def routed_to_end(self, table: str) -> None:
        """Return once the router has routed every record of the table's topic up to
        its present end."""
        ...


@dataclass
class HistoryGuard:
    """Checks at start that the stream's history covers the windows, and rebuilds the
    tables where it does not (see the module docstring).

    Attributes:
        needs: The tables the features read (:func:`history_needs`).
        ports: The world.
        regions: Every region: a history record names the regions it covers, and a
            region added since (a new region's topic and states are empty) gets
            its own rows rebuilt, the other regions left alone.
        rebuild: ``auto`` rebuilds a gap; ``off`` reports it as an error.
        on_state: Called with (table, state) as tables go ``checking`` ->
            ``complete`` | ``rebuilding`` | ``gap`` (metrics).
    """

    needs: Sequence[HistoryNeed]
    ports: HistoryPorts
    regions: Sequence[str] = ()
    rebuild: str = "auto"
    on_state: Callable[[HistoryNeed, str], None] = lambda need, state: None
    wall: Callable[[], float] = time.time
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    states: dict[str, str] = field(default_factory=dict)

    async def run(self) -> None:
        """Check every table the features read; rebuild those with a gap, one at a
        time (for every region, or for the regions the table's record does not name)."""
        records = await self.ports.read_records()
        for need in self.needs:
            record = records.get(need.key) or {}
            if record.get("state") == "complete":
                covered = record.get("regions")
                new = [r for r in self.regions if isinstance(covered, list) and r not in covered]
                if new:
                    await self._check(need, record, new)
                    continue
                log.info("history of %s covers its windows (recorded complete)", need.table)
                self._set(need, "complete")
                continue
            await self._check(need, record)

    def _set(self, need: HistoryNeed, state: str) -> None:
        self.states[need.key] = state
        self.on_state(need, state)

    async def _check(
        self, need: HistoryNeed, record: Mapping[str, Any], new: Sequence[str] | None = None
    ) -> None:
        """Check (and rebuild) the table for every region, or for the ``new`` regions
        only: their topics and states begin empty, whatever the stream holds."""
        self._set(need, "checking")
        now_ms = int(self.wall() * 1000)
        cutoff_ms = now_ms - (need.window_ms or 0)
        homes = None if new is None or need.home_column is None else list(new)
        try:
            rows = await self.ports.source_rows(need, cutoff_ms, homes)
        except HistoryColumnError as exc:
            log.error("history of %s cannot be checked: %s", need.table, exc)
            self._set(need, "gap")
            return
        first = rows.table_oldest_ms
        if need.time_column is not None and first is not None and first > cutoff_ms:
            log.warning(
                "the source's own history of %s begins at %s, after the start of the "
                "longest window of %s (%s): windows reaching before it hold what the "
                "source holds; if older rows were purged from the source, those windows "
                "stay short until %s",
                need.table,
                _iso(first),
                ", ".join(need.entities),
                _iso(cutoff_ms),
                _iso(first + (need.window_ms or 0)),
            )
        if rows.count == 0:
            await self._complete(need, now_ms, "no row the features need")
            return
        start = await self.ports.stream_start(need.table)
        if new is not None:  # a new region's history begins now, whatever the stream's
            covered = False
        elif need.time_column is None:  # every row counts: read whole by the connector?
            covered = start is not None and start.snapshotted
        else:
            covered = start is not None and start.commit_ms <= (rows.oldest_ms or 0)
        if covered and record.get("state") != "rebuilding":  # an interrupted one goes on
            why = "it begins with the connector's snapshot of the table"
            if need.time_column is not None and start is not None:
                why = f"the stream begins at {_iso(start.commit_ms)}"
            await self._complete(need, now_ms, why)
            return
        begins = (
            "holds none of it"
            if start is None
            else f"begins at {_iso(start.commit_ms)}"
            + ("" if start.snapshotted else ", without a snapshot of the table")
        )
        if new is not None:
            begins = f"does not reach the new region(s) {', '.join(new)}: they begin now"
        filter_sql = rebuild_filter(need, cutoff_ms, homes)
        wanted = (
            "every row"
            if need.time_column is None
            else f"{need.time_column} since {_iso(cutoff_ms)}, the oldest at "
            f"{_iso(rows.oldest_ms or cutoff_ms)}"
        )
        log.warning(
            "history gap: %d rows of %s that the features of %s still need (%s) are not "
            "all in the stream, whose history %s",
            rows.count,
            need.table,
            ", ".join(need.entities),
            wanted,
            begins,
        )
        if self.rebuild != "auto":
            self._set(need, "gap")
            command = f"edgefeed connectors snapshot --table {need.table}" + (
                "" if filter_sql is None else f' --filter "{filter_sql}"'
            )
            log.error(
                "pipeline.rebuild is off: the features of %s are short until you run `%s`",
                ", ".join(need.entities),
                command,
            )
            await self.ports.write_record(
                need.key, {"state": "gap", "filter": filter_sql, "at_ms": now_ms}
            )
            return
        await self._rebuild(need, filter_sql, cutoff_ms, new)

    async def _complete(self, need: HistoryNeed, now_ms: int, why: str) -> None:
        record = {"state": "complete", "at_ms": now_ms, "regions": list(self.regions)}
        await self.ports.write_record(need.key, record)
        log.info("history of %s covers its windows (%s)", need.table, why)
        self._set(need, "complete")

    async def _rebuild(
        self,
        need: HistoryNeed,
        filter_sql: str | None,
        cutoff_ms: int,
        new: Sequence[str] | None = None,
    ) -> None:
        """Rebuild by a snapshot filtered with ``filter_sql``, between markers to the
        regions that lack the rows (``new``, or every region)."""
        rebuild_id = f"rebuild-{uuid.uuid4().hex[:12]}"
        marked = list(new) if new is not None else list(self.regions)
        self._set(need, "rebuilding")
        await self.ports.write_record(
            need.key,
            {"state": "rebuilding", "id": rebuild_id, "filter": filter_sql, "since_ms": cutoff_ms},
        )
        await self.ports.send_markers(
            history_marker(need.table, HISTORY_BEGIN, rebuild_id, need.entities), marked
        )
        started = time.monotonic()
        delay = RETRY_FIRST_S
        while True:
            try:
                state = await self.ports.snapshot(need.table, filter_sql)
            except Exception as exc:  # a connector not running yet, a database blip
                log.warning(
                    "history rebuild of %s could not run (%s); retrying in %.0f s",
                    need.table,
                    exc,
                    delay,
                )
                await self.sleep(delay)
                delay = min(RETRY_MAX_S, delay * 2)
                continue
            log.info("history rebuild of %s: snapshot %s", need.table, state)
            if state == "COMPLETED":
                break
            log.warning("history rebuild of %s ended %s; starting it again", need.table, state)
            await self.sleep(delay)
        await self.ports.routed_to_end(need.table)
        await self.ports.send_markers(
            history_marker(need.table, HISTORY_END, rebuild_id, need.entities), marked
        )
        await self.ports.write_record(
            need.key,
            {
                "state": "complete",
                "id": rebuild_id,
                "at_ms": int(self.wall() * 1000),
                "regions": list(self.regions),
            },
        )
        self._set(need, "complete")
        log.warning(
            "history of %s rebuilt in %.1f s: the features of %s are complete",
            need.table,
            time.monotonic() - started,
            ", ".join(need.entities),
        )


def check_time_column(table: str, column: str, data_type: str | None) -> None:
    """Raises HistoryColumnError unless ``data_type`` is a time type."""
    if data_type is None:
        raise HistoryColumnError(
            f"table {table} has no column {column!r}, the time column its windows read "
            f"(entities[].time_columns); add the column or fix the setting"
        )
    if data_type not in _TIME_TYPES:
        raise HistoryColumnError(
            f"column {table}.{column} is {data_type}, not a timestamp: the rows a window "
            "needs cannot be selected by time to rebuild them; rebuild by hand with "
            f"`edgefeed connectors snapshot --table {table} --filter ...`"
        )


def source_rows(
    database: Any, need: HistoryNeed, cutoff_ms: int, homes: Sequence[str] | None = None
) -> SourceRows:
    """Count the rows the features need in PostgreSQL (blocking; run in a thread), of
    the regions ``homes`` only when given (a personal table).

    Raises:
        HistoryColumnError: the time column is missing or not a time.
    """
    from psycopg import sql

    from connectors.database import _connect

    schema, table = need.table.split(".", 1)
    where: sql.Composable = sql.SQL("TRUE")
    params: list[Any] = []
    if homes is not None and need.home_column is not None:
        where = sql.SQL("{} = ANY(%s)").format(sql.Identifier(need.home_column))
        params = [list(homes)]
    with _connect(database) as conn:
        if need.time_column is None:
            counted = conn.execute(
                sql.SQL("SELECT count(*) FROM {} WHERE {}").format(
                    sql.Identifier(schema, table), where
                ),
                params,
            ).fetchone()
            return SourceRows(0 if counted is None else int(str(counted[0])), None)
        found = conn.execute(
            "SELECT data_type FROM information_schema.columns "
            "WHERE table_schema = %s AND table_name = %s AND column_name = %s",
            (schema, table, need.time_column),
        ).fetchone()
        check_time_column(need.table, need.time_column, None if found is None else str(found[0]))
        query = sql.SQL(
            "SELECT count(*) FILTER (WHERE {col} > to_timestamp(%s)), "
            "(extract(epoch FROM min({col}) FILTER (WHERE {col} > to_timestamp(%s))) "
            "* 1000)::bigint, (extract(epoch FROM min({col})) * 1000)::bigint FROM {tab} "
            "WHERE {where}"
        ).format(
            col=sql.Identifier(need.time_column),
            tab=sql.Identifier(schema, table),
            where=where,
        )
        row = conn.execute(query, [cutoff_ms / 1000, cutoff_ms / 1000, *params]).fetchone()
    if row is None:
        return SourceRows(0, None)
    count, oldest, first = row
    return SourceRows(
        int(str(count)),
        None if oldest is None else int(str(oldest)),
        None if first is None else int(str(first)),
    )


async def read_records(
    bootstrap: Sequence[str], topic: str, options: Mapping[str, Any], idle_s: float = 0.5
) -> dict[str, dict[str, Any]]:
    """The newest record per key of a small topic, read from its start to its end (and
    until nothing came for ``idle_s``: Tansu reports a partition's end as the start
    of its last batch)."""
    records: dict[str, dict[str, Any]] = {}
    async for _partition, message in _read(bootstrap, topic, options, idle_s, from_end=False):
        if message.key is None:
            continue
        try:
            value = orjson.loads(message.value) if message.value else None
        except orjson.JSONDecodeError:
            continue
        if isinstance(value, dict):
            records[message.key.decode("utf-8", "replace")] = value
    return records


async def stream_start(
    bootstrap: Sequence[str], topic: str, options: Mapping[str, Any], idle_s: float = 0.5
) -> StreamStart | None:
    """Where a Debezium topic begins: the earliest source commit time (``source.ts_ms``)
    among the first record of each partition, and whether each of those is a read of
    the connector's initial snapshot; None when it holds no change."""
    from pipeline.envelope import decode_change

    firsts: dict[int, tuple[int, bool]] = {}
    async for partition, message in _read(bootstrap, topic, options, idle_s, first_only=True):
        if partition in firsts:
            continue
        with contextlib.suppress(Exception):
            change = decode_change(message.value or b"", offset=message.offset)
            if change is not None:
                initial = change.op == "r" and change.snapshot not in (None, "incremental")
                firsts[partition] = (change.commit_ms, initial)
    if not firsts:
        return None
    return StreamStart(
        min(ms for ms, _ in firsts.values()), all(initial for _, initial in firsts.values())
    )


async def topic_ends(
    bootstrap: Sequence[str], topic: str, options: Mapping[str, Any], idle_s: float = 0.5
) -> dict[int, int]:
    """Partition -> the offset of its last record as of now, at least (partitions with
    none are left out), read, not asked: Tansu's reported end is the start of the last
    batch. One fetch per partition from the record before the reported end, so that a
    topic still being written does not keep the read going."""
    last: dict[int, int] = {}
    async for partition, message in _read(
        bootstrap, topic, options, idle_s, from_end=True, first_only=True
    ):
        last[partition] = max(last.get(partition, -1), message.offset)
    return last


async def _read(
    bootstrap: Sequence[str],
    topic: str,
    options: Mapping[str, Any],
    idle_s: float,
    *,
    from_end: bool = False,
    first_only: bool = False,
) -> Any:
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(
        bootstrap_servers=list(bootstrap),
        client_id="edgefeed-history",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        **dict(options),
    )
    await asyncio.wait_for(consumer.start(), 30)
    try:
        found = await consumer.topics()
        if topic not in found:
            return
        parts = consumer.partitions_for_topic(topic) or set()
        assigned = [TopicPartition(topic, p) for p in sorted(parts)]
        if not assigned:
            return
        consumer.assign(assigned)
        ends = await consumer.end_offsets(assigned)
        todo = set(assigned)
        for tp in assigned:
            if from_end:
                consumer.seek(tp, max(0, ends[tp] - 1))
            else:
                await consumer.seek_to_beginning(tp)
        while True:
            batch = await consumer.getmany(timeout_ms=int(idle_s * 1000), max_records=1000)
            if not batch:
                return
            for tp, messages in batch.items():
                for message in messages:
                    yield tp.partition, message
                if first_only and messages:  # one fetch of the partition is enough
                    consumer.pause(tp)
                    todo.discard(tp)
            if first_only and not todo:
                return
    finally:
        await consumer.stop()
