"""Acceptance of issue 16 part 2 on the real stack: a 7-day feature added to a running
pipeline whose workers never saw the older events; `features apply` registers the
new version, waits for the restarted worker, and backfills by an incremental
snapshot while streaming goes on. Afterwards every vector equals the recomputation
from PostgreSQL, and readers of the older version still read."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml
from e2e_harness import (
    SAMPLERS,
    FreshnessSampler,
    PipelineRun,
    freshness_line,
    shop_pipeline,
    shop_settings,
    snapshot_span_s,
)
from stackhelpers import unique_name

from connectors.client import ConnectClient
from connectors.config import notification_topic
from edge_cache import FeatureClient
from edgefeed.devstack import DevStack
from edgefeed.features import FeaturesApplied, apply_features, plan_features
from edgefeed.lookup import feature_client, feature_schemas
from edgefeed.settings import EdgefeedSettings, settings_from_mapping
from edgefeed.verify import verify
from monitoring.snapshots import read_snapshots

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("empty_region_caches")]

REGION = "eu-west"
# Event times are explicit, relative to the test's start (set by the ``run`` fixture):
# windows are read as of the read time.
ANCHOR = {"at": datetime.now(UTC)}
USERS = range(2001, 2031)  # 30 users of eu-west
OLD_EVENTS_PER_USER = (
    1000  # one per 20 min, 2..16 days old: never streamed, older than any v1 window
)
VIEWS_7D = {
    "name": "views_7d",
    "table": "public.events",
    "agg": "count",
    "where": {"kind": "view"},
    "window": {"size": "7d"},
}


def deadline_loop(what: str, timeout_s: float) -> Iterator[None]:
    deadline = time.monotonic() + timeout_s
    while True:
        yield
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s}s: {what}")
        time.sleep(0.2)


@pytest.fixture
def run(
    devstack: DevStack, stack_mapping: dict[str, Any], tmp_path: Path
) -> Iterator[tuple[PipelineRun, dict[str, Any]]]:
    ANCHOR["at"] = datetime.now(UTC)
    tag = unique_name("bf").lower()
    schema = f"s_{tag}"
    mapping = shop_settings(stack_mapping, schema, tag)

    def history(conn: psycopg.Connection[Any]) -> None:
        # History from before the pipeline existed (the connector takes no snapshot), of
        # item 100 only: its streamed view keeps older items from vectors of their own.
        conn.execute(
            f"INSERT INTO {schema}.events (user_id, item_id, category_id, price, home_region, "
            "kind, occurred_at) SELECT u, 100, i %% 3, 1.50, %s, "
            "CASE WHEN i %% 3 = 0 THEN 'click' ELSE 'view' END, "
            "%s::timestamptz - make_interval(hours => 48, mins => 20 * i) "
            "FROM generate_series(%s::int, %s::int) AS u, generate_series(1, %s::int) AS i",
            (REGION, ANCHOR["at"], USERS.start, USERS.stop - 1, OLD_EVENTS_PER_USER),
        )

    with shop_pipeline(mapping, schema, tmp_path, ["router", REGION], seed=history) as pipeline:
        yield pipeline, mapping


def sql(settings: EdgefeedSettings, statement: str, params: Any = None) -> None:
    with psycopg.connect(settings.database.dsn(), autocommit=True) as conn:
        conn.execute(statement, params)


def stream_event(settings: EdgefeedSettings, schema: str, user: int, seconds_after: float) -> None:
    sql(
        settings,
        f"INSERT INTO {schema}.events (user_id, item_id, category_id, price, home_region, kind, "
        "occurred_at) VALUES (%s, 100, 1, 2.00, %s, 'view', "
        "%s::timestamptz + make_interval(secs => %s))",
        (user, REGION, ANCHOR["at"], seconds_after),
    )


def wait_verified(settings: EdgefeedSettings, what: str, timeout_s: float) -> None:
    """Poll `edgefeed pipeline verify` of the region until it passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        report = verify(settings, [REGION])
        if report.ok and report.checked[REGION] > 0:
            return
        if time.monotonic() > deadline:
            shown = report.to_dict()["mismatches"][:5]
            raise AssertionError(f"{what}: not within {timeout_s}s; mismatches: {shown}")
        time.sleep(1)


