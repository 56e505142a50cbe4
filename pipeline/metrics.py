"""The pipeline's Prometheus metrics, registered in the registry the caller gives.

Nothing registers at import: the composition root (``edgefeed pipeline run``)
passes the registry its metrics endpoint serves, and tests pass a fresh one.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["PipelineMetrics"]

_FRESHNESS_BUCKETS = (
    0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0,
)  # fmt: skip
_RENEWAL_LAG_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0,
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class PipelineMetrics:
    """The metric families of the router and the regional workers."""

    events: Counter
    dead_letters: Counter
    cache_writes: Counter
    batch_size: Histogram
    freshness: Histogram
    batch_seconds: Histogram
    write_seconds: Histogram
    non_finite: Counter
    cache_up: Gauge
    cache_retries: Counter
    cache_refills: Counter
    quarantined: Gauge
    snapshot_rows: Counter
    renewals: Counter
    renewal_lag: Histogram
    history: Gauge
    held: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry) -> PipelineMetrics:
        """Register the families in ``registry``."""
        return cls(
            events=Counter(
                "edgefeed_pipeline_events_total",
                "Events processed",
                ["app", "outcome"],
                registry=registry,
            ),
            dead_letters=Counter(
                "edgefeed_pipeline_dead_letters_total",
                "Events dead-lettered",
                ["app", "reason"],
                registry=registry,
            ),
            cache_writes=Counter(
                "edgefeed_pipeline_cache_writes_total",
                "Vectors written to Redis",
                ["region", "applied"],
                registry=registry,
            ),
            batch_size=Histogram(
                "edgefeed_pipeline_batch_size",
                "Events per batch",
                ["app"],
                buckets=(1, 5, 10, 50, 100, 250, 500, 1000, 5000),
                registry=registry,
            ),
            freshness=Histogram(
                "edgefeed_pipeline_freshness_seconds",
                "Source commit to Redis write, per vector written",
                ["region"],
                buckets=_FRESHNESS_BUCKETS,
                registry=registry,
            ),
            batch_seconds=Histogram(
                "edgefeed_pipeline_batch_seconds",
                "Time to process one batch (state, vectors, Redis write)",
                ["app"],
                registry=registry,
            ),
            write_seconds=Histogram(
                "edgefeed_pipeline_cache_write_seconds",
                "Latency of one pipelined batch write to Redis",
                ["region"],
                registry=registry,
            ),
            non_finite=Counter(
                "edgefeed_pipeline_non_finite_values_total",
                "NaN or infinite values in feature columns, stored as missing",
                ["region"],
                registry=registry,
            ),
            cache_up=Gauge(
                "edgefeed_pipeline_cache_up",
                "1 while the region's cache answers the worker, 0 while it retries",
                ["region"],
                registry=registry,
            ),
            cache_retries=Counter(
                "edgefeed_pipeline_cache_retries_total",
                "Cache writes retried because the cache did not answer",
                ["region"],
                registry=registry,
            ),
            cache_refills=Counter(
                "edgefeed_pipeline_cache_refills_total",
                "Times the worker found its cache empty (data lost) and wrote every vector again",
                ["region"],
                registry=registry,
            ),
            quarantined=Gauge(
                "edgefeed_pipeline_quarantined_entities",
                "Entities whose vectors the cache refuses (writes skipped; see the worker log)",
                ["region"],
                registry=registry,
            ),
            history=Gauge(
                "edgefeed_pipeline_history_state",
                "1 for the state of each windowed table's history at the router (checking, "
                "complete, rebuilding, gap: rows the windows need are not in the stream)",
                ["table", "state"],
                registry=registry,
            ),
            snapshot_rows=Counter(
                "edgefeed_pipeline_snapshot_rows_total",
                "Rows of incremental snapshots (edgefeed connectors snapshot) the router read",
                ["table"],
                registry=registry,
            ),
            renewals=Counter(
                "edgefeed_pipeline_renewals_total",
                "Vectors written again because their schedule ran out (windows read as of "
                "the read time)",
                ["region"],
                registry=registry,
            ),
            renewal_lag=Histogram(
                "edgefeed_pipeline_renewal_lag_seconds",
                "From the end of a vector's schedule to its renewal in the cache: how long "
                "a read could see the schedule's last vector past its time",
                ["region"],
                buckets=_RENEWAL_LAG_BUCKETS,
                registry=registry,
            ),
            held=Counter(
                "edgefeed_pipeline_backpressure_seconds_total",
                "Seconds a regional worker took no message because its changed states, "
                "not yet stored by a checkpoint, filled its memory budget (state_memory_mb)",
                ["region"],
                registry=registry,
            ),
        )
