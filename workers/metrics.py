"""Prometheus metrics of a worker, on a registry of its own (one per server)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["WorkerMetrics"]

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(slots=True)
class WorkerMetrics:
    """The series a worker exports at ``/metrics``.

    ``edgefeed_worker_latency_seconds{model,term}`` carries the latency budget
    terms the server measures: ``data``, ``model``, ``service`` and ``server``
    (their sum); the client adds ``network``.
    """

    region: str
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    latency: Histogram = field(init=False)
    requests: Counter = field(init=False)
    rejected: Counter = field(init=False)
    batch_rows: Histogram = field(init=False)
    forward_seconds: Histogram = field(init=False)
    queue_depth: Gauge = field(init=False)
    ready: Gauge = field(init=False)

    def __post_init__(self) -> None:
        labels = ["region", "model"]
        self.latency = Histogram(
            "edgefeed_worker_latency_seconds",
            "Per-request latency by budget term (data, model, service, server)",
            [*labels, "term"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.requests = Counter(
            "edgefeed_worker_requests",
            "Requests answered, by HTTP status",
            [*labels, "status"],
            registry=self.registry,
        )
        self.rejected = Counter(
            "edgefeed_worker_rejected",
            "Requests refused (queue_full, draining, deadline, bad_input, model_error)",
            [*labels, "reason"],
            registry=self.registry,
        )
        self.batch_rows = Histogram(
            "edgefeed_worker_batch_rows",
            "Rows per forward pass",
            labels,
            buckets=_ROW_BUCKETS,
            registry=self.registry,
        )
        self.forward_seconds = Histogram(
            "edgefeed_worker_forward_seconds",
            "Forward pass time per batch",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "edgefeed_worker_queue_depth",
            "Requests waiting for a batch",
            labels,
            registry=self.registry,
        )
        self.ready = Gauge(
            "edgefeed_worker_ready",
            "1 when the worker accepts requests",
            ["region"],
            registry=self.registry,
        )