@pytest.mark.timeout(2400)  # a busy 2-core machine: three worker starts and a snapshot
def test_a_7_day_feature_is_backfilled_while_streaming_goes_on(
    run: tuple[PipelineRun, dict[str, Any]],
) -> None:
    pipeline, mapping = run
    v1 = pipeline.settings
    schema = pipeline.schema
    # Users and a recent event each, streamed: the worker's state holds only these.
    sql(
        v1,
        f"INSERT INTO {schema}.users (user_id, home_region, country, segment, email) "
        "SELECT u, %s, 'DE', 1, 'x@example.org' FROM generate_series(%s::int, %s::int) AS u",
        (REGION, USERS.start, USERS.stop - 1),
    )
    for user in USERS:
        stream_event(v1, schema, user, 0)
    wait_verified(v1, "v1 vectors equal the recomputation", 300)
    # The deployed declaration is registered (the workers registered only the schema).
    with ConnectClient(v1.connect.url, timeout_s=30) as connect:
        adopted = apply_features(v1, connect, regions=[REGION], wait_s=0)
    assert adopted.registered == [(REGION, "user", 1), (REGION, "item", 1)]
    assert not adopted.snapshots

    entities = [dict(e) for e in mapping["entities"]]
    user = next(e for e in entities if e["name"] == "user")
    table = f"{schema}.events"
    user.update(version=2, aggregates=[*user["aggregates"], {**VIEWS_7D, "table": table}])
    v2_mapping = {**mapping, "entities": entities}
    v2 = settings_from_mapping(v2_mapping)
    (user_plan,) = [p for p in plan_features(v2, regions=[REGION]) if p.entity == "user"]
    assert [(c.name, c.kind) for c in user_plan.changes] == [("views_7d", "added")]
    assert user_plan.history == {table: "a 604800000 ms window, the state kept 86400000 ms"}
    assert user_plan.snapshot == (table,)

    # apply waits for the workers; the operator restarts them with the new settings.
    outcome: list[FeaturesApplied | BaseException] = []

    def applying() -> None:
        with ConnectClient(v2.connect.url, timeout_s=30) as connect:
            try:
                outcome.append(apply_features(v2, connect, regions=[REGION], wait_s=400))
            except BaseException as exc:  # reported by the test thread
                outcome.append(exc)

    # Freshness before the change (the baseline, same run), then during the backfill:
    # views stream in all along, each timed from its insert to its count in the cache.
    sql(
        v1,
        f"INSERT INTO {schema}.users (user_id, home_region, country, segment, email) "
        "SELECT u, %s, 'FR', 2, 'y@example.org' FROM generate_series(%s::int, %s::int) AS u",
        (REGION, SAMPLERS.start, SAMPLERS.stop - 1),
    )
    sampler = FreshnessSampler(v1, schema)  # a v1 reader: it reads v2 vectors' prefix too
    sampler.start()
    try:
        time.sleep(10)  # the baseline: 10 s of streamed views before anything changes
        baseline_until = time.time()

        thread = threading.Thread(target=applying)
        thread.start()
        pipeline.settings_file.write_text(yaml.safe_dump(v2_mapping))
        pipeline.kill9(REGION)
        pipeline.start(REGION)

        progress = {v2.sources[0].connector_name: notification_topic(v2.sources[0])}
        bootstrap = v2.kafka.bootstrap_servers
        for _ in deadline_loop("the backfill snapshot completes", 900):
            reports = asyncio.run(read_snapshots(bootstrap, progress, timeout_s=30))
            if not thread.is_alive() and reports and reports[0].state == "COMPLETED":
                break
        sampler.wait_seen(time.time(), timeout_s=120)  # those sent as it ended, too
    finally:
        sampler.stop()
    thread.join(timeout=60)
    (result,) = outcome
    assert isinstance(result, FeaturesApplied), result
    assert [s.table for s in result.snapshots] == [table]
    # apply followed the snapshot to its end, reading in pulses no faster than the pace.
    (paced,) = result.paced
    pace = v2.sources[0].snapshot_rows_per_s
    assert paced.state == "COMPLETED" and paced.pauses > 0, paced
    assert paced.rows_per_s is not None and paced.rows_per_s <= pace * 1.25, paced
    (report,) = reports
    ((scanned, rows),) = [(t.table, t.rows) for t in report.tables]
    # Every row at the time of its chunk's read: the views streamed meanwhile may be in.
    assert scanned == table and rows is not None
    assert (
        len(USERS) * (OLD_EVENTS_PER_USER + 1)
        <= rows
        <= len(USERS) * (OLD_EVENTS_PER_USER + 1) + sampler.total_sent
    )
    started, completed = snapshot_span_s(bootstrap, progress[v2.sources[0].connector_name])
    # The baseline leaves out the views sent in its last 2 s: the kill -9 held those.
    before = [t for wall, t in sampler.samples if wall < baseline_until - 2]
    during = [t for wall, t in sampler.samples if started <= wall <= completed]
    assert before and during, (baseline_until, started, completed, len(sampler.samples))
    print(f"\nsnapshot ran {completed - started:.1f} s")  # quoted in docs/pipeline.md
    print(freshness_line("before the change", before))
    print(freshness_line("while the snapshot ran", during))

    wait_verified(v2, "v2 vectors equal the recomputation", 300)
    # Every user's 7-day count includes the history the worker never streamed.
    client = feature_client(v2, REGION, timeout_s=5)
    try:
        values = client.get("user", list(USERS)).to_dicts()
    finally:
        client.close()
    # Read now, minutes after the anchor: the view 168 hours before it has just left.
    old_views = sum(
        1 for i in range(1, OLD_EVENTS_PER_USER + 1) if i % 3 and 48 * 60 + 20 * i < 168 * 60
    )
    assert {v["views_7d"] for v in values} == {old_views + 1}
    # A reader still on version 1 reads the version-2 vectors (its prefix).
    v1_schemas = feature_schemas(v1)
    alone = v1.region(REGION).model_copy(update={"failover": []})
    old_reader = FeatureClient(REGION, [alone], v1_schemas, timeout_s=5)
    try:
        old = old_reader.get("user", list(USERS)).to_dicts()
    finally:
        old_reader.close()
    assert [o["views_30m"] for o in old] == [v["views_30m"] for v in values]
    assert all("views_7d" not in o for o in old)
