"""End to end on the real stack: PostgreSQL -> Debezium -> broker -> router -> regional
Faust workers -> each region's Redis, with exact feature values, data residency,
dead letters, replays and a crashed worker."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from e2e_harness import PipelineRun, pipeline_run  # noqa: F401 - the fixture

from edge_cache.layout import header_times
from edgefeed.lookup import feature_client
from edgefeed.training import build_training_set
from edgefeed.verify import verify

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("empty_region_caches")]

# Event times are explicit, minutes before each test's start: windows are read as of
# the read time, so the values a test expects hold for as long as no event it placed
# leaves a window (the nearest edge is over 20 minutes away).
ANCHOR = {"at": datetime.now(UTC)}


@pytest.fixture(autouse=True)
def _anchor() -> None:
    ANCHOR["at"] = datetime.now(UTC)


def today_count(*minutes_before: float) -> int:
    """How many of the events placed ``minutes_before`` the anchor fall on today's UTC
    date (a test running just after midnight sees yesterday's as 0)."""
    today = datetime.now(UTC).date()
    return sum((ANCHOR["at"] - timedelta(minutes=m)).date() == today for m in minutes_before)


def sql(run: PipelineRun, statement: str, params: Any = None) -> None:
    with psycopg.connect(run.settings.database.dsn(), autocommit=True) as conn:
        conn.execute(statement.replace("{s}", run.schema), params)


def add_event(
    run: PipelineRun,
    user: int,
    item: int,
    category: int,
    price: str,
    region: str,
    kind: str,
    minutes_before: float,
) -> None:
    sql(
        run,
        "INSERT INTO {s}.events (user_id, item_id, category_id, price, home_region, kind, "
        "occurred_at) VALUES (%s, %s, %s, %s, %s, %s, "
        "%s::timestamptz - make_interval(secs => %s))",
        (user, item, category, price, region, kind, ANCHOR["at"], minutes_before * 60),
    )


def wait_for(what: str, check: Callable[[], bool], timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout_s}s: {what}")


def vector(run: PipelineRun, region: str, entity: str, entity_id: int) -> dict[str, Any] | None:
    client = feature_client(run.settings, region, timeout_s=2)
    try:
        result = client.get(entity, [entity_id])
        return result.to_dicts()[0] if result.found[0] else None  # type: ignore[no-any-return]
    finally:
        client.close()


async def read_all(bootstrap: list[str], topic: str) -> list[Any]:
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, fetch_max_wait_ms=20
    )
    await consumer.start()
    try:
        await consumer.topics()  # loads the metadata
        partitions = [
            TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or [])
        ]
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        end = await consumer.end_offsets(partitions)
        records: list[Any] = []
        deadline = time.monotonic() + 30
        while [tp for tp in partitions if await consumer.position(tp) < end[tp]]:
            assert time.monotonic() < deadline, f"could not read {topic} to its end"
            batch = await consumer.getmany(timeout_ms=200)
            for part in batch.values():
                records.extend(part)
        return records
    finally:
        await consumer.stop()


async def group_offsets(
    bootstrap: list[str], group: str, topic: str
) -> list[tuple[int | None, int]]:
    """(committed, end) of the group on each partition of ``topic``."""
    # committed() fetches the group's offsets without joining the group.
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False
    )
    await consumer.start()
    try:
        await consumer.topics()
        partitions = [
            TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or [])
        ]
        end = await consumer.end_offsets(partitions)
        return [(await consumer.committed(tp), end[tp]) for tp in partitions]
    finally:
        await consumer.stop()


async def committed_total(bootstrap: list[str], group: str, topic: str) -> int:
    """The group's committed offsets on ``topic``, summed over partitions."""
    return sum(c or 0 for c, _ in await group_offsets(bootstrap, group, topic))


async def caught_up(bootstrap: list[str], group: str, topic: str) -> bool:
    offsets = await group_offsets(bootstrap, group, topic)
    return all((c or 0) >= end for c, end in offsets)  # an empty partition has no commit


