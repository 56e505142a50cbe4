"""The router's history check (pipeline.history) with in-memory ports: when the stream's
history covers the windows nothing happens; when it does not, the gap is rebuilt by a
filtered snapshot between a begin and an end marker, or reported when rebuild is off."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest

from edgefeed.settings import load_settings
from pipeline.history import (
    HistoryColumnError,
    HistoryGuard,
    HistoryNeed,
    SourceRows,
    StreamStart,
    check_time_column,
    history_marker,
    history_needs,
    rebuild_filter,
)
from pipeline.messages import RegionalChange, decode_pack

ROOT = Path(__file__).resolve().parents[3]
SETTINGS = load_settings(ROOT / "examples" / "edgefeed.yaml", env={})
NOW_MS = 1_764_000_000_000
HOUR = 3_600_000
EVENTS = HistoryNeed(
    "public.events", "occurred_at", 24 * HOUR, ("item", "user"), home_column="home_region"
)


class Ports:
    def __init__(
        self,
        rows: SourceRows,
        start_ms: int | None,
        records: dict[str, dict[str, Any]] | None = None,
        snapshots: list[str] | None = None,
        *,
        snapshotted: bool = False,
    ) -> None:
        self.rows, self.start_ms, self.snapshotted = rows, start_ms, snapshotted
        self.records = dict(records or {})
        self.outcomes = list(snapshots or ["COMPLETED"])
        self.log: list[tuple[str, Any]] = []
        self.homes: list[list[str] | None] = []  # the regions each count was asked for
        self.marked: list[list[str]] = []  # the regions each marker went to

    async def read_records(self) -> dict[str, dict[str, Any]]:
        return dict(self.records)

    async def write_record(self, key: str, record: Mapping[str, Any]) -> None:
        self.records[key] = dict(record)
        self.log.append(("record", record["state"]))

    async def source_rows(
        self, need: HistoryNeed, cutoff_ms: int, homes: Sequence[str] | None = None
    ) -> SourceRows:
        self.log.append(("rows", cutoff_ms))
        self.homes.append(None if homes is None else list(homes))
        if isinstance(self.rows, Exception):
            raise self.rows
        return self.rows

    async def stream_start(self, table: str) -> StreamStart | None:
        return None if self.start_ms is None else StreamStart(self.start_ms, self.snapshotted)

    async def send_markers(self, body: bytes, regions: Sequence[str]) -> None:
        (entry,), _ = decode_pack(body)
        change = RegionalChange.from_wire(entry)
        self.log.append(("marker", (change.row or {})["state"]))
        self.marked.append(list(regions))

    async def snapshot(self, table: str, filter_sql: str | None) -> str:
        outcome = self.outcomes.pop(0)
        self.log.append(("snapshot", filter_sql))
        if outcome == "raise":
            raise ConnectionError("connector edgefeed-shop is not running")
        return outcome

    async def routed_to_end(self, table: str) -> None:
        self.log.append(("routed", table))


async def no_sleep(_seconds: float) -> None:
    return None


REGIONS = ("eu-west", "us-east")


def guard(ports: Ports, rebuild: str = "auto", need: HistoryNeed = EVENTS) -> HistoryGuard:
    return HistoryGuard([need], ports, REGIONS, rebuild, wall=lambda: NOW_MS / 1000, sleep=no_sleep)


USERS = HistoryNeed("public.users", None, None, ("user",))


def test_the_needs_are_the_windowed_tables_and_the_tables_read_whole() -> None:
    homes = {name: table.home_region_column for name, table in SETTINGS.tables().items()}
    events, items, users = history_needs(SETTINGS.entities, homes)
    assert (events.home_column, items.home_column) == ("home_region", None)
    assert (events.table, events.time_column) == ("public.events", "occurred_at")
    assert events.window_ms == 24 * HOUR  # the user's 1d windows (UTC), over the item's 1h
    assert events.entities == ("item", "user")
    assert (items.table, items.time_column, items.window_ms) == ("public.items", None, None)
    assert users.key == "public.users" and users.home_column == "home_region"


@pytest.mark.parametrize(
    ("start_ms", "snapshotted", "rebuilt"),
    [
        (NOW_MS - HOUR, True, False),  # the topic begins with the connector's snapshot
        (NOW_MS - HOUR, False, True),  # streamed changes only (snapshot_mode no_data)
        (None, False, True),  # nothing in the stream
    ],
)
async def test_a_table_without_windows_is_rebuilt_whole_unless_the_stream_read_it_whole(
    start_ms: int | None, snapshotted: bool, rebuilt: bool
) -> None:
    ports = Ports(SourceRows(300, None), start_ms, snapshotted=snapshotted)
    await guard(ports, need=USERS).run()
    snapshots = [v for kind, v in ports.log if kind == "snapshot"]
    assert snapshots == ([None] if rebuilt else [])  # every row: no filter
    assert ports.records[USERS.key]["state"] == "complete"


def test_the_filter_selects_the_rows_inside_the_window() -> None:
    assert rebuild_filter(EVENTS, NOW_MS - 24 * HOUR) == (
        "\"occurred_at\" > '2025-11-23T16:00:00+00:00'::timestamptz"
    )
    odd = HistoryNeed("public.t", 'we"ird', HOUR, ("x",))
    assert rebuild_filter(odd, 0).startswith('"we""ird" > ')


@pytest.mark.parametrize(
    ("rows", "start_ms", "record", "expected"),
    [
        # A record says complete: the source is not even asked.
        (SourceRows(10, NOW_MS - HOUR), None, {"state": "complete", "regions": REGIONS}, []),
        # No row inside the windows: nothing can be missing.
        (SourceRows(0, None), None, None, [("rows", NOW_MS - 24 * HOUR), ("record", "complete")]),
        # The stream's first commit is older than the oldest row the windows need.
        (
            SourceRows(10, NOW_MS - HOUR),
            NOW_MS - 2 * HOUR,
            None,
            [("rows", NOW_MS - 24 * HOUR), ("record", "complete")],
        ),
    ],
)
async def test_a_covered_history_is_recorded_complete_without_a_rebuild(
    rows: SourceRows, start_ms: int | None, record: dict[str, Any] | None, expected: list[Any]
) -> None:
    ports = Ports(rows, start_ms, {EVENTS.key: record} if record else None)
    checker = guard(ports)
    await checker.run()
    assert ports.log == expected
    assert checker.states == {EVENTS.key: "complete"}


@pytest.mark.parametrize("start_ms", [None, NOW_MS - HOUR])  # an empty stream, a late one
async def test_a_gap_is_rebuilt_between_a_begin_and_an_end_marker(start_ms: int | None) -> None:
    ports = Ports(SourceRows(3999, NOW_MS - 5 * HOUR), start_ms)
    checker = guard(ports)
    await checker.run()
    kinds = [kind if kind != "marker" and kind != "record" else (kind, v) for kind, v in ports.log]
    assert kinds == [
        "rows",
        ("record", "rebuilding"),
        ("marker", "begin"),
        "snapshot",
        "routed",  # every rebuilt row was routed before the end marker
        ("marker", "end"),
        ("record", "complete"),
    ]
    (filter_sql,) = [v for kind, v in ports.log if kind == "snapshot"]
    assert filter_sql == rebuild_filter(EVENTS, NOW_MS - 24 * HOUR)
    assert ports.marked == [list(REGIONS), list(REGIONS)]  # every region lacks the rows
    assert checker.states == {EVENTS.key: "complete"}


async def test_a_rebuild_that_cannot_start_or_is_aborted_is_tried_again() -> None:
    ports = Ports(SourceRows(5, NOW_MS - HOUR), None, snapshots=["raise", "ABORTED", "COMPLETED"])
    await guard(ports).run()
    assert [kind for kind, _ in ports.log].count("snapshot") == 3
    assert ports.outcomes == []
    assert ports.records[EVENTS.key]["state"] == "complete"


async def test_an_interrupted_rebuild_is_done_again_even_once_the_stream_caught_up() -> None:
    record = {"state": "rebuilding", "id": "rebuild-old"}
    ports = Ports(SourceRows(5, NOW_MS - HOUR), NOW_MS - 2 * HOUR, {EVENTS.key: record})
    await guard(ports).run()
    assert ("snapshot", rebuild_filter(EVENTS, NOW_MS - 24 * HOUR)) in ports.log


async def test_with_rebuild_off_a_gap_is_an_error_naming_the_command(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ports = Ports(SourceRows(5, NOW_MS - HOUR), None)
    checker = guard(ports, rebuild="off")
    await checker.run()
    assert not any(kind in ("snapshot", "marker") for kind, _ in ports.log)
    assert checker.states == {EVENTS.key: "gap"}
    assert ports.records[EVENTS.key]["state"] == "gap"  # never recorded complete
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert any('edgefeed connectors snapshot --table public.events --filter "' in e for e in errors)
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "5 rows of public.events that the features of item, user still need" in warned


async def test_a_missing_time_column_is_a_gap_with_a_clear_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ports = Ports(SourceRows(0, None), None)
    ports.rows = HistoryColumnError("table public.events has no column 'occurred_at'")  # type: ignore[assignment]
    checker = guard(ports)
    await checker.run()
    assert checker.states == {EVENTS.key: "gap"}
    assert "has no column 'occurred_at'" in caplog.text


@pytest.mark.parametrize(
    ("data_type", "message"),
    [
        (None, "has no column 'occurred_at', the time column its windows read"),
        ("bigint", "is bigint, not a timestamp"),
    ],
)
def test_the_time_column_must_exist_and_be_a_time(data_type: str | None, message: str) -> None:
    with pytest.raises(HistoryColumnError, match=message):
        check_time_column("public.events", "occurred_at", data_type)
    check_time_column("public.events", "occurred_at", "timestamp with time zone")


def test_a_marker_is_one_history_change_for_no_entity() -> None:
    body = history_marker("public.events", "end", "rebuild-1", ["user"])
    (entry,), is_pack = decode_pack(body)
    change = RegionalChange.from_wire(entry)
    assert is_pack and change.op == "h" and change.key is None
    assert change.row == {"state": "end", "id": "rebuild-1", "entities": ["user"]}
    assert orjson.loads(body)[0]["t"] == "public.events"


async def test_a_source_whose_history_is_shorter_than_a_window_is_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ports = Ports(SourceRows(5, NOW_MS - HOUR, table_oldest_ms=NOW_MS - HOUR), NOW_MS - 2 * HOUR)
    await guard(ports).run()
    assert "the source's own history of public.events begins at 2025-11-24T15:00:00" in caplog.text
    assert "stay short until 2025-11-25T15:00:00" in caplog.text
    caplog.clear()
    ports = Ports(SourceRows(5, NOW_MS - HOUR, table_oldest_ms=NOW_MS - 48 * HOUR), NOW_MS)
    await guard(ports).run()
    assert "own history" not in caplog.text


@pytest.mark.parametrize(
    ("need", "filter_sql"),
    [
        # Personal rows: only the new region's, inside the window.
        (
            EVENTS,
            "\"occurred_at\" > '2025-11-23T16:00:00+00:00'::timestamptz AND "
            "\"home_region\" IN ('ap-southeast')",
        ),
        # Shared rows without windows: every row (a re-read is a no-op elsewhere).
        (HistoryNeed("public.items", None, None, ("item",)), None),
    ],
)
async def test_a_new_region_gets_its_own_rows_rebuilt_and_only_it_is_marked(
    need: HistoryNeed, filter_sql: str | None
) -> None:
    record = {"state": "complete", "regions": list(REGIONS)}
    ports = Ports(SourceRows(7, NOW_MS - HOUR), NOW_MS - 48 * HOUR, {need.key: record})
    checker = HistoryGuard(
        [need], ports, (*REGIONS, "ap-southeast"), wall=lambda: NOW_MS / 1000, sleep=no_sleep
    )
    await checker.run()
    assert ports.homes == [["ap-southeast"] if need.home_column else None]
    assert [v for kind, v in ports.log if kind == "snapshot"] == [filter_sql]
    assert ports.marked == [["ap-southeast"], ["ap-southeast"]]  # begin and end
    assert ports.records[need.key]["regions"] == [*REGIONS, "ap-southeast"]


async def test_a_new_region_without_rows_is_recorded_without_a_rebuild() -> None:
    record = {"state": "complete", "regions": list(REGIONS)}
    ports = Ports(SourceRows(0, None), None, {EVENTS.key: record})
    checker = HistoryGuard(
        [EVENTS], ports, (*REGIONS, "ap-southeast"), wall=lambda: NOW_MS / 1000, sleep=no_sleep
    )
    await checker.run()
    assert not any(kind == "snapshot" for kind, _ in ports.log)
    assert ports.records[EVENTS.key]["regions"] == [*REGIONS, "ap-southeast"]
