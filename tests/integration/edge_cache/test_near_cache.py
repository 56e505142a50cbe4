"""The near cache serves repeated reads in-process and is invalidated by Redis tracking."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import redis
from edge_cache_stack import READ_TIMEOUT_S

from edge_cache import (
    AsyncFeatureClient,
    FeatureClient,
    FeatureSchema,
    FeatureWriter,
    NearCacheConfig,
    Position,
    RegionSettings,
    Upsert,
)

pytestmark = pytest.mark.integration
pytest_plugins = ["edge_cache_stack"]

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
    with FeatureClient(
        "eu-west", regions, [USER], near_cache=NEAR, timeout_s=READ_TIMEOUT_S
    ) as client:
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
    with FeatureClient(
        "eu-west", regions, [USER], near_cache=NEAR, timeout_s=READ_TIMEOUT_S
    ) as client:
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
    with FeatureClient(
        "eu-west", regions, [USER], near_cache=short, timeout_s=READ_TIMEOUT_S
    ) as client:
        assert client.near is not None and _until(lambda: client.near.active)  # type: ignore[union-attr]
        client.get("user", [1])
        assert _until(lambda: client.get("user", [1]).near_hits == 0)


async def test_async_client_near_cache(
    regions: list[RegionSettings], make_writer: Callable[..., FeatureWriter]
) -> None:
    writer = make_writer(regions[0], [USER])
    writer.upsert("user", 1, {"a": 1.0}, Position(1), time.time())
    async with AsyncFeatureClient(
        "eu-west", regions, [USER], near_cache=NEAR, timeout_s=READ_TIMEOUT_S
    ) as client:
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


def test_cluster_near_cache_hits_and_invalidation(
    cluster_region: RegionSettings, make_writer: Callable[..., FeatureWriter]
) -> None:
    writer = make_writer(cluster_region, [USER])
    ids = list(range(12))  # spread over the three primaries
    writer.write([Upsert("user", i, {"a": float(i)}, Position(1), time.time()) for i in ids])
    with FeatureClient(
        "eu-west", [cluster_region], [USER], near_cache=NEAR, timeout_s=READ_TIMEOUT_S
    ) as client:
        near = client.near
        assert near is not None and len(client.listeners) == 3
        assert _until(lambda: near.active)
        assert client.get("user", ids).near_hits == 0
        assert client.get("user", ids).near_hits == 12
        writer.write([Upsert("user", i, {"a": -float(i)}, Position(2), time.time()) for i in ids])
        expected = [-float(i) for i in ids]
        assert _until(lambda: client.get("user", ids).values[:, 0].tolist() == expected)
        # one primary's invalidation connection drops: nothing is served until it is back
        victim = client.listeners[1]
        host, port = victim._pool.connection_kwargs["host"], victim._pool.connection_kwargs["port"]
        old_id = victim.client_id
        with redis.Redis(host=host, port=port) as admin:
            admin.client_kill_filter(_id=old_id)
        assert _until(lambda: near.active and victim.client_id not in (None, old_id))
        assert client.get("user", ids).near_hits == 0
        writer.upsert("user", 3, {"a": 33.0}, Position(3), time.time())
        assert _until(lambda: client.get("user", [3]).to_dicts()[0]["a"] == 33.0)


async def test_async_cluster_near_cache(
    cluster_region: RegionSettings, make_writer: Callable[..., FeatureWriter]
) -> None:
    writer = make_writer(cluster_region, [USER])
    writer.upsert("user", 1, {"a": 1.0}, Position(1), time.time())
    async with AsyncFeatureClient(
        "eu-west", [cluster_region], [USER], near_cache=NEAR, timeout_s=READ_TIMEOUT_S
    ) as client:
        assert client.near is not None and _until(lambda: client.near.active)  # type: ignore[union-attr]
        await client.get("user", [1])
        assert (await client.get("user", [1])).near_hits == 1
        writer.upsert("user", 1, {"a": 2.0}, Position(2), time.time())
        deadline = time.monotonic() + DEADLINE_S
        value = None
        while time.monotonic() < deadline:
            value = (await client.get("user", [1])).to_dicts()[0]["a"]
            if value == 2.0:
                break
            time.sleep(0.005)
        assert value == 2.0
