"""Lookup logic that needs no Redis: routing by residency, breaker, near cache, results."""

from __future__ import annotations

import numpy as np
import pytest

from edge_cache import (
    CircuitBreaker,
    ConfigError,
    FeatureSchema,
    InvalidValueError,
    NearCacheConfig,
    RegionSettings,
    UnknownEntityError,
    UnknownFeatureError,
)
from edge_cache.core import LookupCore
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
    with pytest.raises(InvalidValueError, match="max_staleness"):
        core.plan("user", [1], None, -1)
    with pytest.raises(InvalidValueError, match="max_staleness"):
        core.plan("user", [1], None, "soon")  # type: ignore[arg-type]
    with pytest.raises(InvalidValueError, match=r"single value 'abc'; pass \['abc'\]"):
        core.plan("user", "abc", None, None)  # type: ignore[arg-type]


def test_projection_resolved_once_and_matrix_dtype() -> None:
    core = LookupCore("eu-west", REGIONS, [PERSONAL, SHARED])
    first = core.projection("user", ["c", "a"])
    assert core.projection("user", ["c", "a"]) is first
    assert first.positions.tolist() == [2, 0]
    assert first.matrix_dtype == np.float32
    assert core.projection("item", None).matrix_dtype == np.float64
    # a single name is one feature, not its letters (and does not poison the cache)
    schema = FeatureSchema.of("t", ["abc", "a", "b", "c"])
    core = LookupCore("eu-west", REGIONS, [schema])
    assert core.projection("t", "abc").names == ("abc",)
    assert core.projection("t", ["a", "b", "c"]).names == ("a", "b", "c")


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


def test_cluster_node_urls_keep_scheme_credentials_and_db() -> None:
    from edge_cache.client import node_url

    assert node_url("redis://127.0.0.1:7000/0", "10.0.0.2", 7001) == "redis://10.0.0.2:7001/0"
    assert (
        node_url("rediss://app:s3cret@seed.example:6380/2", "10.0.0.3", 6381)
        == "rediss://app:s3cret@10.0.0.3:6381/2"
    )


def test_default_staleness_bound_and_per_call_override() -> None:
    from datetime import timedelta

    core = LookupCore("eu-west", REGIONS, [PERSONAL], max_staleness=timedelta(seconds=2))
    assert core.plan("user", [1], None, None).max_staleness_us == 2_000_000
    assert core.plan("user", [1], None, 0.5).max_staleness_us == 500_000
    assert (
        LookupCore("eu-west", REGIONS, [PERSONAL]).plan("user", [1], None, None).max_staleness_us
        is None
    )
    with pytest.raises(InvalidValueError, match="max_staleness"):
        LookupCore("eu-west", REGIONS, [PERSONAL], max_staleness=-1)


def test_a_rebuilding_region_is_said_and_a_staleness_bound_withholds_its_vectors() -> None:
    """The list of rebuilds (pipeline.history) is read at most once a second per region,
    after a read that succeeded; the result says so, and a call with a staleness bound
    gets no vector of a type whose windows are known short."""
    import time

    from edge_cache import Position
    from edge_cache.core import Failure, Read, ReadRebuilding
    from edge_cache.layout import RecordLayout

    core = LookupCore("eu-west", REGIONS, [PERSONAL])
    breakers = {name: CircuitBreaker() for name in core.regions}
    now_us = int(time.time() * 1_000_000)
    value = RecordLayout(PERSONAL).encode({"a": 1.0}, Position(5, 0), now_us, now_us)

    def lookup(listed: object, max_staleness: float | None = None) -> tuple[object, list[str]]:
        plan = core.plan("user", [1], None, max_staleness)
        run = core.start(plan, breakers, None, time.perf_counter())
        asked: list[str] = []
        step = run.send(None)
        while step is not None:
            asked.append(type(step).__name__)
            reply = ([value], 1) if isinstance(step, Read) else listed
            assert isinstance(step, Read | ReadRebuilding)
            step = run.send(reply)  # type: ignore[arg-type]
        return run.result, asked

    result, asked = lookup({b"user|0": b"{}", b"item|1": b"{}"})
    assert asked == ["Read", "ReadRebuilding"]
    assert result.rebuilding and result.found.tolist() == [True]  # served, and said
    result, asked = lookup({}, max_staleness=60.0)  # within the second: not asked again
    assert asked == ["Read"]
    assert result.rebuilding and result.stale.tolist() == [True]
    assert result.found.tolist() == [False] and not result.present.any()
    core.rebuilding["eu-west"] = (0.0, core.rebuilding["eu-west"][1])  # a second later
    result, asked = lookup(Failure("timeout", "timed out"))  # unknown: what was known holds
    assert asked == ["Read", "ReadRebuilding"] and result.rebuilding
    core.rebuilding["eu-west"] = (0.0, core.rebuilding["eu-west"][1])
    result, _ = lookup({}, max_staleness=60.0)  # the rebuild ended
    assert not result.rebuilding and result.found.tolist() == [True]


def test_packed_reads_are_what_redis_py_would_send() -> None:
    import redis

    from edge_cache.client import _pack_reads

    packer = redis.Connection()
    for keys in (["ef:{user:1}"], ["ef:{user:1}", "ef:{user:22}", "ef:{user:ü}", "ef:{user:ø x}"]):
        expected = b"".join(packer.pack_commands([("MGET", *keys), ("EXISTS", *keys)]))
        assert _pack_reads(keys) == expected
