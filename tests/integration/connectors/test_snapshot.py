"""Incremental snapshots (``edgefeed connectors snapshot``) on the real Connect + Debezium."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator

import psycopg
import pytest
from stackhelpers import PG_PASSWORD, drop_slot, read_topic, unique_name

from connectors import deploy
from connectors.client import ConnectClient
from connectors.config import signal_table
from connectors.exceptions import (
    SnapshotFilterError,
    SnapshotTableError,
    SnapshotUnavailableError,
)
from connectors.settings import SourceSettings, TableSettings
from connectors.snapshot import request_snapshot, snapshot_paced
from edgefeed.devstack import DevStack
from monitoring.snapshots import read_snapshots

pytestmark = pytest.mark.integration

Conn = psycopg.Connection[tuple[object, ...]]


@pytest.fixture
def client(devstack: DevStack) -> Iterator[ConnectClient]:
    with ConnectClient(devstack.settings.connect.url, timeout_s=30, secrets=[PG_PASSWORD]) as c:
        yield c


@pytest.fixture
def source(
    devstack: DevStack,
    client: ConnectClient,
    pg_conn: Conn,
    make_table: Callable[[str, str], str],
) -> Iterator[SourceSettings]:
    """A connector streaming a new table that holds 10 rows it never snapshotted."""
    table = make_table("orders", "id bigint PRIMARY KEY, total int NOT NULL, note text")
    pg_conn.execute(
        f"INSERT INTO {table} (id, total, note) "
        "SELECT i, i * 10, 'old' FROM generate_series(1, 10) AS i"
    )
    declared = SourceSettings(
        name=unique_name("snap").lower(),
        tables=[TableSettings(name=table, key=["id"])],
        snapshot_mode="no_data",
    )
    try:
        deploy.apply(client, devstack.settings.database, [declared], wait_s=240)
        yield declared
    finally:
        client.delete(declared.connector_name)
        drop_slot(pg_conn, declared.effective_slot_name, declared.effective_publication)
        pg_conn.execute(f"DROP TABLE IF EXISTS {signal_table(declared)}")


def signals(pg_conn: Conn, source: SourceSettings) -> list[tuple[object, ...]]:
    return pg_conn.execute(f"SELECT id, type FROM {signal_table(source)}").fetchall()


async def test_filtered_snapshot_reads_the_selected_rows_while_streaming_goes_on(
    devstack: DevStack, client: ConnectClient, pg_conn: Conn, source: SourceSettings
) -> None:
    table = source.tables[0].name
    bootstrap = devstack.settings.kafka.bootstrap_servers
    request = request_snapshot(
        client, devstack.settings.database, [source], table, "total > 60 OR id = 1"
    )
    assert request.table == table and request.filter == "total > 60 OR id = 1"
    pg_conn.execute(f"INSERT INTO {table} (id, total, note) VALUES (11, 5, 'new')")

    # ids 1, 7, 8, 9, 10 read (the OR stays inside the chunk's key range) and 11 streamed.
    records = await read_topic(bootstrap, source.topic_for(table), count=6, deadline_s=240)
    events = [json.loads(v) for _, v in records if v]
    reads = {e["after"]["id"]: e for e in events if e["op"] == "r"}
    assert sorted(reads) == [1, 7, 8, 9, 10]
    assert {e["source"]["snapshot"] for e in reads.values()} == {"incremental"}
    assert [e["after"]["id"] for e in events if e["op"] == "c"] == [11]

    # Progress, as `edgefeed lag` shows it: Debezium's notifications, folded.
    progress = {request.connector: request.notification_topic}
    deadline = time.monotonic() + 240
    while True:
        reports = await read_snapshots(bootstrap, progress, timeout_s=30)
        if reports and reports[0].state == "COMPLETED":
            break
        assert time.monotonic() < deadline, reports
        await asyncio.sleep(0.5)
    (report,) = reports
    assert [(t.table, t.rows) for t in report.tables] == [(table, 5)]
    assert report.rows == 5


def test_bad_input_is_refused_and_nothing_is_signalled(
    devstack: DevStack, client: ConnectClient, pg_conn: Conn, source: SourceSettings
) -> None:
    db = devstack.settings.database
    table = source.tables[0].name
    before = pg_conn.execute(f"SELECT count(*), sum(total) FROM {table}").fetchone()

    with pytest.raises(SnapshotTableError, match=r"'public\.no_such_table' is not captured"):
        request_snapshot(client, db, [source], "public.no_such_table")
    cases = {
        "total >>> 3": "operator does not exist",
        "total > ": "syntax error",
        "no_such_column = 1": 'column "no_such_column" does not exist',
        # A second statement: refused by the server (the check is a prepared statement).
        f"true); DELETE FROM {table} WHERE (true": "multiple commands",
        "1 = 1; DELETE FROM pg_class": "syntax error",
        "note = 'x' AND (SELECT count(*) FROM pg_sleep(0)) = 1 AND (": "syntax error",
    }
    for text, reason in cases.items():
        with pytest.raises(SnapshotFilterError) as info:
            request_snapshot(client, db, [source], table, text)
        message = str(info.value)
        assert reason in message and table in message, message
        assert PG_PASSWORD not in message

    assert signals(pg_conn, source) == []
    after = pg_conn.execute(f"SELECT count(*), sum(total) FROM {table}").fetchone()
    assert after == before

    client.pause(source.connector_name)
    deadline = time.monotonic() + 120
    while (status := client.status(source.connector_name)) is None or status.state != "PAUSED":
        assert time.monotonic() < deadline, status
        time.sleep(0.2)
    with pytest.raises(SnapshotUnavailableError, match="not running"):
        request_snapshot(client, db, [source], table)
    assert signals(pg_conn, source) == []
    client.resume(source.connector_name)


def paced_source(pg_conn: Conn, source: SourceSettings, rows_per_s: int) -> SourceSettings:
    """The fixture's source with 2,000 more rows to read, paced to ``rows_per_s``."""
    pg_conn.execute(
        f"INSERT INTO {source.tables[0].name} (id, total, note) "
        "SELECT i, i, 'more' FROM generate_series(11, 2010) AS i"
    )
    return source.model_copy(update={"snapshot_rows_per_s": rows_per_s})


