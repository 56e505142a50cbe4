"""Values the lookup client did not write: one bad entity never fails the call, and
nothing passes for what it is not (real redis-server)."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
import redis
from edge_cache_stack import READ_TIMEOUT_S
from prometheus_client import CollectorRegistry

from edge_cache import (
    FeatureClient,
    FeatureSchema,
    FeatureWriter,
    KeyLayout,
    Position,
    RegionSettings,
)
from edge_cache.layout import RecordLayout

pytestmark = pytest.mark.integration
pytest_plugins = ["edge_cache_stack"]

ITEM = FeatureSchema.of("item", ["ctr", "price"])
KEYS = KeyLayout()


def _home(regions: list[RegionSettings]) -> RegionSettings:
    return regions[0].model_copy(update={"failover": []})


def _corrupt(registry: CollectorRegistry, reason: str) -> float | None:
    return registry.get_sample_value(
        "edgefeed_lookup_corrupt_values_total",
        {"region": "eu-west", "entity": "item", "reason": reason},
    )


def test_a_corrupt_value_is_one_missing_entity_named_and_counted(
    regions: list[RegionSettings], make_writer: Callable[..., FeatureWriter]
) -> None:
    home = _home(regions)
    writer = make_writer(home, [ITEM])
    for entity_id in ("a", "c"):
        writer.upsert("item", entity_id, {"ctr": 0.5, "price": 9.0}, Position(1), 1.0)
    writer.client.set(KEYS.key("item", "b"), b"EF\x01garbage that is no vector")
    registry = CollectorRegistry()
    with FeatureClient(
        "eu-west", [home], [ITEM], registry=registry, timeout_s=READ_TIMEOUT_S
    ) as client:
        result = client.get("item", ["a", "b", "c"])
    assert result.found.tolist() == [True, False, True]
    assert result.to_dicts()[0] == {"ctr": 0.5, "price": 9.0}
    ((row, reason),) = result.corrupt
    assert row == 1 and "'ef:{item:b}'" in reason and "not an edgefeed value" in reason
    assert _corrupt(registry, "format") == 1


def test_a_key_holding_a_hash_is_a_named_corrupt_entry_not_a_silent_miss(
    regions: list[RegionSettings], make_writer: Callable[..., FeatureWriter]
) -> None:
    home = _home(regions)
    make_writer(home, [ITEM]).upsert("item", "a", {"ctr": 0.5}, Position(1), 1.0)
    with redis.Redis.from_url(home.redis_url) as plain:
        plain.hset(KEYS.key("item", "h"), mapping={"ctr": "0.5"})
    registry = CollectorRegistry()
    with FeatureClient(
        "eu-west", [home], [ITEM], registry=registry, timeout_s=READ_TIMEOUT_S
    ) as client:
        result = client.get("item", ["a", "h", "absent"])
        # one id is read with GET, which tells the hash by its WRONGTYPE error
        alone, absent = client.get("item", ["h"]), client.get("item", ["absent"])
    assert result.found.tolist() == [True, False, False]
    ((row, reason),) = result.corrupt  # "absent" is just absent
    assert row == 1 and "key 'ef:{item:h}' holds a Redis hash" in reason
    assert alone.found.tolist() == [False] and absent.found.tolist() == [False]
    ((row, reason),) = alone.corrupt
    assert row == 0 and "key 'ef:{item:h}' holds a Redis hash" in reason
    assert absent.corrupt == ()
    assert _corrupt(registry, "wrong_type") == 2


def test_nan_is_missing_whether_the_writer_or_someone_else_stored_it(
    regions: list[RegionSettings], make_writer: Callable[..., FeatureWriter]
) -> None:
    home = _home(regions)
    writer = make_writer(home, [ITEM])
    writer.upsert("item", "w", {"ctr": math.nan, "price": 9.0}, Position(1), 1.0)
    # a value with the ctr bit set and a NaN in it (an older writer, a foreign tool)
    raw = bytearray(RecordLayout(ITEM).encode({"ctr": 0.0, "price": 1.0}, Position(1), 1, 2))
    raw[40:44] = np.float32(np.nan).tobytes()
    writer.client.set(KEYS.key("item", "r"), bytes(raw))
    with FeatureClient("eu-west", [home], [ITEM], timeout_s=READ_TIMEOUT_S) as client:
        result = client.get("item", ["w", "r"])
    assert result.found.tolist() == [True, True]
    assert result.present.tolist() == [[False, True], [False, True]]
    assert result.to_dicts() == [{"ctr": None, "price": 9.0}, {"ctr": None, "price": 1.0}]
    assert result.to_arrow().column("ctr").null_count == 2
