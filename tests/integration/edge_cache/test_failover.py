"""Failover honours residency; a dead region costs one timeout thanks to the breaker."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from prometheus_client import CollectorRegistry

from edge_cache import (
    AsyncFeatureClient,
    FeatureClient,
    FeatureSchema,
    FeatureWriter,
    Position,
    RegionSettings,
    RegionUnavailableError,
)

pytestmark = pytest.mark.integration
pytest_plugins = ["edge_cache_stack"]

PROFILE = FeatureSchema.of("profile", ["age_bucket", "spend_30d"], personal=True)
ITEM = FeatureSchema.of("item", ["ctr", "price"])


def _vector_reads(region: RegionSettings) -> int:
    """Lookups that read vectors from ``region``: one MGET each (a GET for one id)."""
    with redis.Redis.from_url(region.redis_url) as client:
        stats = client.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in ("mget", "get"))


def _dead_home(regions: list[RegionSettings], hole: Any) -> list[RegionSettings]:
    """eu-west hangs (accepts TCP, never answers); us-east and ap-southeast are healthy."""
    eu = regions[0].model_copy(update={"redis_url": f"redis://127.0.0.1:{hole.port}/0"})
    return [eu, *regions[1:]]


def _seed(regions: list[RegionSettings], make_writer: Callable[..., FeatureWriter]) -> None:
    for region in regions:
        writer = make_writer(region, [PROFILE, ITEM])
        writer.upsert(
            "profile", "u1", {"age_bucket": 3.0, "spend_30d": 12.5}, Position(1), time.time()
        )
        writer.upsert("item", "sku", {"ctr": 0.5, "price": 9.0}, Position(1), time.time())


def _refusing_port() -> int:
    """A loopback port nobody listens on: connections are refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize("failure", ["hangs", "refuses"])
def test_personal_features_never_leave_residency_zone(
    regions: list[RegionSettings],
    make_writer: Callable[..., FeatureWriter],
    black_hole: Any,
    failure: str,
) -> None:
    _seed(regions, make_writer)  # every region holds the entity, so a leak would succeed
    before = {r.name: _vector_reads(r) for r in regions[1:]}
    if failure == "hangs":
        dead = _dead_home(regions, black_hole)
    else:
        url = f"redis://127.0.0.1:{_refusing_port()}/0"
        dead = [regions[0].model_copy(update={"redis_url": url}), *regions[1:]]
    with FeatureClient("eu-west", dead, [PROFILE, ITEM], timeout_s=0.2) as client:
        with pytest.raises(RegionUnavailableError) as error:
            client.get("profile", ["u1"])
        message = str(error.value)
        assert "personal entity type 'profile'" in message
        assert "residency zone 'eu'" in message
        reason = "timed out" if failure == "hangs" else "connection failed"
        assert f"eu-west: {reason}" in message
        assert "us-east: not tried" in message and "ap-southeast: not tried" in message
        assert error.value.retryable
        # shared features of the same client do fail over
        item = client.get("item", ["sku"])
        assert item.region == "us-east"
        assert item.to_dicts() == [{"ctr": 0.5, "price": 9.0}]
    after = {r.name: _vector_reads(r) for r in regions[1:]}
    assert after["us-east"] == before["us-east"] + 1  # the item read only
    assert after["ap-southeast"] == before["ap-southeast"]


def test_personal_features_fail_over_within_the_zone(
    regions: list[RegionSettings], make_writer: Callable[..., FeatureWriter], black_hole: Any
) -> None:
    _seed(regions, make_writer)
    eu_dead, us, ap = _dead_home(regions, black_hole)
    # a second EU region (served by the ap-southeast server, renamed) is a legal fallback
    eu_central = ap.model_copy(update={"name": "eu-central", "residency_zone": "eu"})
    home = eu_dead.model_copy(update={"failover": ["us-east", "eu-central"]})
    with FeatureClient("eu-west", [home, us, eu_central], [PROFILE], timeout_s=0.2) as client:
        result = client.get("profile", ["u1"])
        assert result.region == "eu-central"
        assert result.to_dicts() == [{"age_bucket": 3.0, "spend_30d": 12.5}]