def redis_of(run: PipelineRun, region: str) -> redis.Redis:
    return redis.Redis.from_url(run.settings.region(region).redis_url)


def test_rows_become_exact_features_in_their_home_region_only(pipeline_run: PipelineRun) -> None:
    run = pipeline_run
    sql(
        run,
        "INSERT INTO {s}.users (user_id, home_region, country, segment, email) VALUES "
        "(1001, 'eu-west', 'DE', 2, 'a@example.org'), (1002, 'us-east', 'US', 1, 'b@example.org')",
    )
    sql(
        run,
        "INSERT INTO {s}.items (item_id, category_id, price) VALUES "
        "(501, 7, 12.50), (502, 8, 3.00)",
    )
    for kind, item, category, price, minutes in [
        ("view", 501, 7, "12.50", 40),
        ("view", 502, 8, "3.00", 8),
        ("view", 501, 7, "12.50", 4),
        ("click", 501, 7, "12.50", 3),
        ("purchase", 501, 7, "12.50", 2),
        ("add_to_cart", 502, 8, "3.00", 1),
    ]:
        add_event(run, 1001, item, category, price, "eu-west", kind, minutes)
    add_event(run, 1002, 501, 7, "12.50", "us-east", "view", 3)

    wait_for(
        "user 1001's features in eu-west",
        lambda: (vector(run, "eu-west", "user", 1001) or {}).get("carts_1h") == 1,
    )
    user = vector(run, "eu-west", "user", 1001)
    assert user is not None
    assert user["segment"] == 2
    assert user["views_30m"] == 2  # 8 and 4 minutes before now; 40 is outside
    assert user["clicks_30m"] == 1
    assert user["carts_1h"] == 1
    assert user["purchases_today"] == today_count(2)
    assert user["spend_today"] == pytest.approx(12.5 * today_count(2))
    assert user["avg_price_viewed_1h"] == pytest.approx((12.5 + 3.0 + 12.5) / 3, rel=1e-6)
    assert user["max_price_viewed_1h"] == pytest.approx(12.5)
    assert user["distinct_items_1h"] == 2
    assert [user[f"last_items.{i}"] for i in range(1, 6)] == [502, 501, 501, 501, 502]
    assert [user[f"top_categories_1h.{i}"] for i in (1, 2, 3)] == [7, 8, None]

    wait_for(
        "item 501 in eu-west",
        lambda: (vector(run, "eu-west", "item", 501) or {}).get("purchases_1h") == 1,
    )
    item_eu = vector(run, "eu-west", "item", 501)
    assert item_eu is not None
    assert (item_eu["price"], item_eu["category_id"], item_eu["views_1h"]) == (12.5, 7, 2)
    wait_for(
        "item 501 in us-east",
        lambda: (vector(run, "us-east", "item", 501) or {}).get("views_1h") == 1,
    )
    wait_for(
        "user 1002 in us-east",
        lambda: (vector(run, "us-east", "user", 1002) or {}).get("views_30m") == 1,
    )
    # Shared data is everywhere.
    wait_for(
        "item 502 in ap-southeast",
        lambda: (vector(run, "ap-southeast", "item", 502) or {}).get("price") == 3.0,
    )

    # Residency: user 1001's key and data never appear outside eu-west.
    for region in ("us-east", "ap-southeast"):
        assert list(redis_of(run, region).scan_iter(match="*user:1001*")) == []
        records = asyncio.run(
            read_all(
                run.settings.kafka.bootstrap_servers, run.settings.pipeline.region_topic(region)
            )
        )
        assert records, f"{region}'s change topic should carry shared data"
        changes = []
        for record in records:
            assert record.key != b"user:1001"
            assert b"1001" not in record.value or b'"user_id":1001' not in record.value
            body = json.loads(record.value)
            changes.extend(body if isinstance(body, list) else [body])  # packs of changes
        assert changes
        for change in changes:
            assert not (change.get("e") == "user" and change.get("id") == 1001)
            assert (change.get("row") or {}).get("user_id") != 1001
    assert list(redis_of(run, "eu-west").scan_iter(match="*user:1001*")) == [b"ef:{user:1001}"]

    # Freshness is recorded per entity type.
    fresh = redis_of(run, "eu-west").hgetall("ef:freshness:user")
    assert int(fresh[b"write_us"]) >= int(fresh[b"commit_us"]) > 0


