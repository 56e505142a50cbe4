"""Issue 32 on the real stack, for every aggregate kind and a DST day: a feature set
with each kind the definitions support (latest values of every dtype; count, sum,
mean, min, max, distinct_count, top_k and last_n; sliding, UTC tumbling and New York
tumbling windows, and an unwindowed last_n; where filters on text, integers and
booleans), fed events whose event times straddle New York's latest change of UTC
offset, inserted while the router and a regional worker run. At read times sampled
during the load, ``features history`` (both engines) gives what the cache served."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from datetime import UTC, date, datetime, timedelta
from datetime import time as clock
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import psycopg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from e2e_harness import PipelineRun, shop_pipeline, shop_settings
from stackhelpers import unique_name

from edgefeed.devstack import DevStack
from edgefeed.lookup import feature_client
from edgefeed.training import build_training_set, source_history
from edgefeed.verify import verify

pytestmark = [pytest.mark.integration]

REGION = "us-east"
NY = ZoneInfo("America/New_York")
USERS = (9601, 9602, 9603)  # 9603's row comes after the first sample (its events before)
Sample = tuple[int, datetime, dict[str, Any] | None]
ARROW = {
    "float32": pa.float32(),
    "float64": pa.float64(),
    "int32": pa.int32(),
    "int64": pa.int64(),
    "bool": pa.bool_(),
}
# A sliding and a New York tumbling window (settings), the bucket's start, the day.
Windows = tuple[dict[str, Any], dict[str, Any], datetime, date]


def offset_change_day(now: datetime) -> date:
    """The New York date of the newest change of UTC offset before ``now`` (in
    December: the first Sunday of November, a 25-hour day)."""
    day = now.astimezone(NY).date()
    while True:
        day -= timedelta(days=1)
        start = datetime.combine(day, clock(), NY)
        if start.utcoffset() != datetime.combine(day + timedelta(days=1), clock(), NY).utcoffset():
            return day


def bucket_days(today: int, change: int) -> int:
    """A tumbling size in days whose local bucket holding ``today`` (local days since
    1970-01-01: buckets are multiples of the size) starts on the ``change`` day, or as
    few days before it as any size gives, and ends two days or more after today."""
    best: tuple[int, int] | None = None
    for size in range(today - change + 3, 2 * (today - change) + 400):
        start = today - today % size
        if start <= change and start + size >= today + 2:
            if best is None or change - start < best[0]:
                best = (change - start, size)
            if start == change:
                break
    assert best is not None, (today, change)
    return best[1]


def windows(now: datetime) -> Windows:
    """A sliding window and a New York tumbling one that both hold the offset change
    when read now; the tumbling bucket's start (UTC) and the change's date."""
    change = offset_change_day(now)
    epoch = date(1970, 1, 1)
    today = (now.astimezone(NY).date() - epoch).days
    size = bucket_days(today, (change - epoch).days)
    start_day = epoch + timedelta(days=today - today % size)
    start = datetime.combine(start_day, clock(), NY).astimezone(UTC)
    sliding = {"size": f"{(now - start).days + 2}d"}  # from a day before the bucket's start
    return (
        sliding,
        {"size": f"{size}d", "type": "tumbling", "time_zone": "America/New_York"},
        start,
        change,
    )


def feature_set(schema: str, sliding: dict[str, Any], zoned: dict[str, Any]) -> dict[str, Any]:
    """One entity with every kind of feature (pipeline.aggregates, pipeline.settings),
    over the shop's tables in ``schema``."""
    users, events = f"{schema}.users", f"{schema}.events"

    def agg(name: str, kind: str, window: dict[str, Any] | None, **more: Any) -> dict[str, Any]:
        return {"name": name, "table": events, "agg": kind, "window": window, **more}

    utc_day = {"size": "1d", "type": "tumbling"}
    ny_day = {"size": "1d", "type": "tumbling", "time_zone": "America/New_York"}
    return {
        "name": "shopper",
        "personal": True,
        "tables": {users: "user_id", events: "user_id"},
        "time_columns": {events: "occurred_at"},
        "latest": [
            {"name": "segment", "table": users, "column": "segment", "dtype": "int32"},
            {"name": "segment64", "table": users, "column": "segment", "dtype": "int64"},
            {"name": "score", "table": users, "column": "score", "dtype": "float64"},
            {"name": "score32", "table": users, "column": "score"},  # float32
            {"name": "vip", "table": users, "column": "vip", "dtype": "bool"},
        ],
        "aggregates": [
            agg("views_30m", "count", {"size": "30m"}, where={"kind": "view"}),
            agg("mean_price_1h", "mean", {"size": "1h"}, column="price"),
            agg("spend_utc_day", "sum", utc_day, column="price", where={"kind": "purchase"}),
            agg("events_ny_day", "count", ny_day),
            agg("events_w", "count", sliding),
            agg("promo_w", "count", sliding, where={"promo": True}),
            agg("spend_w", "sum", sliding, column="price", where={"kind": "purchase"}),
            agg("amount_w", "sum", sliding, column="amount", dtype="float64"),
            agg("mean_amount_w", "mean", sliding, column="amount", dtype="float64"),
            agg("min_price_w", "min", sliding, column="price"),
            agg("max_price_cat2_w", "max", sliding, column="price", where={"category_id": 2}),
            agg("items_w", "distinct_count", sliding, column="item_id"),
            agg("top_categories_w", "top_k", sliding, column="category_id", n=3),
            agg("recent_items_w", "last_n", sliding, column="item_id", n=3),
            agg("last_items", "last_n", None, column="item_id", n=4),
            agg("events_b", "count", zoned),
            agg("amount_b", "sum", zoned, column="amount", dtype="float64"),
            agg("mean_price_b", "mean", zoned, column="price"),
            agg("min_amount_b", "min", zoned, column="amount", dtype="float64"),
            agg("max_price_b", "max", zoned, column="price"),
            agg("items_b", "distinct_count", zoned, column="item_id"),
            agg("top_categories_b", "top_k", zoned, column="category_id", n=2),
            agg("recent_items_b", "last_n", zoned, column="item_id", n=2, dtype="int32"),
        ],
    }


