"""The lookup metrics as Prometheus exposes them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from edge_cache.metrics import STATS, LookupStats


def test_collector_exposes_every_family() -> None:
    stats = LookupStats()
    registry = CollectorRegistry()
    registry.register(stats)
    stats.lookup("eu-west", "user", 0.0004, hit=3, miss=1, stale=1, near=2)
    stats.lookup("eu-west", "user", 0.002, hit=1, miss=0, stale=0, near=0)
    stats.fallback("eu-west", "us-east", "item")
    stats.failure("eu-west", "timeout")
    stats.failure("eu-west", "breaker_open")
    stats.failure("eu-west", "breaker_open")

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert value("edgefeed_lookup_seconds_count", region="eu-west", entity="user") == 2
    assert (
        value("edgefeed_lookup_seconds_bucket", region="eu-west", entity="user", le="0.0005") == 1
    )
    assert value("edgefeed_lookup_seconds_bucket", region="eu-west", entity="user", le="+Inf") == 2
    assert value("edgefeed_lookup_seconds_sum", region="eu-west", entity="user") == 0.0004 + 0.002
    for outcome, expected in (("hit", 4), ("miss", 1), ("stale", 1)):
        labels = {"region": "eu-west", "entity": "user", "outcome": outcome}
        assert value("edgefeed_lookup_rows_total", **labels) == expected
    assert value("edgefeed_lookup_near_cache_rows_total", region="eu-west", entity="user") == 2
    assert (
        value(
            "edgefeed_lookup_fallbacks_total", region="eu-west", served_by="us-east", entity="item"
        )
        == 1
    )
    assert (
        value("edgefeed_lookup_region_failures_total", region="eu-west", reason="breaker_open") == 2
    )
    assert b"# TYPE edgefeed_lookup_seconds histogram" in generate_latest(registry)


def test_process_collector_is_on_the_default_registry() -> None:
    from prometheus_client import REGISTRY

    STATS.failure("unit-test-region", "timeout")
    assert (
        REGISTRY.get_sample_value(
            "edgefeed_lookup_region_failures_total",
            {"region": "unit-test-region", "reason": "timeout"},
        )
        is not None
    )