def test_poison_event_goes_to_the_dead_letter_topic_and_good_events_still_flow(
    pipeline_run: PipelineRun,
) -> None:
    run = pipeline_run
    bootstrap = run.settings.kafka.bootstrap_servers
    events_topic = run.settings.sources[0].topic_for(run.table("events"))
    names = run.settings.pipeline.names
    bad_region = {
        "event_id": 424243, "user_id": 1003, "item_id": 501, "category_id": 7,
        "price": "12.50", "home_region": "ap-southeast", "kind": "view",
        "occurred_at": "2026-06-01T12:00:00Z", "extra": 2**70,
    }  # fmt: skip
    known_home = json.dumps(
        {
            "op": "c",
            "before": None,
            "after": bad_region,
            "source": {"ts_ms": 1, "schema": run.schema, "table": "events", "lsn": 5},
        }
    ).encode()

    async def produce() -> tuple[int, int]:
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
        await producer.start()
        try:
            sent = await producer.send_and_wait(
                events_topic, b"{this is not json", key=b'{"event_id":424242}'
            )
            await producer.send_and_wait(events_topic, known_home, key=b'{"event_id":424243}')
            return int(sent.partition), int(sent.offset)
        finally:
            await producer.stop()

    undecodable_partition, undecodable_offset = asyncio.run(produce())
    sql(
        run,
        "INSERT INTO {s}.users (user_id, home_region, country, segment, email) VALUES "
        "(1003, 'ap-southeast', 'SG', 0, 'c@example.org')",
    )
    add_event(run, 1003, 501, 7, "12.50", "ap-southeast", "view", 2)
    wait_for(
        "user 1003 after the poison event",
        lambda: (vector(run, "ap-southeast", "user", 1003) or {}).get("views_30m") == 1,
    )

    # A personal row of no known home: the central dead letters point at the source
    # record and hold nothing of it (no key, no value, no error text quoting it).
    central = asyncio.run(read_all(bootstrap, names.dead_letter_topic))
    pointers = [
        r
        for r in central
        if dict(r.headers).get("edgefeed-offset") == str(undecodable_offset).encode()
        and dict(r.headers)["edgefeed-partition"] == str(undecodable_partition).encode()
        and dict(r.headers)["edgefeed-topic"] == events_topic.encode()
    ]
    assert len(pointers) == 1, [(r.key, r.value, dict(r.headers)) for r in central]
    (pointer,) = pointers
    headers = dict(pointer.headers)
    assert pointer.key is None
    assert json.loads(pointer.value) == {
        "withheld": "personal row of an unknown region",
        "reason": "undecodable",
        "topic": events_topic,
        "partition": undecodable_partition,
        "offset": undecodable_offset,
    }
    assert headers["edgefeed-reason"] == headers["edgefeed-error"] == b"undecodable"
    assert b"unknown region" in headers["edgefeed-withheld"]
    # A personal row whose home is known stays in its region, whole.
    regional = asyncio.run(read_all(bootstrap, names.region_dead_letter_topic("ap-southeast")))
    (kept,) = [r for r in regional if r.value == known_home]
    assert dict(kept.headers)["edgefeed-stage"] == b"router"
    for region in run.settings.region_names:
        if region != "ap-southeast":
            others = asyncio.run(read_all(bootstrap, names.region_dead_letter_topic(region)))
            assert all(r.value != known_home for r in others), region

    # A forged or corrupt row of user 1003 (who lives in ap-southeast, as the book
    # of homes knows by now) naming eu-west: its dead letter goes to the user's
    # home, never to the region the row names (issue 30).
    forged = json.dumps(
        {
            "op": "c",
            "before": None,
            "after": {**bad_region, "event_id": 424244, "home_region": "eu-west"},
            "source": {"ts_ms": 1, "schema": run.schema, "table": "events", "lsn": 6},
        }
    ).encode()

    async def produce_forged() -> None:
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
        await producer.start()
        try:
            await producer.send_and_wait(events_topic, forged, key=b'{"event_id":424244}')
        finally:
            await producer.stop()

    asyncio.run(produce_forged())
    home_dead = names.region_dead_letter_topic("ap-southeast")
    wait_for(
        "the forged row's dead letter in the user's home region",
        lambda: any(r.value == forged for r in asyncio.run(read_all(bootstrap, home_dead))),
    )
    for region in ("eu-west", "us-east"):
        others = asyncio.run(read_all(bootstrap, names.region_dead_letter_topic(region)))
        assert all(r.value != forged for r in others), region
    central = asyncio.run(read_all(bootstrap, names.dead_letter_topic))
    assert all(r.value != forged for r in central)


