"""The ranking model reads real features from a real Redis edge cache.

Features are written by the edge cache's own writer (the pipeline's sink) and
read by its lookup client, exactly as in production.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import time

import numpy as np
import pytest
import redis.asyncio as aioredis
import torch

from edge_cache import AsyncFeatureClient, AsyncFeatureWriter, Position, RegionSettings, Upsert
from workers.batcher import BatchingConfig
from workers.client import WorkerClient
from workers.exceptions import WorkerResponseError
from workers.features import EdgeCacheFeatureSource
from workers.models import Ranker, RankerConfig, load_served_model
from workers.server import InferenceServer, ServerConfig
from workers.synthetic import click_world

pytestmark = pytest.mark.integration

WORLD = click_world()
CONFIG = RankerConfig()
_LSN = itertools.count(1)


def _region(url: str) -> RegionSettings:
    return RegionSettings(name="eu-west", redis_url=url, residency_zone="eu")


async def _write(url: str, entity: str, rows: dict[str, dict[str, float | None]]) -> None:
    writer = AsyncFeatureWriter.from_region(_region(url), CONFIG.schemas())
    try:
        await writer.publish_schemas()
        lsn = next(_LSN)
        await writer.write(
            [
                Upsert(entity, entity_id, values, Position(lsn), time.time())
                for entity_id, values in rows.items()
            ]
        )
    finally:
        await writer.client.aclose()


def _vectors(
    names: tuple[str, ...], ids: tuple[str, ...], matrix: np.ndarray, count: int
) -> dict[str, dict[str, float | None]]:
    return {
        entity_id: dict(zip(names, map(float, matrix[i]), strict=True))
        for i, entity_id in enumerate(ids[:count])
    }


async def _seed(url: str, users: int = 20, items: int = 60) -> None:
    await _write(
        url,
        CONFIG.user_entity,
        _vectors(CONFIG.user_features, WORLD.user_ids, WORLD.user_features, users),
    )
    await _write(
        url,
        CONFIG.item_entity,
        _vectors(CONFIG.item_features, WORLD.item_ids, WORLD.item_features, items),
    )


def _expected(user: int, items: list[int]) -> np.ndarray:
    module = load_served_model("ranker", features=lambda config: _source("redis://x")).module
    with torch.inference_mode():
        users = torch.from_numpy(np.repeat(WORLD.user_features[[user]], len(items), axis=0))
        return module(users, torch.from_numpy(WORLD.item_features[items])).numpy()


def _source(url: str) -> EdgeCacheFeatureSource:
    # Not a test of deadlines: a busy CI machine must not turn a slow read into a 503.
    client = AsyncFeatureClient("eu-west", [_region(url)], CONFIG.schemas(), timeout_s=5.0)
    return EdgeCacheFeatureSource(client)


def _ranker(url: str) -> Ranker:
    model = load_served_model("ranker", features=lambda config: _source(url))
    assert isinstance(model, Ranker)
    return model


async def test_ranker_scores_with_features_read_from_the_edge_cache(
    region_cache: aioredis.Redis, workers_redis_url: str
) -> None:
    await _seed(workers_redis_url)
    items = [3, 17, 42, 5]
    async with (
        InferenceServer(
            [_ranker(workers_redis_url)], config=ServerConfig(region="eu-west")
        ) as server,
        WorkerClient(server.url) as client,
    ):
        answer = await client.rank("ranker", "u7", [f"i{i}" for i in items])
    np.testing.assert_allclose(answer.body["scores"], _expected(7, items), rtol=1e-5, atol=1e-6)
    ranking = [entry["score"] for entry in answer.body["ranking"]]
    assert ranking == sorted(ranking, reverse=True)
    assert answer.latency.data_s > 0, "the feature lookup is T_data"
    assert answer.body["version"] == "demo-1"


async def test_changed_features_in_the_cache_change_the_scores(
    region_cache: aioredis.Redis, workers_redis_url: str
) -> None:
    await _seed(workers_redis_url)
    async with (
        InferenceServer([_ranker(workers_redis_url)]) as server,
        WorkerClient(server.url) as client,
    ):
        before = await client.rank("ranker", "u1", ["i2"])
        # The pipeline updates user u1 to look exactly like user u9.
        await _write(
            workers_redis_url,
            CONFIG.user_entity,
            _vectors(CONFIG.user_features, ("u1",), WORLD.user_features[[9]], 1),
        )
        after = await client.rank("ranker", "u1", ["i2"])
    assert before.body["scores"] != after.body["scores"]
    np.testing.assert_allclose(after.body["scores"], _expected(9, [2]), rtol=1e-5, atol=1e-6)


async def test_batched_ranking_equals_unbatched_ranking(
    region_cache: aioredis.Redis, workers_redis_url: str
) -> None:
    await _seed(workers_redis_url)
    requests = [(f"u{u}", [f"i{(u * 5 + k) % 60}" for k in range(1 + u % 4)]) for u in range(20)]
    results = {}
    for name, batching in (
        ("alone", BatchingConfig(max_batch_size=4)),
        # a fixed 50 ms window, so that the 20 concurrent requests surely share batches
        (
            "batched",
            BatchingConfig(max_batch_size=32, max_queue_delay_s=0.05, adaptive_delay=False),
        ),
    ):
        async with (
            InferenceServer([_ranker(workers_redis_url)], batching=batching) as server,
            WorkerClient(server.url) as client,
        ):
            answers = await asyncio.gather(*(client.rank("ranker", u, i) for u, i in requests))
        results[name] = answers
    assert max(a.batch_rows for a in results["batched"]) > 4
    for alone, batched in zip(results["alone"], results["batched"], strict=True):
        np.testing.assert_allclose(
            batched.body["scores"], alone.body["scores"], rtol=1e-5, atol=1e-6
        )


async def test_missing_features_are_a_422_naming_the_ids_and_the_worker_keeps_serving(
    region_cache: aioredis.Redis, workers_redis_url: str
) -> None:
    await _seed(workers_redis_url, users=5, items=10)
    # An item whose vector lacks one value in the cache.
    partial = _vectors(CONFIG.item_features, ("i11",), WORLD.item_features[[11]], 1)
    partial["i11"]["i3"] = None
    await _write(workers_redis_url, CONFIG.item_entity, partial)
    async with (
        InferenceServer([_ranker(workers_redis_url)]) as server,
        WorkerClient(server.url) as client,
    ):
        with pytest.raises(WorkerResponseError) as no_user:
            await client.rank("ranker", "u404", ["i1"])
        with pytest.raises(WorkerResponseError) as no_item:
            await client.rank("ranker", "u1", ["i1", "i999", "i11"])
        dropped = await client.rank("ranker", "u1", ["i1", "i999", "i11"], on_missing="drop")
        fine = await client.rank("ranker", "u2", ["i3"])
    assert no_user.value.status == 422
    assert no_user.value.error_type == "MissingFeaturesError"
    assert "demo_user 'u404': no features" in str(no_user.value)
    assert no_item.value.status == 422
    assert "demo_item 'i999': no features" in str(no_item.value)
    assert "demo_item 'i11': missing ['i3']" in str(no_item.value)
    assert dropped.body["dropped"] == ["i999", "i11"]
    assert [entry["item_id"] for entry in dropped.body["ranking"]] == ["i1"]
    np.testing.assert_allclose(fine.body["scores"], _expected(2, [3]), rtol=1e-5, atol=1e-6)


async def test_bad_ranking_requests_are_clear_4xx(
    region_cache: aioredis.Redis, workers_redis_url: str
) -> None:
    await _seed(workers_redis_url, users=2, items=2)
    async with (
        InferenceServer(
            [_ranker(workers_redis_url)], batching=BatchingConfig(max_batch_size=8)
        ) as server,
        WorkerClient(server.url) as client,
    ):
        cases = [
            (b'{"user_id": "u1"}', "application/json", 400, "item_ids"),
            (b"not json", "application/json", 400, "invalid ranking request"),
            (b'{"user_id": "u1", "item_ids": ["i1", "i1"]}', "application/json", 400, "duplicates"),
            (
                b'{"user_id": "u1", "item_ids": '
                + str([f"i{i}" for i in range(9)]).replace("'", '"').encode()
                + b"}",
                "application/json",
                400,
                "at most 8 per request",
            ),
            (b'{"user_id": "u1", "item_ids": ["i1"]}', "text/plain", 415, "takes application/json"),
        ]
        for body, content_type, status, message in cases:
            with pytest.raises(WorkerResponseError) as error:
                await client.infer("ranker", body, content_type)
            assert error.value.status == status, body
            assert message in str(error.value)
        assert (await client.rank("ranker", "u1", ["i1"])).body["scores"]


async def test_unreachable_edge_cache_is_a_retryable_503_naming_the_region() -> None:
    with socket.socket() as sock:  # a port with nothing listening
        sock.bind(("127.0.0.1", 0))
        dead = f"redis://127.0.0.1:{sock.getsockname()[1]}/0"
    async with InferenceServer([_ranker(dead)]) as server, WorkerClient(server.url) as client:
        with pytest.raises(WorkerResponseError) as error:
            await client.rank("ranker", "u1", ["i1"])
    assert error.value.status == 503
    assert error.value.error_type == "FeatureLookupError"
    assert error.value.retryable
    assert "eu-west" in str(error.value)