def test_breaker_makes_a_dead_region_cost_one_timeout(
    regions: list[RegionSettings], make_writer: Callable[..., FeatureWriter], black_hole: Any
) -> None:
    _seed(regions, make_writer)
    registry = CollectorRegistry()
    with FeatureClient(
        "eu-west",
        _dead_home(regions, black_hole),
        [ITEM],
        timeout_s=0.2,
        breaker_reset_s=60,
        registry=registry,
    ) as client:
        for _ in range(20):
            assert client.get("item", ["sku"]).region == "us-east"
        assert client.breakers["eu-west"].state == "open"

    def failures(reason: str) -> float | None:
        return registry.get_sample_value(
            "edgefeed_lookup_region_failures_total", {"region": "eu-west", "reason": reason}
        )

    assert failures("timeout") == 1
    assert failures("breaker_open") == 19
    assert black_hole.accepted == 1


def test_breaker_probes_and_recovers(
    regions: list[RegionSettings], make_writer: Callable[..., FeatureWriter]
) -> None:
    _seed(regions, make_writer)
    eu = regions[0]
    with FeatureClient("eu-west", regions, [ITEM], timeout_s=0.2, breaker_reset_s=0.05) as client:
        with redis.Redis.from_url(eu.redis_url) as admin:
            admin.execute_command("CLIENT", "PAUSE", "1000", "ALL")  # eu-west stops answering
            try:
                assert client.get("item", ["sku"]).region == "us-east"
                assert client.breakers["eu-west"].state in ("open", "half_open")
            finally:
                admin.execute_command("CLIENT", "UNPAUSE")
        deadline = time.monotonic() + 10
        served = ""
        while time.monotonic() < deadline:
            served = client.get("item", ["sku"]).region
            if served == "eu-west":
                break
            time.sleep(0.01)
        assert served == "eu-west"
        assert client.breakers["eu-west"].state == "closed"


async def test_async_personal_refused_and_shared_fails_over(
    regions: list[RegionSettings], make_writer: Callable[..., FeatureWriter], black_hole: Any
) -> None:
    _seed(regions, make_writer)
    async with AsyncFeatureClient(
        "eu-west", _dead_home(regions, black_hole), [PROFILE, ITEM], timeout_s=0.2
    ) as client:
        with pytest.raises(RegionUnavailableError, match="residency zone 'eu'"):
            await client.get("profile", ["u1"])
        result = await client.get("item", ["sku"])
        assert result.region == "us-east"


def test_unreachable_cluster_region_fails_over(
    regions: list[RegionSettings],
    cluster_region: RegionSettings,
    make_writer: Callable[..., FeatureWriter],
    black_hole: Any,
) -> None:
    """A cluster home region that hangs is a failed read (the client still builds), and
    a healthy cluster serves as a fallback too."""
    _seed(regions, make_writer)
    make_writer(cluster_region, [ITEM]).upsert(
        "item", "sku", {"ctr": 0.25, "price": 1.0}, Position(1), time.time()
    )
    dead = cluster_region.model_copy(
        update={"redis_url": f"redis://127.0.0.1:{black_hole.port}/0", "failover": ["us-east"]}
    )
    with FeatureClient("eu-west", [dead, regions[1]], [ITEM], timeout_s=1.0) as client:
        assert client.get("item", ["sku"]).region == "us-east"
    cluster_backup = cluster_region.model_copy(update={"name": "us-east", "residency_zone": "us"})
    home = regions[0].model_copy(
        update={"redis_url": f"redis://127.0.0.1:{black_hole.port}/0", "failover": ["us-east"]}
    )
    with FeatureClient("eu-west", [home, cluster_backup], [ITEM], timeout_s=1.0) as client:
        result = client.get("item", ["sku"])
        assert result.region == "us-east"
        assert result.to_dicts() == [{"ctr": 0.25, "price": 1.0}]