def snapshot(run: PipelineRun, region: str) -> dict[bytes, bytes | None]:
    client = redis_of(run, region)
    return {key: client.get(key) for key in sorted(client.scan_iter(match="ef:{*"))}


def test_duplicate_and_reordered_replays_leave_identical_cache_contents(
    pipeline_run: PipelineRun,
) -> None:
    run = pipeline_run
    bootstrap = run.settings.kafka.bootstrap_servers
    topic = run.settings.pipeline.region_topic("eu-west")
    group = run.settings.pipeline.region_app_id("eu-west")
    wait_for("eu-west caught up", lambda: asyncio.run(caught_up(bootstrap, group, topic)))
    before = snapshot(run, "eu-west")
    assert any(b"user:1001" in key for key in before)
    records = asyncio.run(read_all(bootstrap, topic))

    async def replay() -> None:
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
        await producer.start()
        try:
            for record in reversed(records):  # every message again, newest first
                await producer.send(topic, record.value, key=record.key)
            await producer.flush()
        finally:
            await producer.stop()

    asyncio.run(replay())
    wait_for(
        "eu-west caught up after the replay",
        lambda: asyncio.run(caught_up(bootstrap, group, topic)),
    )
    assert snapshot(run, "eu-west") == before


def test_kill_9_of_a_regional_worker_mid_stream_loses_no_update(pipeline_run: PipelineRun) -> None:
    run = pipeline_run
    sql(
        run,
        "INSERT INTO {s}.users (user_id, home_region, country, segment, email) VALUES "
        "(1004, 'eu-west', 'FR', 1, 'd@example.org')",
    )
    bootstrap = run.settings.kafka.bootstrap_servers
    topic = run.settings.pipeline.region_topic("eu-west")
    group = run.settings.pipeline.region_app_id("eu-west")
    before_views = (vector(run, "eu-west", "user", 1001) or {}).get("views_30m")
    assert before_views, "user 1001 (an earlier test) should have views by now"
    committed_before = asyncio.run(committed_total(bootstrap, group, topic))
    total = 120
    inserted = threading.Event()

    def load() -> None:
        for i in range(total):
            add_event(run, 1004, 600 + i, 9, "1.00", "eu-west", "view", 1 + (i % 20) / 100)
            time.sleep(0.02)
        inserted.set()

    writer = threading.Thread(target=load)
    writer.start()
    # Kill only after a checkpoint covered some of user 1004's events: their messages
    # are committed and will not come again, so the restarted worker must take them
    # from the changelog.
    wait_for(
        "a checkpoint in the middle of user 1004's events",
        lambda: (
            (vector(run, "eu-west", "user", 1004) or {}).get("views_30m", 0) > 0
            and asyncio.run(committed_total(bootstrap, group, topic)) > committed_before
            and not inserted.is_set()
        ),
    )
    run.kill9("eu-west")
    run.start("eu-west")
    writer.join(timeout=120)
    assert inserted.is_set()
    wait_for(
        f"all {total} views of user 1004",
        lambda: (vector(run, "eu-west", "user", 1004) or {}).get("views_30m") == total,
        timeout_s=120,
    )
    final = vector(run, "eu-west", "user", 1004)
    assert final is not None and final["distinct_items_1h"] == total
    # An entity checkpointed long before the kill goes on from its recovered state.
    add_event(run, 1001, 777, 4, "3.00", "eu-west", "view", 1)
    wait_for(
        "user 1001's next view counted on top of its recovered ones",
        lambda: (vector(run, "eu-west", "user", 1001) or {}).get("views_30m") == before_views + 1,
    )


