"""Residency of home-region moves through real Debezium (issue 13 item 6): the home
region is the entity's, so old rows that still name the old region, a row re-tagged
alone, and a move whose update lacks its old row leave nothing where the user does not
live (cache and changelog)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from e2e_harness import PipelineRun, pipeline_run  # noqa: F401 - the fixture
from test_pipeline_end_to_end import add_event, read_all, redis_of, sql, wait_for
from test_pipeline_end_to_end import vector as read_vector

from edge_cache.exceptions import RegionUnavailableError
from edge_cache.layout import HEADER_SIZE
from pipeline.statestore import ROW_SEP

pytestmark = pytest.mark.integration


def vector(run: PipelineRun, region: str, entity: str, entity_id: int) -> dict[str, Any] | None:
    try:
        return read_vector(run, region, entity, entity_id)
    except RegionUnavailableError:
        return None


def changelog(run: PipelineRun, region: str) -> dict[str, bytes | None]:
    """The region's changelog of entity states as compaction leaves it (last per key)."""
    topic = run.settings.pipeline.names.changelog_topic(region)
    records = asyncio.run(read_all(run.settings.kafka.bootstrap_servers, topic))
    last: dict[str, bytes | None] = {}
    for record in records:
        key = record.key.decode()
        if key.startswith('"'):
            key = json.loads(key)
        last[key] = record.value
    return last


def gone_from(client: Any, user: int) -> bool:
    """No vector of the user in this Redis: no key, or only a deletion's tombstone (a
    position header, no feature value)."""
    values = [client.get(key) for key in client.scan_iter(match=f"*user:{user}*")]
    return all(value is None or len(value) <= HEADER_SIZE for value in values)


def rows_left(run: PipelineRun, region: str, user: int) -> list[str]:
    """Row records of the user that the region's changelog still holds (not deleted)."""
    prefix = f"user:{user}{ROW_SEP}"
    return [k for k, v in changelog(run, region).items() if k.startswith(prefix) and v]


async def produce(run: PipelineRun, table: str, value: bytes) -> None:
    topic = run.settings.sources[0].topic_for(run.table(table))
    producer = AIOKafkaProducer(bootstrap_servers=run.settings.kafka.bootstrap_servers)
    await producer.start()
    try:
        await producer.send_and_wait(topic, value)
    finally:
        await producer.stop()


def add_user(run: PipelineRun, user: int, region: str) -> None:
    sql(
        run,
        "INSERT INTO {s}.users (user_id, home_region, country, segment, email) "
        "VALUES (%s, %s, 'DE', 1, 'r@example.org')",
        (user, region),
    )


@pytest.mark.timeout(900)
def test_home_region_moves_leave_nothing_where_the_user_does_not_live(
    pipeline_run: PipelineRun,
) -> None:
    run = pipeline_run
    # 3001 lives in eu-west, then moves to us-east; 3002 stays in eu-west and one of its
    # events is re-tagged us-east alone; 3004 moves by a forged update without its old row.
    for user in (3001, 3002, 3004):
        add_user(run, user, "eu-west")
        add_event(run, user, 601, 9, "4.00", "eu-west", "view", 10)
        add_event(run, user, 601, 9, "4.00", "eu-west", "view", 5)
    for user in (3001, 3002, 3004):
        wait_for(
            f"user {user} in eu-west",
            lambda u=user: (vector(run, "eu-west", "user", u) or {}).get("views_30m") == 2,  # type: ignore[misc]
            timeout_s=180,
        )
    # Its events reach eu-west's changelog at the worker's next checkpoint, after the
    # cache write the vectors above show.
    wait_for(
        "user 3004's rows in eu-west's changelog",
        lambda: bool(rows_left(run, "eu-west", 3004)),
        timeout_s=120,
    )

    sql(run, "UPDATE {s}.users SET home_region = 'us-east' WHERE user_id = 3001")
    wait_for(
        "user 3001 moved to us-east",
        lambda: (
            vector(run, "us-east", "user", 3001) is not None
            and vector(run, "eu-west", "user", 3001) is None
        ),
        timeout_s=180,
    )
    # A later change to 3001's old events rows, which still say eu-west.
    sql(run, "UPDATE {s}.events SET kind = 'click' WHERE user_id = 3001")
    # 3002's newest event alone now says us-east.
    sql(
        run,
        "UPDATE {s}.events SET home_region = 'us-east' WHERE event_id = "
        "(SELECT max(event_id) FROM {s}.events WHERE user_id = 3002)",
    )
    # The forged move: an update of 3004 with no old row.
    forged = {
        "op": "u",
        "before": None,
        "after": {"user_id": 3004, "home_region": "us-east", "country": "US", "segment": 1},
        "source": {
            "ts_ms": 1_780_315_200_000,
            "schema": run.schema,
            "table": "users",
            "lsn": 2**40,  # after every real change of this test
        },
        "ts_ms": 1_780_315_200_000,
    }
    asyncio.run(produce(run, "users", json.dumps(forged).encode()))

    # Item 601's popularity in eu-west follows the rows that name eu-west: 3001's two
    # views became clicks, 3002 lost one view to us-east. Once it shows that, the
    # router has routed every change above.
    wait_for(
        "item 601's views in eu-west",
        lambda: (vector(run, "eu-west", "item", 601) or {}).get("views_1h") == 3,
        timeout_s=180,
    )
    wait_for(
        "user 3002 without its re-tagged event",
        lambda: (vector(run, "eu-west", "user", 3002) or {}).get("views_30m") == 1,
        timeout_s=180,
    )
    wait_for("user 3004 moved to us-east", lambda: vector(run, "us-east", "user", 3004) is not None)
    wait_for(
        "user 3004 gone from eu-west's changelog",
        lambda: not rows_left(run, "eu-west", 3004),
        timeout_s=180,
    )

    eu_west = redis_of(run, "eu-west")
    us_east = redis_of(run, "us-east")
    # 3001 never came back to eu-west; its old rows name eu-west, so they count nowhere
    # for the user (the user's history stays behind, docs/pipeline.md).
    assert gone_from(eu_west, 3001)
    assert rows_left(run, "eu-west", 3001) == []
    moved = vector(run, "us-east", "user", 3001)
    assert moved is not None and not moved["views_30m"] and not moved["clicks_30m"]
    # 3002 is whole in eu-west and nowhere else.
    assert list(us_east.scan_iter(match="*user:3002*")) == []
    assert rows_left(run, "us-east", 3002) == []
    # 3004: nothing in eu-west, neither the vector nor a row in its changelog.
    assert gone_from(eu_west, 3004)
    for region in ("ap-southeast",):
        for user in (3001, 3002, 3004):
            assert list(redis_of(run, region).scan_iter(match=f"*user:{user}*")) == []
