"""The ranker under load and on hostile cache contents (real worker server, real
redis-server): pool exhaustion never marks the region down, a corrupt value or a NaN
is one missing item that on_missing decides about."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import redis.asyncio as aioredis

from edge_cache import (
    AsyncFeatureClient,
    AsyncFeatureWriter,
    KeyLayout,
    Position,
    RegionSettings,
    Upsert,
)
from workers.client import WorkerClient
from workers.exceptions import WorkerResponseError
from workers.features import EdgeCacheFeatureSource
from workers.models import Ranker, RankerConfig, load_served_model
from workers.server import InferenceServer
from workers.synthetic import click_world

pytestmark = pytest.mark.integration

WORLD = click_world()
CONFIG = RankerConfig()
CONCURRENT = 240


def _region(url: str) -> RegionSettings:
    return RegionSettings(name="eu-west", redis_url=url, residency_zone="eu")


async def _seed(url: str, users: int = 10, items: int = 20, **override: dict[str, float]) -> None:
    ops = [
        Upsert(
            CONFIG.user_entity,
            WORLD.user_ids[i],
            dict(zip(CONFIG.user_features, map(float, WORLD.user_features[i]), strict=True)),
            Position(1),
            time.time(),
        )
        for i in range(users)
    ]
    for i in range(items):
        values = dict(zip(CONFIG.item_features, map(float, WORLD.item_features[i]), strict=True))
        values.update(override.get(WORLD.item_ids[i], {}))
        ops.append(Upsert(CONFIG.item_entity, WORLD.item_ids[i], values, Position(1), time.time()))
    async with AsyncFeatureWriter.from_region(_region(url), CONFIG.schemas()) as writer:
        await writer.write(ops)


def _ranker(client: AsyncFeatureClient) -> Ranker:
    model = load_served_model("ranker", features=lambda config: EdgeCacheFeatureSource(client))
    assert isinstance(model, Ranker)
    return model


async def test_more_concurrent_requests_than_pooled_connections_never_503(
    region_cache: aioredis.Redis, workers_redis_url: str
) -> None:
    await _seed(workers_redis_url)
    # the default pool (100 connections) against 240 requests = 480 concurrent lookups;
    # a generous deadline: only the pool is under test, not this machine's speed
    client = AsyncFeatureClient(
        "eu-west", [_region(workers_redis_url)], CONFIG.schemas(), timeout_s=5.0
    )
    async with InferenceServer([_ranker(client)]) as server, WorkerClient(server.url) as http:
        answers = await asyncio.gather(
            *(http.rank("ranker", f"u{i % 10}", ["i1", "i2", "i3"]) for i in range(CONCURRENT)),
            return_exceptions=True,
        )
        breaker = client.breakers["eu-west"].state
    statuses = [a.status if isinstance(a, WorkerResponseError) else 200 for a in answers]
    unexpected = [
        a
        for a in answers
        if isinstance(a, BaseException) and not isinstance(a, WorkerResponseError)
    ]
    assert unexpected == []
    assert 503 not in statuses
    assert set(statuses) <= {200, 429}  # 429 only with Retry-After (the worker's backpressure)
    assert all(a.retry_after_s is not None for a in answers if isinstance(a, WorkerResponseError))
    assert breaker == "closed"


async def test_a_corrupt_or_nan_item_is_dropped_or_refused_by_on_missing(
    region_cache: aioredis.Redis, workers_redis_url: str
) -> None:
    await _seed(workers_redis_url, i5={"i0": float("nan")})
    await region_cache.set(KeyLayout().key(CONFIG.item_entity, "i3"), b"not a vector at all")
    client = AsyncFeatureClient(
        "eu-west", [_region(workers_redis_url)], CONFIG.schemas(), timeout_s=5.0
    )
    async with InferenceServer([_ranker(client)]) as server, WorkerClient(server.url) as http:
        with pytest.raises(WorkerResponseError) as refused:
            await http.rank("ranker", "u1", ["i1", "i3", "i5"])
        dropped = await http.rank("ranker", "u1", ["i1", "i3", "i5"], on_missing="drop")
    assert refused.value.status == 422, str(refused.value)
    assert "schemas disagree" not in str(refused.value)
    assert "demo_item 'i3': no features" in str(refused.value)
    assert "demo_item 'i5': missing ['i0']" in str(refused.value)
    assert dropped.body["dropped"] == ["i3", "i5"]
    assert [entry["item_id"] for entry in dropped.body["ranking"]] == ["i1"]
    assert np.isfinite(dropped.body["scores"]).all()