def test_windows_are_read_as_of_the_read_time(pipeline_run: PipelineRun) -> None:
    """An inactive user's window counts decay to 0 as the window passes (the worker
    renews the value when its schedule runs out), and a daily count is 0 after
    midnight: what a lookup returns depends on when it reads, not on the user's last
    event."""
    run = pipeline_run
    sql(
        run,
        "INSERT INTO {s}.users (user_id, home_region, country, segment, email) VALUES "
        "(1005, 'us-east', 'US', 1, 'e@example.org'), (1006, 'us-east', 'US', 1, 'f@example.org')",
    )
    # Six views that leave the 30-minute window 12..27 s from now: more changes than a
    # value's schedule holds (4), so the value must be renewed to reach 0.
    for i in range(6):
        add_event(run, 1005, 800 + i, 3, "2.00", "us-east", "view", 30 - (12 + 3 * i) / 60)
    purchase_at = ANCHOR["at"] - timedelta(minutes=1)
    add_event(run, 1006, 900, 3, "5.00", "us-east", "purchase", 1)

    def views_now() -> int:
        return int((vector(run, "us-east", "user", 1005) or {}).get("views_30m") or 0)

    wait_for(  # the newest view (item 805) is in: all six are
        "user 1005's views",
        lambda: (vector(run, "us-east", "user", 1005) or {}).get("last_items.1") == 805,
    )
    # Read before the views start to leave the window (12 s from now), so that the
    # renewal below comes after it.
    key = "ef:{user:1005}"
    first = redis_of(run, "us-east").get(key)
    assert first is not None
    wait_for(  # and the purchase, written after them, with its item's vector
        "user 1006's purchase",
        lambda: (
            (vector(run, "us-east", "user", 1006) or {}).get("last_items.1") == 900
            and vector(run, "us-east", "item", 900) is not None
        ),
    )
    bootstrap = run.settings.kafka.bootstrap_servers
    topic, group = (
        run.settings.pipeline.region_topic("us-east"),
        run.settings.pipeline.region_app_id("us-east"),
    )
    wait_for(  # every record routed so far (the views' items too) is in the cache
        "us-east caught up", lambda: asyncio.run(caught_up(bootstrap, group, topic))
    )
    # The cache equals a recomputation from PostgreSQL with windows read at one time...
    report = verify(run.settings, ["us-east"])
    assert report.ok and report.checked["us-east"] > 0, report.to_dict()["mismatches"][:5]
    wait_for("user 1005's views left the window", lambda: views_now() == 0, timeout_s=150)
    # ... and at another, after the views left and the value was renewed.
    report = verify(run.settings, ["us-east"])
    assert report.ok, report.to_dict()["mismatches"][:5]
    renewed = redis_of(run, "us-east").get(key)
    assert renewed is not None
    assert renewed[12:24] == first[12:24]  # the same source position: nothing new arrived
    assert header_times(renewed)[1] > header_times(first)[1]  # written again: renewed

    # The daily count, read at times around the next UTC midnight (within the schedule
    # written with the purchase: nothing else changes before then but the 1-hour windows).
    midnight = datetime.combine(
        ANCHOR["at"].date() + timedelta(days=1), datetime.min.time(), tzinfo=UTC
    )
    client = feature_client(run.settings, "us-east", timeout_s=2)
    try:
        for at in (datetime.now(UTC), midnight - timedelta(seconds=1), midnight):
            got = client.get("user", [1006], at=at).to_dicts()[0]
            expected = int(purchase_at.date() == at.date())
            assert got["purchases_today"] == expected, at
            assert got["spend_today"] == pytest.approx(5.0 * expected), at
        later = client.get("user", [1006], at=ANCHOR["at"] + timedelta(hours=2)).to_dicts()[0]
        assert later["distinct_items_1h"] == 0 and later["top_categories_1h.1"] is None
        assert later["last_items.1"] == 900  # a one-day window: still there
    finally:
        client.close()