def dst_times(start: datetime, change: date) -> list[datetime]:
    """Event times (UTC) on both sides of the bucket's start (1 ms before it, at it, and
    30 minutes after) and across the offset change: 01:30 twice on a 25-hour day (before
    and after the clocks went back; or 01:30 and 03:30 on a 23-hour day), 23:30 that
    day and noon the next."""
    midnight = datetime.combine(change, clock(), NY).astimezone(UTC)  # UTC arithmetic
    return [
        start - timedelta(milliseconds=1),
        start,
        start + timedelta(minutes=30),
        midnight + timedelta(hours=1, minutes=30),
        midnight + timedelta(hours=2, minutes=30),
        datetime.combine(change, clock(23, 30), NY).astimezone(UTC),
        datetime.combine(change + timedelta(days=1), clock(12), NY).astimezone(UTC),
    ]


@pytest.fixture
def run(
    devstack: DevStack, stack_mapping: dict[str, Any], tmp_path: Path
) -> Iterator[tuple[PipelineRun, Windows]]:
    """A pipeline (router and us-east's worker) of the feature set, and its windows."""
    tag = unique_name("tp").lower()
    schema = f"s_{tag}"
    mapping = shop_settings(stack_mapping, schema, tag)
    declared = windows(datetime.now(UTC))
    mapping["entities"] = [feature_set(schema, declared[0], declared[1])]

    def columns(conn: psycopg.Connection[Any]) -> None:
        # Columns for the dtypes and filters the shop's schema lacks: a float64 score, a
        # boolean latest value and filter, a float64 amount with awkward fractions.
        conn.execute(
            f"ALTER TABLE {schema}.users ADD COLUMN score double precision NOT NULL DEFAULT 0, "
            "ADD COLUMN vip boolean NOT NULL DEFAULT false"
        )
        conn.execute(
            f"ALTER TABLE {schema}.events ADD COLUMN amount double precision NOT NULL "
            "DEFAULT 0, ADD COLUMN promo boolean NOT NULL DEFAULT false"
        )

    with shop_pipeline(mapping, schema, tmp_path, ["router", REGION], seed=columns) as pipeline:
        yield pipeline, declared


