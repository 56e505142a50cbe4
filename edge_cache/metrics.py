"""Prometheus metrics of the lookup client.

The hot path must cost microseconds, so the client does not call
``prometheus_client`` metric objects per request (each ``inc``/``observe`` takes
a lock and walks label dicts): it bumps plain counters in a :class:`LookupStats`,
a custom collector that turns them into the metric families at scrape time.

Nothing registers at import: the composition root hands a client a
``prometheus_client.CollectorRegistry`` and :meth:`LookupStats.of` gives every
client of that registry the same collector (registered once).
"""

from __future__ import annotations

import bisect
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

__all__ = ["BUCKETS", "LookupStats"]

BUCKETS = (
    50e-6,
    100e-6,
    200e-6,
    350e-6,
    500e-6,
    750e-6,
    1e-3,
    1.5e-3,
    2.5e-3,
    5e-3,
    10e-3,
    25e-3,
    50e-3,
    100e-3,
    250e-3,
    1.0,
)
OUTCOMES = ("hit", "miss", "stale")


class _Series:
    __slots__ = ("buckets", "count", "near", "outcomes", "sum")

    def __init__(self) -> None:
        self.buckets = [0] * (len(BUCKETS) + 1)
        self.sum = 0.0
        self.count = 0
        self.outcomes = [0, 0, 0]
        self.near = 0


class LookupStats(Collector):
    """Counters of every lookup client in the process, exposed as:

    * ``edgefeed_lookup_seconds`` (histogram, labels region, entity): call latency,
      failover included.
    * ``edgefeed_lookup_rows_total`` (labels region, entity, outcome): entities by
      outcome: hit (vector served), miss (no vector), stale (older than
      ``max_staleness``, withheld).
    * ``edgefeed_lookup_near_cache_rows_total`` (labels region, entity): entities
      answered by the in-process near cache.
    * ``edgefeed_lookup_fallbacks_total`` (labels region, served_by, entity): calls
      served by a failover region.
    * ``edgefeed_lookup_region_failures_total`` (labels region, reason): timeouts,
      connection errors, and calls that skipped a region whose breaker was open.
    * ``edgefeed_lookup_corrupt_values_total`` (labels region, entity, reason): cached
      values that could not be read (not an edgefeed value, wrong Redis type); each
      such entity reads as missing.
    """

    _by_registry: weakref.WeakKeyDictionary[CollectorRegistry, LookupStats] = (
        weakref.WeakKeyDictionary()
    )
    _class_lock = threading.Lock()

    @classmethod
    def of(cls, registry: CollectorRegistry | None) -> LookupStats:
        """The collector of ``registry`` (created and registered on first use); a
        private, unregistered one when ``registry`` is None."""
        if registry is None:
            return cls()
        with cls._class_lock:
            stats = cls._by_registry.get(registry)
            if stats is None:
                stats = cls._by_registry[registry] = cls()
                registry.register(stats)
            return stats

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.series: dict[tuple[str, str], _Series] = {}
        self.fallbacks: dict[tuple[str, str, str], int] = {}
        self.failures: dict[tuple[str, str], int] = {}
        self.corrupt: dict[tuple[str, str, str], int] = {}

    def lookup(
        self, region: str, entity: str, seconds: float, hit: int, miss: int, stale: int, near: int
    ) -> None:
        with self._lock:
            series = self.series.get((region, entity))
            if series is None:
                series = self.series[(region, entity)] = _Series()
            series.buckets[bisect.bisect_left(BUCKETS, seconds)] += 1
            series.sum += seconds
            series.count += 1
            outcomes = series.outcomes
            outcomes[0] += hit
            outcomes[1] += miss
            outcomes[2] += stale
            series.near += near

    def fallback(self, region: str, served_by: str, entity: str) -> None:
        with self._lock:
            key = (region, served_by, entity)
            self.fallbacks[key] = self.fallbacks.get(key, 0) + 1

    def failure(self, region: str, reason: str) -> None:
        with self._lock:
            self.failures[(region, reason)] = self.failures.get((region, reason), 0) + 1

    def corrupt_value(self, region: str, entity: str, reason: str) -> None:
        with self._lock:
            key = (region, entity, reason)
            self.corrupt[key] = self.corrupt.get(key, 0) + 1

    def failure_count(self, region: str, reason: str) -> int:
        return self.failures.get((region, reason), 0)

    def collect(self) -> Iterator[Any]:
        with self._lock:
            series = {
                k: (list(v.buckets), v.sum, list(v.outcomes), v.near)
                for k, v in self.series.items()
            }
            fallbacks = dict(self.fallbacks)
            failures = dict(self.failures)
            corrupt = dict(self.corrupt)
        latency = HistogramMetricFamily(
            "edgefeed_lookup_seconds",
            "Latency of FeatureClient.get calls, failover included.",
            labels=["region", "entity"],
        )
        rows = CounterMetricFamily(
            "edgefeed_lookup_rows",
            "Entities looked up, by outcome: hit, miss, stale (older than max_staleness).",
            labels=["region", "entity", "outcome"],
        )
        near = CounterMetricFamily(
            "edgefeed_lookup_near_cache_rows",
            "Entities answered by the in-process near cache (found or known absent).",
            labels=["region", "entity"],
        )
        for (region, entity), (buckets, total, outcomes, near_rows) in series.items():
            cumulative, acc = [], 0
            for bound, count in zip((*map(str, BUCKETS), "+Inf"), buckets, strict=True):
                acc += count
                cumulative.append((bound, acc))
            latency.add_metric([region, entity], cumulative, total)
            for outcome, count in zip(OUTCOMES, outcomes, strict=True):
                rows.add_metric([region, entity, outcome], count)
            near.add_metric([region, entity], near_rows)
        fallback = CounterMetricFamily(
            "edgefeed_lookup_fallbacks",
            "Calls served by a failover region instead of the client's home region.",
            labels=["region", "served_by", "entity"],
        )
        for path, count in fallbacks.items():
            fallback.add_metric(list(path), count)
        failure = CounterMetricFamily(
            "edgefeed_lookup_region_failures",
            "Failed reads from a region (timeout, connection) and calls skipped because its "
            "circuit breaker was open (breaker_open).",
            labels=["region", "reason"],
        )
        for reason, count in failures.items():
            failure.add_metric(list(reason), count)
        bad = CounterMetricFamily(
            "edgefeed_lookup_corrupt_values",
            "Cached values that could not be read (reason: format, wrong_type); the entity "
            "reads as missing.",
            labels=["region", "entity", "reason"],
        )
        for labels, count in corrupt.items():
            bad.add_metric(list(labels), count)
        yield from (latency, rows, near, fallback, failure, bad)