def test_a_deleted_users_remaining_events_are_served_nowhere_and_verify_agrees(
    pipeline_run: PipelineRun,
) -> None:
    """A personal entity exists while its own row does (issue 30): a user deleted
    while its events remain (no cascade) leaves a tombstone, and `pipeline verify`,
    which sees only the remaining rows, agrees (it reported the user missing)."""
    run = pipeline_run
    sql(
        run,
        "INSERT INTO {s}.users (user_id, home_region, country, segment, email) VALUES "
        "(1007, 'us-east', 'US', 1, 'g@example.org')",
    )
    add_event(run, 1007, 950, 3, "4.00", "us-east", "view", 2)
    add_event(run, 1007, 951, 3, "4.00", "us-east", "click", 1)
    wait_for(
        "user 1007's events",
        lambda: (vector(run, "us-east", "user", 1007) or {}).get("clicks_30m") == 1,
    )
    sql(run, "DELETE FROM {s}.users WHERE user_id = 1007")
    wait_for("user 1007 gone", lambda: vector(run, "us-east", "user", 1007) is None)
    bootstrap = run.settings.kafka.bootstrap_servers
    topic, group = (
        run.settings.pipeline.region_topic("us-east"),
        run.settings.pipeline.region_app_id("us-east"),
    )
    wait_for("us-east caught up", lambda: asyncio.run(caught_up(bootstrap, group, topic)))
    report = verify(run.settings, ["us-east"])
    assert report.ok, report.to_dict()["mismatches"][:5]
    # The item the view fed still counts it (items are shared: no own row needed).
    assert (vector(run, "us-east", "item", 950) or {}).get("views_1h") == 1


Sample = tuple[int, datetime, dict[str, Any] | None]


def add_users(run: PipelineRun, homes: dict[int, str], *ids: int) -> None:
    for uid in ids:
        sql(
            run,
            "INSERT INTO {s}.users (user_id, home_region, country, segment, email) "
            "VALUES (%s, %s, 'DE', %s, 'x@example.org')",
            (uid, homes[uid], uid % 4),
        )


def live_load(
    run: PipelineRun, homes: dict[int, str], users: list[int], rng: random.Random, updates: bool
) -> None:
    """Ten small transactions of events (one in four ten minutes late), and with
    ``updates`` a user's segment changed in each."""
    with psycopg.connect(run.settings.database.dsn()) as conn:
        for _ in range(10):
            with conn.transaction():
                for _ in range(3):
                    uid, item = rng.choice(users), rng.randrange(300, 310)
                    conn.execute(
                        "INSERT INTO {s}.events (user_id, item_id, category_id, price, "
                        "home_region, kind, occurred_at) VALUES (%s, %s, %s, %s, %s, %s, "
                        "now() - make_interval(secs => %s))".replace("{s}", run.schema),
                        (
                            uid,
                            item,
                            item % 4,
                            f"{rng.uniform(1, 50):.2f}",
                            homes[uid],
                            rng.choice(["view", "view", "click", "add_to_cart", "purchase"]),
                            rng.choice([0, 0, 0, 600]),
                        ),
                    )
                if updates:
                    conn.execute(
                        f"UPDATE {run.schema}.users SET segment = %s WHERE user_id = %s",
                        (rng.randrange(4), rng.choice(users)),
                    )
            time.sleep(0.03)


def served_now(run: PipelineRun, homes: dict[int, str]) -> list[Sample]:
    """Once the caches hold every change committed so far: the vectors the lookup
    client serves now, with the read time."""
    wait_for("the caches caught up", lambda: verify(run.settings).ok, timeout_s=120)
    at = datetime.now(UTC)
    samples: list[Sample] = []
    for region in sorted(set(homes.values())):
        ids = sorted(u for u in homes if homes[u] == region)
        client = feature_client(run.settings, region, timeout_s=5)
        try:
            got = client.get("user", ids, at=at)
            for uid, found, values in zip(ids, got.found, got.to_dicts(), strict=True):
                samples.append((uid, at, values if found else None))
        finally:
            client.close()
    return samples


