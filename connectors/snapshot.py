"""Ad-hoc incremental snapshots: Debezium's ``execute-snapshot`` through the signal table.

An incremental snapshot re-reads a table's rows (or those a filter selects) in
chunks while streaming goes on; Debezium interleaves the chunks with the WAL
(watermarks in the signal table) so no change is lost or overtaken. Every
check runs before the signal is written: a table no source captures, a filter
PostgreSQL does not accept, a connector that is not running with signalling on
are refused and nothing is signalled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from connectors.client import ConnectClient
from connectors.config import notification_topic, signal_table
from connectors.database import _connect
from connectors.exceptions import (
    SnapshotFilterError,
    SnapshotTableError,
    SnapshotUnavailableError,
)
from connectors.pacing import PaceReport, SnapshotPacer, write_signal
from connectors.secrets import redact
from connectors.settings import DatabaseSettings, SourceSettings, TableSettings

__all__ = [
    "SnapshotRequest",
    "check_filter",
    "request_snapshot",
    "signal_payload",
    "snapshot_paced",
    "source_of",
]

MAX_FILTER_CHARS = 4096
_CHECK_TIMEOUT_MS = 5000


@dataclass(frozen=True, slots=True)
class SnapshotRequest:
    """A snapshot signal written to a source's signal table.

    Attributes:
        id: The signal's id (Debezium names it in its notifications).
        source: The source's name.
        connector: Its connector, ``edgefeed-<source>``.
        table: ``schema.table``.
        filter: The SQL condition, or None for every row.
        notification_topic: Where Debezium reports the snapshot's progress.
    """

    id: str
    source: str
    connector: str
    table: str
    filter: str | None
    notification_topic: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "source": self.source,
            "connector": self.connector,
            "table": self.table,
            "filter": self.filter,
            "notification_topic": self.notification_topic,
        }


def _qualified(table: str) -> str:
    return table if "." in table else f"public.{table}"


def source_of(
    sources: Sequence[SourceSettings], table: str
) -> tuple[SourceSettings, TableSettings]:
    """The source that captures ``table`` (``schema.table`` or ``table``).

    Raises:
        SnapshotTableError: no source captures it.
    """
    qualified = _qualified(table)
    for source in sources:
        for declared in source.tables:
            if declared.name == qualified:
                return source, declared
    captured = sorted(t.name for s in sources for t in s.tables)
    raise SnapshotTableError(
        f"table {table!r} is not captured by any source (captured: "
        f"{', '.join(captured) or 'none'}); name a captured table, or declare it under "
        "sources[].tables and run `edgefeed connectors apply` first"
    )


def signal_payload(table: str, filter_sql: str | None) -> dict[str, Any]:
    """The ``data`` of an ``execute-snapshot`` signal (Debezium 2.5+ format)."""
    payload: dict[str, Any] = {"data-collections": [table], "type": "incremental"}
    if filter_sql is not None:
        # Parenthesised: Debezium appends the condition to its chunk query with AND,
        # where an unbracketed OR would escape the chunk's key range.
        payload["additional-conditions"] = [{"data-collection": table, "filter": f"({filter_sql})"}]
    return payload


def check_filter(database: DatabaseSettings, table: TableSettings, filter_sql: str) -> None:
    """Have PostgreSQL plan ``SELECT * FROM table WHERE (filter)``, read-only.

    The statement is prepared (so a second statement after a ``;`` is refused
    by the server, as Debezium's own prepared chunk query would refuse it),
    runs in a READ ONLY transaction with a statement timeout and is only
    EXPLAINed, never executed; the transaction is rolled back.

    Raises:
        SnapshotFilterError: empty, too long, or not valid for the table.
    """
    shown = filter_sql if len(filter_sql) <= 200 else f"{filter_sql[:197]}..."
    if not filter_sql.strip():
        raise SnapshotFilterError(
            f"the snapshot filter for {table.name} is empty; give a SQL condition on its "
            "columns (e.g. --filter \"created_at > now() - interval '7 days'\") or leave "
            "--filter out to snapshot every row"
        )
    if len(filter_sql) > MAX_FILTER_CHARS:
        raise SnapshotFilterError(
            f"the snapshot filter for {table.name} has {len(filter_sql)} characters, over "
            f"the {MAX_FILTER_CHARS} a signal may carry; shorten it"
        )
    query = sql.SQL("EXPLAIN SELECT * FROM {} WHERE ({})").format(
        sql.Identifier(table.schema_name, table.table_name), sql.SQL(filter_sql)
    )
    with _connect(database) as conn:
        try:
            with conn.transaction():
                conn.execute("SET TRANSACTION READ ONLY")
                conn.execute(f"SET LOCAL statement_timeout = {_CHECK_TIMEOUT_MS}")
                conn.execute(query, prepare=True)
                raise _RollBack
        except _RollBack:
            return
        except psycopg.Error as exc:
            reason = redact(str(exc).strip().splitlines()[0], database.secrets())
            raise SnapshotFilterError(
                f"snapshot filter {shown!r} is not a valid SQL condition on {table.name}: "
                f"{reason}; fix the filter (a WHERE condition on {table.name}'s columns)"
            ) from None


class _RollBack(Exception):
    """Leaves ``conn.transaction()`` by rolling back."""


def _check_connector(client: ConnectClient, source: SourceSettings) -> None:
    name = source.connector_name
    config = client.get_config(name)
    if config is None:
        raise SnapshotUnavailableError(
            f"connector {name} is not deployed; run `edgefeed connectors apply` first"
        )
    if config.get("signal.data.collection") != signal_table(source):
        raise SnapshotUnavailableError(
            f"connector {name} is deployed without the signal table {signal_table(source)} "
            "(an older config); run `edgefeed connectors apply` to update it"
        )
    status = client.status(name)
    if status is None or not status.running:
        state = "absent" if status is None else status.state
        cause = status.failure() if status is not None else None
        raise SnapshotUnavailableError(
            f"connector {name} is not running (state {state}"
            f"{': ' + cause if cause else ''}); a signal would wait in the table until it "
            f"runs: fix it first (`edgefeed connectors status`, `restart {name}`)"
        )


def request_snapshot(
    client: ConnectClient,
    database: DatabaseSettings,
    sources: Sequence[SourceSettings],
    table: str,
    filter_sql: str | None = None,
) -> SnapshotRequest:
    """Check everything, then write an ``execute-snapshot`` signal for ``table``.

    Raises:
        SnapshotTableError: no source captures ``table``.
        SnapshotFilterError: ``filter_sql`` is not a valid condition on the table.
        SnapshotUnavailableError: the connector is absent, stopped, or has no signal table.
        SourceValidationError: the database cannot be reached.
    """
    source, declared = source_of(sources, table)
    if filter_sql is not None:
        check_filter(database, declared, filter_sql)
    _check_connector(client, source)
    signal_id = write_signal(
        database, source, "execute-snapshot", signal_payload(declared.name, filter_sql)
    )
    return SnapshotRequest(
        id=signal_id,
        source=source.name,
        connector=source.connector_name,
        table=declared.name,
        filter=filter_sql,
        notification_topic=notification_topic(source),
    )


def snapshot_paced(
    client: ConnectClient,
    database: DatabaseSettings,
    sources: Sequence[SourceSettings],
    wanted: Sequence[tuple[str, str | None]],
    bootstrap_servers: Sequence[str],
    *,
    client_options: dict[str, Any] | None = None,
    timeout_s: float | None = None,
    on_signalled: Callable[[list[SnapshotRequest]], None] | None = None,
) -> tuple[list[SnapshotRequest], list[PaceReport]]:
    """Signal a snapshot of each ``(table, filter)`` and follow them to their end,
    paced to each source's ``snapshot_rows_per_s`` (connectors/pacing.py).

    Every table is checked before anything is signalled. ``on_signalled`` is called
    once a source's signals are written, before the pacing (so that an interrupted
    pacing is not signalled again).

    Raises:
        SnapshotTableError, SnapshotFilterError, SnapshotUnavailableError:
            as :func:`request_snapshot`; nothing was signalled.
    """
    by_source: dict[str, list[tuple[TableSettings, str | None]]] = {}
    chosen: dict[str, SourceSettings] = {}
    for table, filter_sql in wanted:
        source, declared = source_of(sources, table)
        if filter_sql is not None:
            check_filter(database, declared, filter_sql)
        _check_connector(client, source)
        chosen[source.name] = source
        by_source.setdefault(source.name, []).append((declared, filter_sql))
    requests: list[SnapshotRequest] = []
    reports: list[PaceReport] = []
    for name, items in by_source.items():
        source = chosen[name]
        pacer = SnapshotPacer(
            database,
            source,
            bootstrap_servers,
            rows_per_s=source.snapshot_rows_per_s,
            chunk_rows=source.snapshot_chunk_rows,
            client_options=dict(client_options or {}),
        )

        def signal(items: list[tuple[TableSettings, str | None]] = items) -> list[SnapshotRequest]:
            return [
                request_snapshot(client, database, sources, declared.name, filter_sql)
                for declared, filter_sql in items
            ]

        signalled, report = pacer.run(
            signal,
            [declared.name for declared, _ in items],
            timeout_s=timeout_s,
            on_signalled=on_signalled,
        )
        requests += signalled
        reports.append(report)
    return requests, reports
