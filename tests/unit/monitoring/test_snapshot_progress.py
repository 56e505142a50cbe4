"""Folding Debezium's incremental snapshot notifications into what `edgefeed lag` shows."""

from __future__ import annotations

from typing import Any

from monitoring.snapshots import fold_notifications

KIND = "Incremental Snapshot"


def note(kind: str, at: int, **data: str) -> dict[str, Any]:
    return {
        "id": "snap-1",
        "aggregate_type": KIND,
        "type": kind,
        "additional_data": {"connector_name": "edgefeed", **data},
        "timestamp": at,
    }


STARTED = note("STARTED", 1, data_collections="public.orders,public.items")
CHUNK = note(
    "IN_PROGRESS",
    2,
    data_collections="public.orders,public.items",
    current_collection_in_progress="public.orders",
    maximum_key="[5000]",
    last_processed_key="[1024]",
)
ORDERS_DONE = note(
    "TABLE_SCAN_COMPLETED",
    3,
    data_collection="public.orders,public.items",
    scanned_collection="public.orders",
    total_rows_scanned="4100",
    status="SUCCEEDED",
)


def test_a_running_snapshot_shows_its_table_and_key() -> None:
    report = fold_notifications("edgefeed-shop", [STARTED, CHUNK])
    assert report is not None
    assert (report.state, report.current_table) == ("RUNNING", "public.orders")
    assert (report.last_key, report.max_key) == ("[1024]", "[5000]")
    assert [(t.table, t.status) for t in report.tables] == [
        ("public.orders", "RUNNING"),
        ("public.items", "PENDING"),
    ]
    assert report.rows == 0 and report.updated_ms == 2


def test_completed_tables_carry_their_rows() -> None:
    finished = note("COMPLETED", 5)
    report = fold_notifications("edgefeed-shop", [STARTED, CHUNK, ORDERS_DONE, finished])
    assert report is not None
    assert report.state == "COMPLETED" and report.current_table is None
    assert [(t.table, t.rows, t.status) for t in report.tables] == [
        ("public.orders", 4100, "SUCCEEDED"),
        ("public.items", None, "PENDING"),
    ]
    assert report.rows == 4100


def test_the_newest_snapshot_wins_and_other_notifications_are_ignored() -> None:
    initial = dict(note("COMPLETED", 0), aggregate_type="Initial Snapshot")
    second = dict(note("STARTED", 10, data_collections="public.items"), id="snap-2")
    aborted = dict(note("ABORTED", 11), id="snap-2")
    report = fold_notifications(
        "edgefeed-shop", [initial, STARTED, ORDERS_DONE, note("COMPLETED", 4), second, aborted]
    )
    assert report is not None
    assert (report.id, report.state) == ("snap-2", "ABORTED")
    assert [t.table for t in report.tables] == ["public.items"]
    assert fold_notifications("edgefeed-shop", [initial]) is None


def test_the_exporter_exports_the_snapshot_state_and_rows() -> None:
    from dataclasses import replace

    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from test_monitoring_status import sample_report

    from monitoring import ReportCollector, make_registry

    snap = fold_notifications("edgefeed-shop", [STARTED, CHUNK, ORDERS_DONE])
    assert snap is not None
    collector = ReportCollector(freshness_budget_s=5.0, slot_wal_bound_bytes=1024)
    collector.update(replace(sample_report(), snapshots=(snap,)), 0.1)
    text = generate_latest(make_registry(collector)).decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    running = ("edgefeed_snapshot_state", (("connector", "edgefeed-shop"), ("state", "RUNNING")))
    assert samples[running] == 1.0
    rows = ("edgefeed_snapshot_rows", (("connector", "edgefeed-shop"), ("table", "public.orders")))
    assert samples[rows] == 4100


def test_a_snapshot_held_between_pacer_pulses_reads_paced_until_it_stays_paused() -> None:
    pulses = [note("PAUSED", 10), note("RESUMED", 20), CHUNK, note("PAUSED", 30)]
    paced = fold_notifications("edgefeed-shop", [STARTED, *pulses], now_ms=30 + 29_000)
    assert paced is not None and paced.state == "PACED"
    # Paused for longer than pulses ever leave it (a pacer killed -9 while holding it).
    stuck = fold_notifications("edgefeed-shop", [STARTED, *pulses], now_ms=30 + 31_000)
    assert stuck is not None and stuck.state == "PAUSED"
    # Paused and never resumed: an operator's pause, whatever its age.
    held = fold_notifications("edgefeed-shop", [STARTED, CHUNK, note("PAUSED", 30)], now_ms=31)
    assert held is not None and held.state == "PAUSED"
