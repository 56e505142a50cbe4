"""More concurrent lookups than pooled connections queue; they never mark a healthy
region down (real redis-server)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry

from edge_cache import AsyncFeatureClient, FeatureSchema, FeatureWriter, Position, RegionSettings

pytestmark = pytest.mark.integration
pytest_plugins = ["edge_cache_stack"]

ITEM = FeatureSchema.of("item", ["ctr", "price"])
CONCURRENT = 300


async def test_concurrent_lookups_beyond_the_pool_queue_and_all_succeed(
    regions: list[RegionSettings], make_writer: Callable[..., FeatureWriter]
) -> None:
    home = regions[0].model_copy(update={"failover": []})
    make_writer(home, [ITEM]).upsert("item", "sku", {"ctr": 0.5, "price": 9.0}, Position(1), 1.0)
    registry = CollectorRegistry()
    # the default pool (100 connections), 300 lookups at once: the ranker at 150 requests
    async with AsyncFeatureClient(
        "eu-west", [home], [ITEM], timeout_s=5.0, registry=registry
    ) as client:
        results = await asyncio.gather(
            *(client.get("item", ["sku"]) for _ in range(CONCURRENT)), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        assert errors == []
        assert all(r.found.all() for r in results)  # type: ignore[union-attr]
        assert client.breakers["eu-west"].state == "closed"
    for reason in ("timeout", "connection", "breaker_open"):
        assert (
            registry.get_sample_value(
                "edgefeed_lookup_region_failures_total", {"region": "eu-west", "reason": reason}
            )
            is None
        )