def wait_for(what: str, check: Callable[[], bool], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s}s: {what}")
        time.sleep(0.2)


def insert_event(
    conn: psycopg.Connection[Any], schema: str, rng: random.Random, user: int, at: datetime | None
) -> None:
    """One event of ``user`` at ``at`` (None: now, or ten minutes ago for one in four)."""
    item = rng.randrange(300, 309)
    conn.execute(
        f"INSERT INTO {schema}.events (user_id, item_id, category_id, price, home_region, "
        "kind, occurred_at, amount, promo) VALUES (%s, %s, %s, %s, %s, %s, "
        "coalesce(%s, now() - make_interval(secs => %s)), %s, %s)",
        (
            user,
            item,
            item % 4,
            f"{rng.uniform(1, 50):.2f}",
            REGION,
            rng.choice(["view", "view", "click", "add_to_cart", "purchase"]),
            at,
            rng.choice([0, 0, 0, 600]),
            rng.choice([rng.uniform(-1e3, 1e3), rng.uniform(0, 1) * 1e-9, 0.1]),
            rng.random() < 0.3,
        ),
    )


def live_load(run: PipelineRun, rng: random.Random, users: list[int], late: list[datetime]) -> None:
    """Small transactions while the pipeline runs: events of now (one in four ten
    minutes late), one at each of ``late`` (committed weeks after their event time),
    and a user's latest values changed in each."""
    late = list(late)
    with psycopg.connect(run.settings.database.dsn()) as conn:
        for turn in range(8):
            with conn.transaction():
                at = late.pop() if late and turn % 2 == 0 else None
                for user in users:
                    insert_event(conn, run.schema, rng, user, None)
                    if at is not None:
                        insert_event(conn, run.schema, rng, user, at)
                conn.execute(
                    f"UPDATE {run.schema}.users SET segment = %s, score = %s, vip = NOT vip "
                    "WHERE user_id = %s",
                    (rng.randrange(4), rng.uniform(-10, 10), rng.choice(USERS)),
                )
            time.sleep(0.03)
        for at in late:
            with conn.transaction():
                for user in users:
                    insert_event(conn, run.schema, rng, user, at)


