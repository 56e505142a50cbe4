"""The CDC source: PostgreSQL replication slots and Kafka Connect connector states."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from connectors.client import ConnectClient, ConnectorStatus
from connectors.exceptions import ConnectorsError
from connectors.secrets import redact
from monitoring.exceptions import SourceUnavailableError

__all__ = ["SlotRow", "read_connectors", "read_slots"]

T = TypeVar("T")

_SLOTS_SQL = """
SELECT slot_name, plugin, slot_type, database, active,
       pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint AS retained,
       pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint AS flush_lag,
       wal_status
FROM pg_replication_slots
ORDER BY slot_name
"""


@dataclass(frozen=True, slots=True)
class SlotRow:
    """One row of ``pg_replication_slots`` with its WAL figures in bytes."""

    slot: str
    plugin: str | None
    slot_type: str
    database: str | None
    active: bool
    retained_wal_bytes: int | None
    flush_lag_bytes: int | None
    wal_status: str | None


async def read_slots(dsn: str, *, timeout_s: float = 5.0) -> list[SlotRow]:
    """Every replication slot and the WAL it keeps the server from recycling.

    Raises:
        SourceUnavailableError: PostgreSQL could not be reached or refused the query.
    """
    import psycopg

    try:
        async with await psycopg.AsyncConnection.connect(
            dsn, autocommit=True, connect_timeout=max(1, int(timeout_s))
        ) as conn:
            cursor = await conn.execute(_SLOTS_SQL)
            rows = await cursor.fetchall()
    except psycopg.Error as exc:
        # Keep only the first line, and mask the password should libpq quote it
        # (it does, in part, for a DSN it cannot parse).
        text = redact(str(exc).strip(), _password_of(dsn))
        first = text.splitlines()[0] if text else type(exc).__name__
        raise SourceUnavailableError(
            "postgres", f"cannot read replication slots: {first}"
        ) from None
    return [
        SlotRow(
            slot=str(row[0]),
            plugin=None if row[1] is None else str(row[1]),
            slot_type=str(row[2]),
            database=None if row[3] is None else str(row[3]),
            active=bool(row[4]),
            retained_wal_bytes=None if row[5] is None else int(row[5]),
            flush_lag_bytes=None if row[6] is None else int(row[6]),
            wal_status=None if row[7] is None else str(row[7]),
        )
        for row in rows
    ]


def _password_of(dsn: str) -> tuple[str, ...]:
    import psycopg
    from psycopg.conninfo import conninfo_to_dict

    try:
        password = conninfo_to_dict(dsn).get("password")
    except psycopg.Error:  # an unparsable DSN: mask each of its words instead
        return tuple(word for word in dsn.split() if not word.startswith(("host=", "port=")))
    return (str(password),) if password else ()


def _read_connectors_sync(
    url: str, declared: Sequence[str], timeout_s: float, secrets: Sequence[str]
) -> dict[str, ConnectorStatus | None]:
    with ConnectClient(url, timeout_s=timeout_s, retries=1, secrets=secrets) as client:
        names = list(declared)
        names += [
            n for n in client.list_connectors() if n.startswith("edgefeed-") and n not in names
        ]
        return {name: client.status(name) for name in names}


async def _in_daemon_thread(call: Callable[[], T]) -> T:
    """``call()`` in a daemon thread of its own.

    Not ``asyncio.to_thread``: the default executor is joined when the loop
    shuts down, so a cancelled read (Ctrl-C in ``edgefeed lag --watch``) would
    keep the process alive until Connect's timeout; a daemon thread is left
    behind and dies with the process.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.done():  # cancelled meanwhile
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            result, error = call(), None
        except Exception as exc:  # handed to the awaiting task, which re-raises it
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="edgefeed-connect-read", daemon=True).start()
    return await future


async def read_connectors(
    url: str,
    declared: Sequence[str],
    *,
    timeout_s: float = 5.0,
    secrets: Sequence[str] = (),
) -> dict[str, ConnectorStatus | None]:
    """Status of every declared connector (None when absent) and of other ``edgefeed-*`` ones.

    Raises:
        SourceUnavailableError: Kafka Connect could not be reached.
    """
    try:
        return await _in_daemon_thread(
            lambda: _read_connectors_sync(url, declared, timeout_s, secrets)
        )
    except ConnectorsError as exc:
        raise SourceUnavailableError("connect", str(exc)) from None