def test_a_paced_snapshot_reads_in_pulses_no_faster_than_its_pace(
    devstack: DevStack, client: ConnectClient, pg_conn: Conn, source: SourceSettings
) -> None:
    paced = paced_source(pg_conn, source, rows_per_s=400)
    table = paced.tables[0].name
    requests, (report,) = snapshot_paced(
        client,
        devstack.settings.database,
        [paced],
        [(table, None)],
        devstack.settings.kafka.bootstrap_servers,
        timeout_s=240,
    )
    assert [r.table for r in requests] == [table]
    assert report.state == "COMPLETED", report
    ((scanned, rows),) = report.tables.items()
    assert scanned.endswith(table) and rows == 2010
    # 2,010 rows at 400/s: held between pulses (how many depends on how many chunks
    # each pulse read: a busy machine reads more per pulse, because a pause is a row
    # Debezium reads while it goes on). A pulse goes only while the rows read so far
    # leave room for a chunk at the pace, so the total stays within the pace plus
    # what the last pulse read past it: a few chunks of 256 (unpaced, all 2,010 rows
    # are read in about a second). Beside stress-ng one run read 2,010 in 3.9 s.
    assert report.pauses >= 1, report
    chunk_rows = paced.snapshot_chunk_rows
    assert rows <= 400 * report.seconds + 4 * chunk_rows, report
    kinds = [kind for _, kind in signals(pg_conn, paced)]
    assert kinds.count("execute-snapshot") == 1
    assert kinds[-1] == "resume-snapshot"  # never left paused


async def test_a_pacer_that_stops_following_leaves_the_snapshot_running(
    devstack: DevStack, client: ConnectClient, pg_conn: Conn, source: SourceSettings
) -> None:
    paced = paced_source(pg_conn, source, rows_per_s=50)  # paced, it would take 40 s
    table = paced.tables[0].name
    bootstrap = devstack.settings.kafka.bootstrap_servers
    requests, (report,) = await asyncio.to_thread(
        snapshot_paced,
        client,
        devstack.settings.database,
        [paced],
        [(table, None)],
        bootstrap,
        timeout_s=1,
    )
    assert report.state == "TIMEOUT", report
    # The pacer resumed it on its way out: the snapshot reads the rest unpaced.
    progress = {requests[0].connector: requests[0].notification_topic}
    deadline = time.monotonic() + 240
    while True:
        reports = await read_snapshots(bootstrap, progress, timeout_s=30)
        if reports and reports[0].state == "COMPLETED":
            break
        assert time.monotonic() < deadline, reports
        await asyncio.sleep(0.5)
    assert [(t.table, t.rows) for t in reports[0].tables] == [(table, 2010)]
