"""The lookup metrics as Prometheus exposes them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from edge_cache.metrics import LookupStats


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


def test_nothing_registers_at_import_and_a_registry_gets_one_shared_collector() -> None:
    import subprocess
    import sys

    # a fresh interpreter: importing the package leaves the global registry alone
    code = (
        "import edge_cache, edge_cache.client, edge_cache.metrics\n"
        "from prometheus_client import REGISTRY\n"
        "names = {m.name for m in REGISTRY.collect()}\n"
        "print(sorted(n for n in names if n.startswith('edgefeed_lookup')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    assert out.strip() == "[]"

    registry = CollectorRegistry()
    first, second = LookupStats.of(registry), LookupStats.of(registry)
    assert first is second  # two clients of one registry share the collector
    first.failure("eu-west", "timeout")
    assert (
        registry.get_sample_value(
            "edgefeed_lookup_region_failures_total", {"region": "eu-west", "reason": "timeout"}
        )
        == 1
    )
    assert LookupStats.of(None) is not LookupStats.of(None)  # unregistered, private
