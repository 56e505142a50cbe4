"""Lookup logic that needs no Redis: routing by residency, breaker, near cache, results."""

from __future__ import annotations

import numpy as np
import pytest

from edge_cache import (
    CircuitBreaker,
    ConfigError,
    FeatureSchema,
    NearCacheConfig,
    RegionSettings,
    UnknownEntityError,
    UnknownFeatureError,
)
from edge_cache.client import LookupCore
from edge_cache.nearcache import NearCache

REGIONS = [
    RegionSettings(
        name="eu-west",
        redis_url="redis://h:1",
        residency_zone="eu",
        failover=["us-east", "eu-central", "ap-southeast"],
    ),
    RegionSettings(name="us-east", redis_url="redis://h:2", residency_zone="us"),
    RegionSettings(name="eu-central", redis_url="redis://h:3", residency_zone="eu"),
    RegionSettings(name="ap-southeast", redis_url="redis://h:4", residency_zone="apac"),
]
PERSONAL = FeatureSchema.of("user", ["a", "b", "c"], personal=True)
SHARED = FeatureSchema.of("item", {"p": "float32", "q": "int64"})


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_routes_keep_personal_data_in_its_zone() -> None:
    core = LookupCore("eu-west", REGIONS, [PERSONAL, SHARED])
    allowed, refused = core.route(PERSONAL)
    assert allowed == ["eu-west", "eu-central"]
    assert [name for name, _ in refused] == ["us-east", "ap-southeast"]
    assert "outside residency zone 'eu'" in refused[0][1]
    assert core.route(SHARED) == (["eu-west", "us-east", "eu-central", "ap-southeast"], [])


def test_core_errors() -> None:
    with pytest.raises(ConfigError, match="region 'mars' not in regions: eu-west, us-east"):
        LookupCore("mars", REGIONS, [PERSONAL])
    with pytest.raises(ConfigError, match="fails over to 'us-east'"):
        LookupCore("eu-west", REGIONS[:1], [PERSONAL])
    core = LookupCore("eu-west", REGIONS, [PERSONAL, SHARED])
    with pytest.raises(UnknownEntityError, match=r"'users'.*item, user"):
        core.plan("users", [1], None, None)
    with pytest.raises(UnknownFeatureError, match=r"'d', 'e'.*valid: a, b, c"):
        core.plan("user", [1], ["a", "d", "e"], None)
    with pytest.raises(ConfigError, match="max_staleness"):
        core.plan("user", [1], None, -1)
    with pytest.raises(ConfigError, match="single value"):
        core.plan("user", "abc", None, None)  # type: ignore[arg-type]


def test_projection_resolved_once_and_matrix_dtype() -> None:
    core = LookupCore("eu-west", REGIONS, [PERSONAL, SHARED])
    first = core.projection("user", ["c", "a"])
    assert core.projection("user", ["c", "a"]) is first
    assert first.positions.tolist() == [2, 0]
    assert first.matrix_dtype == np.float32
    assert core.projection("item", None).matrix_dtype == np.float64


def test_breaker_opens_probes_and_closes() -> None:
    clock = Clock()
    breaker = CircuitBreaker(failure_threshold=2, reset_timeout_s=1.0, clock=clock)
    assert breaker.allow() and breaker.state == "closed"
    breaker.failure()
    assert breaker.allow()  # one failure is below the threshold
    breaker.failure()
    assert breaker.state == "open" and not breaker.allow()
    clock.now += 1.0
    assert breaker.state == "half_open"
    assert breaker.allow()  # the probe
    assert not breaker.allow()  # only one probe at a time
    breaker.failure()  # probe failed: open again
    assert not breaker.allow()
    clock.now += 1.0
    assert breaker.allow()
    breaker.success()
    assert breaker.state == "closed" and breaker.allow() and breaker.allow()


def test_near_cache_ttl_lru_and_invalidation_races() -> None:
    clock = Clock()
    cache = NearCache(NearCacheConfig(max_entries=2, ttl_s=1.0), clock=clock)
    assert cache.lookup(["k1"]) == ([None], [0])  # inactive: serves nothing
    cache.set_active(True)
    ticket = cache.reserve(["k1", "k2"])
    cache.fill(["k1", "k2"], [b"v1", None], ticket)
    assert cache.lookup(["k1", "k2"]) == ([b"v1", None], [])  # None: known absent
    clock.now += 1.0
    assert cache.lookup(["k1"])[1] == [0]  # expired at the TTL
    # an invalidation during a read wins over the read's (older) value
    ticket = cache.reserve(["k1"])
    cache.invalidate(["k1"])
    cache.fill(["k1"], [b"old"], ticket)
    assert cache.lookup(["k1"])[1] == [0]
    # a reconnect of the invalidation channel voids reads started before it
    ticket = cache.reserve(["k1"])
    cache.set_active(False)
    cache.set_active(True)
    cache.fill(["k1"], [b"old"], ticket)
    assert cache.lookup(["k1"])[1] == [0]
    # LRU bound
    for key in ("a", "b", "c"):
        cache.fill([key], [b"x"], cache.reserve([key]))
    assert len(cache) == 2 and cache.lookup(["a"])[1] == [0]
    cache.invalidate(None)
    assert len(cache) == 0
    with pytest.raises(ConfigError):
        NearCacheConfig(max_entries=0)
