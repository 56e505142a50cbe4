"""How the ranker's feature source turns the edge cache's errors into HTTP answers."""

from __future__ import annotations

from typing import Any

import pytest

from edge_cache import PoolExhaustedError, RegionUnavailableError
from workers.exceptions import FeatureLookupError, QueueFullError
from workers.features import EdgeCacheFeatureSource, pool_size


class _Raising:
    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    async def get(self, *args: Any, **kwargs: Any) -> Any:
        raise self.exc


async def test_an_exhausted_lookup_pool_sheds_with_429_and_retry_after() -> None:
    exc = PoolExhaustedError("busy", "eu-west", retry_after_s=0.25)
    source = EdgeCacheFeatureSource(_Raising(exc), owns_client=False)  # type: ignore[arg-type]
    with pytest.raises(QueueFullError) as raised:
        await source.get("item", ["a"])
    assert raised.value.http_status == 429
    assert raised.value.retry_after_s == 0.25
    assert raised.value.retryable


async def test_an_unavailable_region_is_still_a_retryable_503() -> None:
    exc = RegionUnavailableError("down", "eu-west", (("eu-west", "timed out"),))
    source = EdgeCacheFeatureSource(_Raising(exc), owns_client=False)  # type: ignore[arg-type]
    with pytest.raises(FeatureLookupError) as raised:
        await source.get("item", ["a"])
    assert raised.value.http_status == 503


def test_pool_is_sized_for_two_lookups_per_request() -> None:
    assert pool_size(256) == 512
    assert pool_size(0) == 2