def assert_history_is_what_was_served(
    run: PipelineRun, samples: list[Sample], folder: Path, source: str
) -> list[str]:
    """``features history`` (from ``source``) at the samples' read times gives exactly
    the vectors served then (every feature null where none was); its notes."""
    spine = folder / f"spine-{source}.parquet"
    stamps = pa.array([at for _, at, _ in samples], pa.timestamp("us", tz="UTC"))
    uids = [uid for uid, _, _ in samples]
    pq.write_table(
        pa.table({"user_id": uids, "timestamp": stamps, "label": range(len(uids))}), spine
    )
    out = folder / f"train-{source}.parquet"
    report = build_training_set(run.settings, "user", spine, out, batch_rows=4, source=source)
    rows = pq.read_table(out).to_pylist()
    assert [row["label"] for row in rows] == list(range(len(samples)))
    features = [f for f in rows[0] if f not in ("user_id", "timestamp", "label")]
    for row, (uid, at, served) in zip(rows, samples, strict=True):
        expected = served or dict.fromkeys(features)  # not served: every feature null
        assert {f: row[f] for f in features} == expected, (source, uid, at)
    assert sum(served["views_30m"] or 0 for _, _, served in samples if served) > 0
    return report.notes


def test_a_training_set_gives_what_the_cache_served_at_each_read_time(
    pipeline_run: PipelineRun, tmp_path: Path
) -> None:
    """Issue 32: read times sampled during a live load of inserts (late events among
    them); at each, the vectors the lookup client serves once the workers have applied
    every change committed so far; then ``features history`` from the tables at the same
    times, after more load (late events whose event times precede the samples): the
    same values, exactly (the cache's float32 and the file's float32 are the same
    numbers), and nulls where the user did not exist yet."""
    run = pipeline_run
    homes = {9501 + i: run.settings.region_names[i % 2] for i in range(5)}
    rng = random.Random(32)
    add_users(run, homes, 9501, 9502, 9503, 9504)
    samples: list[Sample] = []
    for phase in range(3):
        if phase == 1:
            add_users(run, homes, 9505)  # sampled at phase 0: before it existed
        live_load(run, homes, [u for u in homes if phase > 0 or u != 9505], rng, updates=False)
        samples += served_now(run, homes)
    live_load(run, homes, list(homes), rng, updates=False)  # after every sample
    notes = assert_history_is_what_was_served(run, samples, tmp_path, "tables")
    assert notes == []  # every row's commit time known: exact
    assert [served for uid, _, served in samples[:5] if uid == 9505] == [None]  # not yet


def test_a_training_set_from_the_change_topics_is_exact_across_updates_and_deletes(
    pipeline_run: PipelineRun, tmp_path: Path
) -> None:
    """The same with users' segments updated during the load and a user deleted: the
    tables keep only current rows, the CDC topics every version, and ``features history
    --source topics`` gives what was served at every sample, the deleted user's earlier
    vectors included."""
    run = pipeline_run
    homes = {9511 + i: run.settings.region_names[i % 2] for i in range(4)}
    rng = random.Random(33)
    add_users(run, homes, *homes)
    samples: list[Sample] = []
    for phase in range(3):
        if phase == 2:
            sql(run, "DELETE FROM {s}.users WHERE user_id = 9512")
        live_load(run, homes, [u for u in homes if phase < 2 or u != 9512], rng, updates=True)
        samples += served_now(run, homes)
    live_load(run, homes, [9511, 9513, 9514], rng, updates=True)  # after every sample
    assert_history_is_what_was_served(run, samples, tmp_path, "topics")
    deleted = [served is None for uid, _, served in samples if uid == 9512]
    assert deleted == [False, False, True]
    changed = [
        uid
        for uid in homes
        if len({served["segment"] for u, _, served in samples if u == uid and served}) > 1
    ]
    assert changed  # some segment moved between read times: earlier versions were needed
