"""Prometheus metrics of the lookup client (registered once per process)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

__all__ = ["FALLBACKS", "LOOKUP_ROWS", "LOOKUP_SECONDS", "NEAR_ROWS", "REGION_FAILURES"]

LOOKUP_SECONDS = Histogram(
    "edgefeed_lookup_seconds",
    "Latency of FeatureClient.get calls, including failover.",
    ["region", "entity"],
    buckets=(
        50e-6, 100e-6, 200e-6, 350e-6, 500e-6, 750e-6, 1e-3, 1.5e-3, 2.5e-3, 5e-3, 10e-3,
        25e-3, 50e-3, 100e-3, 250e-3, 1.0,
    ),
)
LOOKUP_ROWS = Counter(
    "edgefeed_lookup_rows",
    "Entities looked up, by outcome: hit (vector served), miss (no vector), stale (vector "
    "older than max_staleness, withheld).",
    ["region", "entity", "outcome"],
)
NEAR_ROWS = Counter(
    "edgefeed_lookup_near_cache_rows",
    "Entities answered from the in-process near cache (found or known absent) instead of Redis.",
    ["region", "entity"],
)
FALLBACKS = Counter(
    "edgefeed_lookup_fallbacks",
    "Calls served by a failover region instead of the client's home region.",
    ["region", "served_by", "entity"],
)
REGION_FAILURES = Counter(
    "edgefeed_lookup_region_failures",
    "Failed reads from a region (timeout or connection error), and calls skipped because "
    "its circuit breaker was open.",
    ["region", "reason"],
)
