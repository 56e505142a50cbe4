"""The freshness records: written by the writer with the batch, read back through edge_cache."""

from __future__ import annotations

import pytest
import redis
import redis.asyncio as aioredis

from edge_cache import (
    AsyncFeatureWriter,
    FeatureSchema,
    FreshnessRecord,
    Position,
    RegionSettings,
    Upsert,
    read_freshness,
)
from monitoring.freshness import read_region

pytestmark = pytest.mark.integration
pytest_plugins = ["edge_cache_stack"]

USER = FeatureSchema.of("user", ["a"])
ITEM = FeatureSchema.of("item", ["b"])


async def test_batch_with_its_freshness_records_read_back_by_the_monitor(
    regions: list[RegionSettings],
) -> None:
    region = regions[0]
    ops = [
        Upsert("user", "1", {"a": 1.0}, Position(10), 2.0),
        Upsert("user", "2", {"a": 2.0}, Position(12), 3.0),
        Upsert("item", "9", {"b": 1.0}, Position(5), 4.0),
    ]
    async with AsyncFeatureWriter.from_region(region, [USER, ITEM], clock=lambda: 50.0) as writer:
        assert await writer.write(ops, freshness=True) == [True, True, True]
    client = aioredis.Redis.from_url(region.redis_url)
    try:
        snapshot = await read_freshness(client)
    finally:
        await client.aclose()
    assert snapshot.records == {
        "user": FreshnessRecord("user", 3_000_000, 50_000_000, 12),
        "item": FreshnessRecord("item", 4_000_000, 50_000_000, 5),
    }
    assert snapshot.sampled_commit_us == {"user": (2_000_000, 3_000_000), "item": (4_000_000,)}
    times = await read_region(region.name, region.redis_url)
    user = next(e for e in times.entities if e.entity == "user")
    assert (user.commit_us, user.write_us, user.lsn) == (3_000_000, 50_000_000, "12")


async def test_a_malformed_record_is_left_out_not_fatal(regions: list[RegionSettings]) -> None:
    region = regions[0]
    with redis.Redis.from_url(region.redis_url) as plain:
        plain.hset("ef:freshness:user", mapping={"commit_us": "soon"})
        plain.hset("ef:freshness:item", mapping={"commit_us": 1, "write_us": 2, "lsn": 3})
    client = aioredis.Redis.from_url(region.redis_url)
    try:
        snapshot = await read_freshness(client)
    finally:
        await client.aclose()
    assert snapshot.records == {"item": FreshnessRecord("item", 1, 2, 3)}


async def test_the_quarantine_list_is_read_back_with_the_freshness(
    regions: list[RegionSettings],
) -> None:
    region = regions[0]
    async with AsyncFeatureWriter.from_region(region, [USER]) as writer:
        await writer.mark_quarantined({"user:8": "OverflowError: " + "x" * 900, "user:9": "bad"})
        await writer.mark_quarantined({}, released=["user:9"])
    times = await read_region(region.name, region.redis_url)
    assert times.quarantined == 1
    ((entity, reason),) = times.quarantine_sample
    assert entity == "user:8" and reason.startswith("OverflowError")
    assert len(reason.encode()) <= 500  # a reason is cut, however long the error
    async with AsyncFeatureWriter.from_region(region, [USER]) as writer:
        await writer.mark_quarantined({}, released=["user:8"])
    assert (await read_region(region.name, region.redis_url)).quarantined == 0
