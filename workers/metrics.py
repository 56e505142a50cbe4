"""Prometheus metrics of a worker.

One rule for the whole project: components take a registry, the composition
root supplies it, nothing registers at import. :class:`WorkerMetrics` registers
its series on the registry it is given (a fresh private one when none is, so
two servers in one process never collide); :class:`~workers.server.InferenceServer`
takes that registry from its caller.

Several worker processes on one port (:mod:`workers.supervisor`) write their
series to the supervisor's multiprocess directory; the gauges say how they add
up there: queue depth and connections sum over living processes, readiness is
their minimum.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["WorkerMetrics"]

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_PHASE_BUCKETS = (
    0.00005,
    0.0001,
    0.0002,
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.5,
)
_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(slots=True)
class WorkerMetrics:
    """The series a worker exports at ``/metrics``.

    ``edgefeed_worker_latency_seconds{model,term}`` carries the latency budget
    terms the server measures: ``data``, ``model``, ``service`` and ``server``
    (their sum); the client adds ``network``.
    ``edgefeed_worker_phase_seconds{model,phase}`` breaks ``service`` down by
    phase (:data:`workers.timing.SERVICE_PHASES`).
    """

    region: str
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    latency: Histogram = field(init=False)
    phase: Histogram = field(init=False)
    gc_pause: Histogram = field(init=False)
    requests: Counter = field(init=False)
    rejected: Counter = field(init=False)
    batch_rows: Histogram = field(init=False)
    feature_log: Counter = field(init=False)
    forward_seconds: Histogram = field(init=False)
    queue_depth: Gauge = field(init=False)
    ready: Gauge = field(init=False)
    nonfinite_outputs: Counter = field(init=False)
    client_aborts: Counter = field(init=False)
    slow_clients: Counter = field(init=False)
    connections: Gauge = field(init=False)
    connections_refused: Counter = field(init=False)
    connections_balanced: Counter = field(init=False)
    unauthorized: Counter = field(init=False)

    def __post_init__(self) -> None:
        labels = ["region", "model"]
        self.latency = Histogram(
            "edgefeed_worker_latency_seconds",
            "Per-request latency by budget term (data, model, service, server)",
            [*labels, "term"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.phase = Histogram(
            "edgefeed_worker_phase_seconds",
            "T_service by phase: http, read, queue, batch, resume, render, other",
            [*labels, "phase"],
            buckets=_PHASE_BUCKETS,
            registry=self.registry,
        )
        self.gc_pause = Histogram(
            "edgefeed_worker_gc_pause_seconds",
            "Garbage collector pauses of the worker process, by generation (they stall "
            "the event loop and every request in flight)",
            ["region", "generation"],
            buckets=_PHASE_BUCKETS,
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
            multiprocess_mode="livesum",
        )
        self.ready = Gauge(
            "edgefeed_worker_ready",
            "1 when the worker accepts requests (several processes: all of them)",
            ["region"],
            registry=self.registry,
            multiprocess_mode="livemin",
        )
        self.nonfinite_outputs = Counter(
            "edgefeed_worker_nonfinite_outputs",
            "NaN or infinite values in model outputs (answered as 500, or null scores)",
            labels,
            registry=self.registry,
        )
        self.client_aborts = Counter(
            "edgefeed_worker_client_aborts",
            "Requests whose client disconnected before its body arrived (not errors)",
            labels,
            registry=self.registry,
        )
        self.slow_clients = Counter(
            "edgefeed_worker_slow_clients",
            "Connections closed for sending headers or body too slowly, by phase",
            ["region", "phase"],
            registry=self.registry,
        )
        self.connections = Gauge(
            "edgefeed_worker_connections",
            "Open client connections",
            ["region"],
            registry=self.registry,
            multiprocess_mode="livesum",
        )
        self.connections_refused = Counter(
            "edgefeed_worker_connections_refused",
            "Connections refused (503) because max_connections were open",
            ["region"],
            registry=self.registry,
        )
        self.connections_balanced = Counter(
            "edgefeed_worker_connections_balanced",
            "Keep-alive connections closed after their answer because this process "
            "held more than its share of the port's (--processes > 1)",
            ["region"],
            registry=self.registry,
        )
        self.feature_log = Counter(
            "edgefeed_worker_feature_log_requests",
            "Sampled requests of the feature log by outcome: written (to its open file), "
            "dropped (the writer was behind) or lost (a write failed, e.g. a full disk)",
            ["region", "model", "outcome"],
            registry=self.registry,
        )
        self.unauthorized = Counter(
            "edgefeed_worker_unauthorized",
            "Requests refused (401) for a missing or wrong bearer token",
            ["region"],
            registry=self.registry,
        )
