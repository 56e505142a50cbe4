"""The near cache serves repeated reads in-process and is invalidated by Redis tracking."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import redis

from edge_cache import (
    AsyncFeatureClient,
    ConfigError,
    FeatureClient,
    FeatureSchema,
    FeatureWriter,
    NearCacheConfig,
    Position,
    RegionSettings,
)

pytestmark = pytest.mark.integration

USER = FeatureSchema.of("user", ["a", "b"])
NEAR = NearCacheConfig(max_entries=1000, ttl_s=60)
DEADLINE_S = 5.0


def _until(predicate: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


def test_hits_then_invalidated_after_write_and_delete(
    regions: list[RegionSettings], make_writer: Callable[..., FeatureWriter]
) -> None:
    writer = make_writer(regions[0], [USER])
    writer.upsert("user", 1, {"a": 1.0, "b": 2.0}, Position(1), time.time())
    with FeatureClient("eu-west", regions, [USER], near_cache=NEAR) as client:
        assert client.near is not None and _until(lambda: client.near.active)  # type: ignore[union-attr]
        first = client.get("user", [1, 2])
        assert first.near_hits == 0
        second = client.get("user", [1, 2])
        assert second.near_hits == 2  # the absent id 2 is cached too
        assert second.to_dicts() == first.to_dicts()

        writer.upsert("user", 1, {"a": 5.0, "b": 2.0}, Position(2), time.time())
        assert _until(lambda: client.get("user", [1]).to_dicts()[0]["a"] == 5.0)
        writer.upsert("user", 2, {"a": 8.0}, Position(2), time.time())  # the cached absence
        assert _until(lambda: bool(client.get("user", [2]).found[0]))
        writer.delete("user", 1, Position(3), time.time())
        assert _until(lambda: not client.get("user", [1]).found[0])
        assert client.get("user", [1, 2]).near_hits == 2


def test_listener_loss_flushes_and_recovers(
    regions: list[RegionSettings], make_writer: Callable[..., FeatureWriter]
) -> None:
    writer = make_writer(regions[0], [USER])
    writer.upsert("user", 1, {"a": 1.0}, Position(1), time.time())
    with FeatureClient("eu-west", regions, [USER], near_cache=NEAR) as client:
        near, listener = client.near, client.listener
        assert near is not None and listener is not None
        assert _until(lambda: near.active)
        client.get("user", [1])
        assert client.get("user", [1]).near_hits == 1
        old_id = listener.client_id
        with redis.Redis.from_url(regions[0].redis_url) as admin:
            admin.client_kill_filter(_id=old_id)
        # the listener reconnects with a new id; nothing cached survives the gap
        assert _until(lambda: near.active and listener.client_id not in (None, old_id))
        assert client.get("user", [1]).near_hits == 0
        assert client.get("user", [1]).near_hits == 1
        # and invalidation works through the new connection
        writer.upsert("user", 1, {"a": 2.0}, Position(2), time.time())
        assert _until(lambda: client.get("user", [1]).to_dicts()[0]["a"] == 2.0)


def test_ttl_bounds_entries(
    regions: list[RegionSettings], make_writer: Callable[..., FeatureWriter]
) -> None:
    writer = make_writer(regions[0], [USER])
    writer.upsert("user", 1, {"a": 1.0}, Position(1), time.time())
    short = NearCacheConfig(max_entries=10, ttl_s=0.05)
    with FeatureClient("eu-west", regions, [USER], near_cache=short) as client:
        assert client.near is not None and _until(lambda: client.near.active)  # type: ignore[union-attr]
        client.get("user", [1])
        assert _until(lambda: client.get("user", [1]).near_hits == 0)


async def test_async_client_near_cache(
    regions: list[RegionSettings], make_writer: Callable[..., FeatureWriter]
) -> None:
    writer = make_writer(regions[0], [USER])
    writer.upsert("user", 1, {"a": 1.0}, Position(1), time.time())
    async with AsyncFeatureClient("eu-west", regions, [USER], near_cache=NEAR) as client:
        assert client.near is not None and _until(lambda: client.near.active)  # type: ignore[union-attr]
        await client.get("user", [1])
        assert (await client.get("user", [1])).near_hits == 1
        writer.upsert("user", 1, {"a": 3.0}, Position(2), time.time())
        deadline = time.monotonic() + DEADLINE_S
        value = None
        while time.monotonic() < deadline:
            value = (await client.get("user", [1])).to_dicts()[0]["a"]
            if value == 3.0:
                break
            time.sleep(0.005)
        assert value == 3.0


def test_near_cache_refused_on_cluster(cluster_region: RegionSettings) -> None:
    with pytest.raises(ConfigError, match="single-server"):
        FeatureClient("eu-west", [cluster_region], [USER], near_cache=NEAR)