def served_now(run: PipelineRun) -> list[Sample]:
    """Once the cache holds every change committed so far: what the lookup client
    serves now (read at a whole millisecond: the history's resolution)."""
    wait_for("the cache caught up", lambda: verify(run.settings, [REGION]).ok)
    now = datetime.now(UTC)
    at = now.replace(microsecond=now.microsecond // 1000 * 1000)
    client = feature_client(run.settings, REGION, timeout_s=5)
    try:
        got = client.get("shopper", list(USERS), at=at)
        return [
            (user, at, values if found else None)
            for user, found, values in zip(USERS, got.found, got.to_dicts(), strict=True)
        ]
    finally:
        client.close()


def test_a_training_set_equals_the_cache_for_every_aggregate_kind_across_a_dst_change(
    run: tuple[PipelineRun, Windows], tmp_path: Path
) -> None:
    """Three read times sampled between bursts of a live load (inserts, late events
    weeks old on both sides of New York's offset change and of the zoned bucket's start,
    users' updates, a deleted event); at each, what the lookup client serves once the
    worker has applied every change committed so far. Afterwards, with more load
    committed, ``features history`` from the change topics at the same times, by the
    columnar engine (written to Parquet) and by the per-entity replay: every feature of
    every row equals the cache's, exactly (a float32 feature is the same float32 number
    in the cache and in the file; float64 and integers as they are); user 9603, sampled
    after its events but before its own row, is null in every feature, not zero."""
    pipeline, (_, _, start, change) = run
    rng = random.Random(3232)
    times = dst_times(start, change)
    samples: list[Sample] = []
    with psycopg.connect(pipeline.settings.database.dsn(), autocommit=True) as conn:
        for user in USERS[:2]:
            conn.execute(
                f"INSERT INTO {pipeline.schema}.users (user_id, home_region, country, segment, "
                "email, score, vip) VALUES (%s, %s, 'US', 1, 'x@example.org', 0.5, true)",
                (user, REGION),
            )
    live_load(pipeline, rng, list(USERS), times[:3])  # 9603: events, no user row yet
    samples += served_now(pipeline)
    with psycopg.connect(pipeline.settings.database.dsn(), autocommit=True) as conn:
        conn.execute(
            f"INSERT INTO {pipeline.schema}.users (user_id, home_region, country, segment, email) "
            "VALUES (9603, %s, 'US', 2, 'y@example.org')",
            (REGION,),
        )
    live_load(pipeline, rng, list(USERS), times[3:])
    samples += served_now(pipeline)
    with psycopg.connect(pipeline.settings.database.dsn(), autocommit=True) as conn:
        # A late event leaves every window it was in: min, max, top_k and last_n retract.
        conn.execute(
            f"DELETE FROM {pipeline.schema}.events WHERE event_id = (SELECT min(event_id) FROM "
            f"{pipeline.schema}.events WHERE user_id = 9601 AND occurred_at = %s)",
            (times[1],),
        )
    live_load(pipeline, rng, list(USERS), [])
    samples += served_now(pipeline)
    # The DST day is in the windows served: the zoned bucket holds the events from a New
    # York midnight on (04:00 or 05:00 UTC, as the offset was then), here counted by
    # PostgreSQL; the sliding window, from a day before, one more (1 ms before it).
    with psycopg.connect(pipeline.settings.database.dsn()) as conn:
        counts = conn.execute(
            "SELECT count(*) FILTER (WHERE occurred_at >= %s), count(*) "
            f"FROM {pipeline.schema}.events WHERE user_id = 9601",
            (start,),
        ).fetchone()
    last = samples[-3][2]
    assert last is not None and (last["events_b"], last["events_w"]) == counts
    assert 0 < counts[0] < counts[1]
    # Every feature is served with a value at the last read time (empty windows count 0):
    # no aggregate compared as nulls on both sides.
    assert [f for f, v in last.items() if v is None] == []
    live_load(pipeline, rng, list(USERS), times)  # after every sample: must not count
    assert [user for user, _, served in samples if served is None] == [9603]

    spine = tmp_path / "spine.parquet"
    before = datetime.now(UTC) - timedelta(days=1)  # 9601 did not exist: nulls
    rows = [*((u, at) for u, at, _ in samples), (9601, before)]
    expected = [served for _, _, served in samples] + [None]
    pq.write_table(
        pa.table(
            {
                "user_id": [u for u, _ in rows],
                "timestamp": pa.array([at for _, at in rows], pa.timestamp("ms", tz="UTC")),
                "label": range(len(rows)),
            }
        ),
        spine,
    )
    out = tmp_path / "train.parquet"
    report = build_training_set(
        pipeline.settings, "shopper", spine, out, batch_rows=4, source="topics"
    )
    # The connector takes no snapshot (the tables were empty): the notes' only caveat.
    assert all("does not begin with the connector's initial snapshot" in n for n in report.notes)
    history = source_history(pipeline.settings, "shopper", source="topics")
    assert history.columnar() is not None, history.replay_reason  # the columnar engine ran
    replayed = pa.Table.from_batches(
        history.batches(
            pq.ParquetFile(spine).iter_batches(batch_size=4), "user_id", "timestamp", replay=True
        )
    ).to_pylist()
    written = pq.read_table(out)
    features = [f.name for f in history.features]
    assert {f.name: f.type for f in written.schema if f.name in features} == {
        f.name: ARROW[f.dtype] for f in history.features
    }
    for engine, got in (("columnar", written.to_pylist()), ("replay", replayed)):
        assert [row["label"] for row in got] == list(range(len(rows)))
        for row, (user, at), served in zip(got, rows, expected, strict=True):
            want = served or dict.fromkeys(features)
            assert {f: row[f] for f in features} == want, (engine, user, at)
