"""The inference server: aiohttp HTTP front, one dynamic batcher and runner per model.

Endpoints:

``POST /v1/models/{name}/infer``
    Body in the model's format; optional ``X-Edgefeed-Deadline-Ms`` budget.
    Answers JSON with the latency terms in ``X-Edgefeed-T-*-Ms`` headers and
    ``Server-Timing``. Errors answer ``{"error": {"type", "message", "retryable"}}``
    with 4xx for bad input (401 without the bearer token, when one is configured),
    429/503 plus ``Retry-After`` for backpressure and
    drain, 504 for a budget that cannot be met, 500 for a failed batch.
``GET /v1/models``
    Models, versions, device, precision, batching and counters.
``GET /healthz``
    Liveness: 200 while the process serves HTTP.
``GET /readyz``
    Readiness: 200 once every model is loaded and warmed up, 503 while warming
    up or draining (take the worker out of the load balancer).
``GET /metrics``
    Prometheus exposition.

With a feature log (:mod:`workers.featurelog`), every answer of a model that
reads features carries ``X-Edgefeed-Request-Id`` (the request's own, when it
sent one of at most 128 characters): the key that joins its log row to labels.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import itertools
import json
import logging
import math
import os
import signal
import time
import uuid
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

try:
    from aiohttp import web
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError("the model workers need aiohttp: pip install 'edgefeed[workers]'") from exc
import numpy as np
import orjson
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import SecretStr

from workers.batcher import BatchingConfig, DynamicBatcher
from workers.connections import ConnectionGuard, GuardedTCPSite, quiet_bad_requests
from workers.exceptions import (
    BadRequestError,
    BodyDeadlineError,
    ClientDisconnectedError,
    DeadlineExceededError,
    DrainingError,
    InvalidTensorError,
    ModelExecutionError,
    NonFiniteOutputError,
    OverloadedError,
    PayloadTooLargeError,
    QueueFullError,
    RequestTimeoutError,
    UnknownModelError,
    WorkerConfigError,
    WorkersError,
    retry_after_header,
)
from workers.metrics import WorkerMetrics
from workers.models.base import ServedModel
from workers.runtime import ModelRunner, RuntimeConfig
from workers.security import TokenAuth, server_tls_context
from workers.supervisor import Cluster
from workers.timing import (
    HEADER_DEADLINE_MS,
    HEADER_TIMING_DETAIL,
    SERVICE_PHASES,
    ServerTiming,
)

if TYPE_CHECKING:
    from workers.featurelog import FeatureLogger, FeatureLogSettings

__all__ = [
    "HEADER_REQUEST_ID",
    "EventLoop",
    "InferenceServer",
    "ServerConfig",
    "event_loop_name",
    "loop_factory",
    "run_on_loop",
    "run_server",
]

log = logging.getLogger(__name__)

_MAX_MESSAGE = 1024

#: Request and response header: the request's id in the feature log.
HEADER_REQUEST_ID = "X-Edgefeed-Request-Id"
_MAX_REQUEST_ID = 128


LINGER_S = 1.0  # most time spent reading a refused request's body before closing


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Where and how the server listens.

    Attributes:
        host: Interface to bind.
        port: TCP port (0: any free one; read :attr:`InferenceServer.port`).
        region: Region label of the metrics and answers.
        max_payload_bytes: Largest request body accepted (413 beyond).
        drain_timeout_s: How long shutdown waits for queued requests.
        header_timeout_s: Longest a connection may take to send a request's
            headers, counted from its opening and from the first byte of each
            later request.
        body_timeout_s: Longest a request's body may take to arrive once its
            headers have (408 beyond).
        max_connections: Most client connections open at once; past it a new
            connection is answered 503 with ``Retry-After`` and closed.
        keepalive_timeout_s: How long an idle keep-alive connection stays open
            between requests (aiohttp's own default is an hour).
        balance_connections: As one child of a supervisor (``cluster``), close
            the keep-alive connections this process holds beyond its share of the
            port's, one at a time after their answers, so that their clients
            connect again and spread evenly (:class:`ConnectionGuard`).
        gc_freeze: After warm-up, move every object alive then (torch, the
            models, the libraries: ~200,000 objects) out of the garbage
            collector's reach (``gc.freeze()``). A full collection scanning them
            stalled the event loop for 100-230 ms on the 2-core benchmark machine,
            every request in flight with it; after the freeze it scans only
            what requests allocate.
        auth_token: When set, every request but the probes needs
            ``Authorization: Bearer <token>`` (401 otherwise); see
            :mod:`workers.security`.
        auth_protect_probes: Also require the token on ``/healthz`` and ``/readyz``.
        tls_cert_file: PEM certificate chain: serve HTTPS (with ``tls_key_file``).
        tls_key_file: PEM private key of ``tls_cert_file``.
        reuse_port: Bind with ``SO_REUSEPORT``, beside the other processes of
            one supervisor (:mod:`workers.supervisor`).
    """

    host: str = "127.0.0.1"
    port: int = 0
    region: str = "local"
    max_payload_bytes: int = 8 * 1024 * 1024
    drain_timeout_s: float = 30.0
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 1000
    keepalive_timeout_s: float = 15.0
    balance_connections: bool = True
    gc_freeze: bool = True
    auth_token: SecretStr | None = field(default=None, repr=False)
    auth_protect_probes: bool = False
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    reuse_port: bool = False

    def __post_init__(self) -> None:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise WorkerConfigError(
                "tls_cert_file and tls_key_file go together: give both (HTTPS) or neither"
            )
        for name in (
            "header_timeout_s",
            "body_timeout_s",
            "max_connections",
            "keepalive_timeout_s",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not value > 0:
                raise WorkerConfigError(f"ServerConfig.{name} must be positive, got {value!r}")


@dataclass(slots=True)
class _Series:
    """One model's metric children, looked up once (``labels()`` costs a lock and a
    dict lookup per call, on every request)."""

    data: Any
    model: Any
    service: Any
    server: Any
    phases: dict[str, Any]
    ok: Any
    queue_depth: Any

    @classmethod
    def of(cls, metrics: WorkerMetrics, region: str, model: str) -> _Series:
        latency = metrics.latency
        return cls(
            data=latency.labels(region, model, "data"),
            model=latency.labels(region, model, "model"),
            service=latency.labels(region, model, "service"),
            server=latency.labels(region, model, "server"),
            phases={p: metrics.phase.labels(region, model, p) for p in SERVICE_PHASES},
            ok=metrics.requests.labels(region, model, "200"),
            queue_depth=metrics.queue_depth.labels(region, model),
        )


@dataclass(slots=True)
class _Slot:
    model: ServedModel
    runner: ModelRunner | None = None
    batcher: DynamicBatcher | None = None
    series: _Series | None = None
    log: FeatureLogger | None = None


def _reason(exc: WorkersError) -> str:
    if isinstance(exc, NonFiniteOutputError):
        return "nonfinite_output"
    if isinstance(exc, RequestTimeoutError):
        return "timeout"
    if isinstance(exc, QueueFullError):
        return "queue_full"
    if isinstance(exc, DrainingError):
        return "draining"
    if isinstance(exc, OverloadedError):
        return "not_ready"
    if isinstance(exc, DeadlineExceededError):
        return "deadline"
    if isinstance(exc, ModelExecutionError):
        return "model_error"
    if isinstance(exc, BadRequestError):
        return "bad_input"
    return "error"


class InferenceServer:
    """Serves models over HTTP with dynamic batching.

    Use as an async context manager, or :meth:`start` / :meth:`stop`::

        async with InferenceServer([model], runtime=RuntimeConfig(),
                                   batching=BatchingConfig()) as server:
            print(server.url)

    Args:
        models: The models to serve (distinct names).
        runtime: Device and precision for every model.
        batching: Batching parameters for every model.
        config: Listening address, limits, region.
        registry: Prometheus registry served at ``/metrics`` (the composition root's,
            shared with the model's lookup client); default: a new one.
        cluster: When this server is one child of a
            :class:`~workers.supervisor.Supervisor`: ``/readyz`` is 200 only when
            every child is ready, ``/healthz`` counts them, and ``/metrics`` serves
            the sum over children (prometheus-client's multiprocess mode).
        feature_log: Log what the models that read features were fed, sampled, to
            Parquet (:mod:`workers.featurelog`); None: no log.
    """

    def __init__(
        self,
        models: Sequence[ServedModel],
        *,
        runtime: RuntimeConfig | None = None,
        batching: BatchingConfig | None = None,
        config: ServerConfig | None = None,
        registry: CollectorRegistry | None = None,
        cluster: Cluster | None = None,
        feature_log: FeatureLogSettings | None = None,
    ) -> None:
        self.cluster = cluster
        self.feature_log = feature_log
        self._request_ids = itertools.count()
        self._request_prefix = f"{uuid.uuid4().hex[:12]}-{os.getpid():x}-"
        self._scrape: CollectorRegistry | None = None
        if cluster is not None:
            # The children's series live in the supervisor's directory; the registry
            # the server writes to is not the one a scrape reads (that would count
            # this child twice).
            from prometheus_client import multiprocess

            self._scrape = CollectorRegistry()
            multiprocess.MultiProcessCollector(self._scrape)  # type: ignore[no-untyped-call]
        self.runtime = runtime or RuntimeConfig()
        self.batching = batching or BatchingConfig()
        self.config = config or ServerConfig()
        self.metrics = (
            WorkerMetrics(self.config.region)
            if registry is None
            else WorkerMetrics(self.config.region, registry)
        )
        region = self.config.region
        open_gauge = self.metrics.connections.labels(region)

        def on_open_change(count: int) -> None:
            open_gauge.set(count)
            if cluster is not None:  # every child sees it (Cluster.over_share)
                cluster.set_connections(count)

        over_share = None
        if cluster is not None and self.config.balance_connections:
            over_share = cluster.over_share
        self._guard = ConnectionGuard(
            header_timeout_s=self.config.header_timeout_s,
            max_connections=self.config.max_connections,
            on_refused=self.metrics.connections_refused.labels(region).inc,
            on_timeout=self.metrics.slow_clients.labels(region, "header").inc,
            on_open_change=on_open_change,
            over_share=over_share,
            on_shed=self.metrics.connections_balanced.labels(region).inc,
        )
        self._auth = (
            None
            if self.config.auth_token is None
            else TokenAuth(
                self.config.auth_token,
                protect_probes=self.config.auth_protect_probes,
                on_refused=self.metrics.unauthorized.labels(region).inc,
            )
        )
        self._tls = (
            None
            if self.config.tls_cert_file is None or self.config.tls_key_file is None
            else server_tls_context(self.config.tls_cert_file, self.config.tls_key_file)
        )
        self._slots = {model.name: _Slot(model) for model in models}
        if len(self._slots) != len(models):
            raise ValueError("model names must be distinct")
        if feature_log is not None:
            self._attach_logs(feature_log)
        self._ready = False
        self._draining = False
        self._stopped = False
        self._runner: web.AppRunner | None = None
        self._site: GuardedTCPSite | None = None
        self._warmup: asyncio.Task[None] | None = None
        self._gc_started = 0.0
        # Several processes: GC pauses wait here for the event loop (see _on_gc).
        self._gc_pending: collections.deque[tuple[int, float]] | None = (
            None if cluster is None else collections.deque(maxlen=10_000)
        )
        self._gc_flush: asyncio.TimerHandle | None = None
        self._gc_pauses = [
            self.metrics.gc_pause.labels(self.config.region, str(generation))
            for generation in range(3)
        ]
        self.warmup_ms: dict[str, dict[int, float]] = {}
        self.port = 0

    def _attach_logs(self, settings: FeatureLogSettings) -> None:
        from workers.featurelog import FeatureLogger

        child = 0 if self.cluster is None else self.cluster.index
        for name, slot in self._slots.items():
            layout = slot.model.log_layout()
            if layout is not None:
                slot.log = FeatureLogger(
                    settings,
                    layout,
                    model=name,
                    model_version=slot.model.version,
                    region=self.config.region,
                    child=child,
                    counted=self._feature_log_counter(name),
                )

    def _feature_log_counter(self, model: str) -> Callable[[str, int], None]:
        series = {
            outcome: self.metrics.feature_log.labels(self.config.region, model, outcome)
            for outcome in ("written", "dropped", "lost")
        }
        for counter in series.values():
            counter.inc(0)  # every outcome exported from the start, at 0

        def counted(outcome: str, requests: int) -> None:
            series[outcome].inc(requests)

        return counted

    def feature_logger(self, name: str) -> FeatureLogger | None:
        """The feature log of model ``name`` (None: not logged)."""
        return self._slots[name].log

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:41234`` (``https://`` with TLS)."""
        scheme = "http" if self._tls is None else "https"
        return f"{scheme}://{self.config.host}:{self.port}"

    @property
    def ready(self) -> bool:
        """True once warmed up and until draining starts."""
        return self._ready and not self._draining

    def batcher(self, name: str) -> DynamicBatcher:
        """The batcher of model ``name`` (after warm-up)."""
        batcher = self._slots[name].batcher
        if batcher is None:
            raise RuntimeError(f"model {name!r} is not warmed up yet")
        return batcher

    def make_app(self) -> web.Application:
        """The aiohttp application (routes only; :meth:`start` runs it)."""
        middlewares: list[Any] = [self._guard.middleware]
        if self._auth is not None:
            middlewares.append(self._auth.middleware)
        app = web.Application(
            client_max_size=self.config.max_payload_bytes, middlewares=middlewares
        )
        app.router.add_post("/v1/models/{model}/infer", self._infer)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def start(self, wait_ready: bool = True) -> None:
        """Listen, then load and warm up the models (readiness turns 200 after)."""
        quiet_bad_requests()  # a refused header is one log line, not a traceback
        self._runner = web.AppRunner(
            self.make_app(),
            access_log=None,
            shutdown_timeout=self.config.drain_timeout_s,
            keepalive_timeout=self.config.keepalive_timeout_s,
            # A body the worker refused unread (401, 413) is drained at most this long
            # before the connection closes: long enough for the answer to arrive
            # before the close, not aiohttp's 10 s of reading what nobody wants.
            lingering_time=LINGER_S,
        )
        await self._runner.setup()
        loop = asyncio.get_running_loop()
        for slot in self._slots.values():
            if slot.log is not None:
                slot.log.start(loop)
        self._site = GuardedTCPSite(
            self._runner,
            self.config.host,
            self.config.port,
            self._guard,
            ssl_context=self._tls,
            reuse_port=self.config.reuse_port,
        )
        await self._site.start()
        self.port = self._site.port
        gc.callbacks.append(self._on_gc)  # removed by stop()
        if self._gc_pending is not None:
            self._flush_gc()
        self._warmup = asyncio.get_running_loop().create_task(self._warm_up())
        if wait_ready:
            try:
                await self._warmup
            except BaseException:
                await self.stop()
                raise

    async def _warm_up(self) -> None:
        loop = asyncio.get_running_loop()
        max_rows = self.batching.max_batch_size
        runtime = RuntimeConfig(
            device=self.runtime.device,
            precision=self.runtime.precision,
            compile=self.runtime.compile,
            max_batch_rows=max_rows,
            bucket_sizes=tuple({*self.runtime.bucket_sizes, *self.batching.preferred_batch_sizes}),
            cpu_threads=self.runtime.cpu_threads,
        )
        for name, slot in self._slots.items():
            model = slot.model
            # One thread per model prepares, warms up and runs it (CUDA graphs are per thread).
            thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"edgefeed-{name}")
            try:
                runner = await loop.run_in_executor(thread, ModelRunner, model.module, runtime)
                self.warmup_ms[name] = await loop.run_in_executor(
                    thread, runner.warm_up, model.example_rows
                )
            except BaseException:
                thread.shutdown(wait=False, cancel_futures=True)
                raise
            batch_rows = self.metrics.batch_rows.labels(self.config.region, name)
            forward = self.metrics.forward_seconds.labels(self.config.region, name)

            def on_batch(
                rows: int, seconds: float, batch_rows: Any = batch_rows, forward: Any = forward
            ) -> None:
                batch_rows.observe(rows)
                forward.observe(seconds)

            slot.runner = runner
            slot.series = _Series.of(self.metrics, self.config.region, name)
            if runner.inline_ok:
                # This (the event loop's) thread runs only batches under inline_forward_s:
                # one torch thread, since waking and spinning OpenMP workers for a
                # sub-millisecond forward pass costs more than it saves (their spinning
                # takes the core the event loop needs next).
                runner.apply_threads(1)
                if self.batching.inline_forward_s > 0:
                    # Which batches run here is decided by what they cost here (one
                    # torch thread), not on the model thread (see calibrate_inline).
                    self.warmup_ms[name].update(
                        runner.calibrate_inline(model.example_rows, self.batching.inline_forward_s)
                    )
            slot.batcher = DynamicBatcher(
                runner.execute,
                self.batching,
                runner.estimate,
                on_batch,
                executor=thread,
                inline=runner.inline_ok,
                fastest=runner.fastest,
            )
            slot.batcher.start()
            log.info(
                "model %s ready on %s (%s); warm-up ms per batch size: %s",
                name,
                runner.device,
                runner.precision,
                self.warmup_ms[name],
            )
        if self.config.gc_freeze:
            gc.collect()
            gc.freeze()
        self._ready = True
        self.metrics.ready.labels(self.config.region).set(1)
        if self.cluster is not None:
            self.cluster.mark_ready(True)

    async def stop(self) -> None:
        """Drain: refuse new requests (503), finish queued ones, close the listener.

        Idempotent: a second call returns at once.
        """
        if self._stopped:
            return
        self._stopped = True
        self._draining = True
        self.metrics.ready.labels(self.config.region).set(0)
        if self.cluster is not None:
            self.cluster.mark_ready(False)
        if self._warmup is not None:
            if not self._warmup.done():
                self._warmup.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._warmup  # a warm-up failure was raised by start() already
        for slot in self._slots.values():
            if slot.batcher is not None:
                clean = await slot.batcher.drain(self.config.drain_timeout_s)
                if not clean:
                    log.warning(
                        "model %s: drain timed out; queued requests got 503", slot.model.name
                    )
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._on_gc)
        if self._gc_flush is not None:
            self._gc_flush.cancel()
        for slot in self._slots.values():
            await slot.model.aclose()
            if slot.log is not None:
                slot.log.stop_timer()
                # Off the event loop: closing converts the open file to Parquet.
                await asyncio.to_thread(slot.log.close)

    async def __aenter__(self) -> InferenceServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        # Runs inside the collector, on whichever thread triggered it: no allocation-heavy work.
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_pending is None:
            self._gc_pauses[info["generation"]].observe(time.perf_counter() - self._gc_started)
        else:
            # Multiprocess values share one non-reentrant lock, and a collection can
            # start while it is held (a metric's mmap write allocates): observing here
            # would deadlock. Kept aside, observed by _flush_gc on the event loop.
            self._gc_pending.append((info["generation"], time.perf_counter() - self._gc_started))

    def _flush_gc_now(self) -> None:
        pending = self._gc_pending
        while pending:
            generation, seconds = pending.popleft()
            self._gc_pauses[generation].observe(seconds)

    def _flush_gc(self) -> None:
        self._flush_gc_now()
        if not self._stopped:
            self._gc_flush = asyncio.get_running_loop().call_later(1.0, self._flush_gc)

    # -- handlers ---------------------------------------------------------

    def _error(self, exc: WorkersError, model: str) -> web.Response:
        headers: dict[str, str] = {}
        message = str(exc)
        if len(message) > _MAX_MESSAGE:
            # Messages quote the request (ids, shapes); an answer must not echo megabytes.
            message = f"{message[:_MAX_MESSAGE]}... ({len(message)} characters, clipped)"
        body: dict[str, Any] = {
            "type": type(exc).__name__,
            "message": message,
            "retryable": exc.retryable,
        }
        if isinstance(exc, OverloadedError):
            headers["Retry-After"] = str(retry_after_header(exc.retry_after_s))
            body["retry_after_ms"] = round(exc.retry_after_s * 1e3, 3)
        self.metrics.rejected.labels(self.config.region, model, _reason(exc)).inc()
        self.metrics.requests.labels(self.config.region, model, str(exc.http_status)).inc()
        response = web.json_response({"error": body}, status=exc.http_status, headers=headers)
        if isinstance(exc, RequestTimeoutError | BodyDeadlineError):
            response.force_close()  # the rest of a late body must not be read as a request
        return response

    async def _infer(self, request: web.Request) -> web.Response:
        # T_service counts from the request's first byte: header parsing and the
        # event loop's queue before this handler runs are the server's time too.
        start = self._guard.request_began(request) or time.perf_counter()
        name = request.match_info["model"]
        slot = self._slots.get(name)
        try:
            if slot is None:
                raise UnknownModelError(
                    f"model {name!r} is not served here; served: {', '.join(sorted(self._slots))}"
                )
            if self._draining:
                raise DrainingError("worker is draining for shutdown; retry on another worker")
            if slot.batcher is None:
                raise OverloadedError("worker is warming up; retry shortly", retry_after_s=1.0)
            return await self._serve(request, slot, start)
        except ClientDisconnectedError as exc:
            # Not an error of ours: nobody is left to answer. One line, counted apart.
            model = name if slot is not None else "(unknown)"
            self.metrics.client_aborts.labels(self.config.region, model).inc()
            log.info("model %s: %s", model, exc)
            return web.Response(status=exc.http_status)
        except WorkersError as exc:
            return self._error(exc, name if slot is not None else "(unknown)")
        except Exception as exc:  # a bug must cost one request, not the worker
            log.exception("model %s: unexpected error", name)
            return self._error(
                WorkersError(f"internal error: {type(exc).__name__}: {exc}"),
                name if slot is not None else "(unknown)",
            )

    def _budget(self, request: web.Request) -> float | None:
        raw = request.headers.get(HEADER_DEADLINE_MS)
        if raw is None:
            return None
        try:
            budget_ms = float(raw)
        except ValueError:
            budget_ms = math.nan
        if not math.isfinite(budget_ms) or budget_ms <= 0:
            raise InvalidTensorError(
                f"{HEADER_DEADLINE_MS} {raw!r} must be a positive number of milliseconds"
            )
        return budget_ms / 1e3

    async def _serve(self, request: web.Request, slot: _Slot, start: float) -> web.Response:
        assert slot.batcher is not None
        limit = self.config.max_payload_bytes
        if request.content_length is not None and request.content_length > limit:
            raise PayloadTooLargeError(
                f"payload of {request.content_length} bytes is over the limit of {limit} "
                "bytes; preprocess (resize) at the edge or raise max_payload_bytes"
            )
        budget = self._budget(request)
        handler_start = time.perf_counter()
        # The budget counts from the request's arrival and covers reading its body: a
        # body that trickles in past it is refused (504), not read then refused late.
        body_budget = None if budget is None else budget - (handler_start - start)
        body = await self._read_body(request, body_budget)
        data_start = time.perf_counter()
        try:
            prepared = await slot.model.parse(
                body,
                request.headers.get("Content-Type"),
                request.headers,
                max_rows=self.batching.max_batch_size,
                max_bytes=limit,
            )
        except WorkersError:
            raise
        except Exception as exc:  # a model's parse bug must not take the worker down
            log.exception("model %s: parse failed", slot.model.name)
            raise InvalidTensorError(
                f"request could not be decoded: {type(exc).__name__}: {exc}"
            ) from None
        data_s = time.perf_counter() - data_start
        series = slot.series
        assert series is not None
        series.queue_depth.set(slot.batcher.queue_depth + 1)
        remaining = None
        if budget is not None:
            remaining = budget - (time.perf_counter() - start)
        if budget is not None and remaining is not None and remaining <= 0:
            raise DeadlineExceededError(
                f"budget of {budget * 1e3:.1f} ms was spent before queueing "
                f"(decode and feature lookup took {data_s * 1e3:.1f} ms)"
            )
        result = await slot.batcher.submit(prepared.inputs, prepared.rows, remaining)
        resumed = time.perf_counter()
        series.queue_depth.set(slot.batcher.queue_depth)
        text = self._render(slot, prepared, result.output)
        request_id = None
        if slot.log is not None:
            request_id = self._log(request, slot, prepared, result, start, data_start, data_s)
        end = time.perf_counter()  # after the log: its cost is T_service too
        server_s = end - start
        service_s = max(0.0, server_s - data_s - result.model_s)
        named = {
            "http": handler_start - start,
            "read": data_start - handler_start,
            "queue": result.queue_s,
            "batch": max(0.0, result.run_s - result.model_s),
            "resume": max(0.0, resumed - result.done_at) if result.done_at else 0.0,
            "render": end - resumed,
        }
        named["other"] = max(0.0, service_s - sum(named.values()))
        timing = ServerTiming(
            data_s=data_s,
            model_s=result.model_s,
            service_s=service_s,
            batch_rows=result.batch_rows,
            phases=tuple(named.items()),
        )
        series.data.observe(data_s)
        series.model.observe(result.model_s)
        series.service.observe(service_s)
        series.server.observe(server_s)
        for phase, seconds in named.items():
            series.phases[phase].observe(seconds)
        series.ok.inc()
        detail = request.headers.get(HEADER_TIMING_DETAIL) == "1"
        headers = timing.headers(detail)
        if request_id is not None:
            headers[HEADER_REQUEST_ID] = request_id
        return web.Response(
            body=text,
            content_type="application/json",
            charset="utf-8",
            headers=headers,
        )

    def _log(
        self,
        request: web.Request,
        slot: _Slot,
        prepared: Any,
        result: Any,
        start: float,
        data_start: float,
        data_s: float,
    ) -> str:
        """Offer the request to its model's feature log; its id for the answer."""
        assert slot.log is not None
        request_id = request.headers.get(HEADER_REQUEST_ID)
        if not request_id or len(request_id) > _MAX_REQUEST_ID:
            request_id = f"{self._request_prefix}{next(self._request_ids):x}"
        now = time.perf_counter()
        # The logged T_service stops here: the log's own append (microseconds) is
        # in the answer's T_service only.
        service_s = max(0.0, now - start - data_s - result.model_s)
        read_time = time.time() - (now - data_start)  # the wall clock when the lookup began
        slot.log.offer(
            request_id, read_time, prepared, result.output, data_s, result.model_s, service_s
        )
        return request_id

    async def _read_body(self, request: web.Request, budget_s: float | None = None) -> bytes:
        """The request body, within ``body_timeout_s`` and the request's remaining
        latency budget (``budget_s``); a vanished client is told apart."""
        limit = self.config.max_payload_bytes
        timeout = self.config.body_timeout_s
        limit_s = timeout
        if budget_s is not None and budget_s < timeout:
            limit_s = max(0.0, budget_s)
        by_budget = limit_s != timeout
        try:
            if request.content.is_eof():  # all of it came with the headers: no wait to bound
                return await request.read()
            async with asyncio.timeout(limit_s):
                return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise PayloadTooLargeError(
                f"payload is over the limit of {limit} bytes; preprocess (resize) at the "
                "edge or raise max_payload_bytes"
            ) from None
        except TimeoutError:
            self.metrics.slow_clients.labels(self.config.region, "body").inc()
            if by_budget:
                raise BodyDeadlineError(
                    f"request body did not arrive within the request's budget "
                    f"({request.headers.get(HEADER_DEADLINE_MS)} ms of "
                    f"{HEADER_DEADLINE_MS}); send the body at once or give a larger budget"
                ) from None
            raise RequestTimeoutError(
                f"request body did not arrive within {timeout:g} s "
                "(ServerConfig.body_timeout_s); send it at once or raise the timeout"
            ) from None
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            peer = request.remote or "?"
            raise ClientDisconnectedError(
                f"client {peer} disconnected before its request body arrived ({type(exc).__name__})"
            ) from None

    def _render(self, slot: _Slot, prepared: Any, output: np.ndarray) -> bytes:
        """The answer's JSON; non-finite outputs are counted, then refused or nulled."""
        labels = (self.config.region, slot.model.name)
        bad = 0
        if output.dtype.kind in "fc":
            bad = int(np.count_nonzero(~np.isfinite(output)))
            if bad:
                self.metrics.nonfinite_outputs.labels(*labels).inc(bad)
        try:
            answer = slot.model.render(prepared, output)
            if not bad:
                # orjson: a few times faster than json.dumps for a ranking. It writes
                # a non-finite float as null, so it only serves finite outputs; what
                # it cannot write (numpy scalars, int keys) goes to json.dumps below.
                with contextlib.suppress(TypeError):
                    return orjson.dumps(answer)
            # allow_nan=False: a NaN that a model's render lets through is a 500,
            # never an unparseable 200.
            return json.dumps(answer, allow_nan=False).encode()
        except WorkersError:
            raise
        except ValueError as exc:
            raise NonFiniteOutputError(
                f"model {slot.model.name!r} answered a value JSON cannot carry ({exc})"
            ) from None

    async def _models(self, request: web.Request) -> web.Response:
        models = []
        for slot in self._slots.values():
            entry = slot.model.describe()
            if slot.runner is not None:
                entry["runtime"] = slot.runner.describe()
            if slot.batcher is not None:
                stats = slot.batcher.stats
                entry["batching"] = {
                    "max_batch_size": self.batching.max_batch_size,
                    "preferred_batch_sizes": list(self.batching.preferred_batch_sizes),
                    "max_queue_delay_ms": self.batching.max_queue_delay_s * 1e3,
                    "max_queue_size": self.batching.max_queue_size,
                    "queue_depth": slot.batcher.queue_depth,
                    "batches": stats.batches,
                    "rows": stats.rows,
                    "completed": stats.completed,
                }
            models.append(entry)
        return web.json_response(
            {"region": self.config.region, "ready": self.ready, "models": models}
        )

    def _processes(self) -> dict[str, int]:
        assert self.cluster is not None
        return {"ready": self.cluster.ready_count(), "expected": self.cluster.processes}

    async def _healthz(self, request: web.Request) -> web.Response:
        # Stays 200 while a sibling restarts: the supervisor replaces children, and a
        # liveness failure would have the orchestrator restart all of them.
        if self.cluster is None:
            return web.json_response({"status": "ok"})
        return web.json_response({"status": "ok", "processes": self._processes()})

    async def _readyz(self, request: web.Request) -> web.Response:
        if self.ready and (self.cluster is None or self.cluster.all_ready()):
            if self.cluster is None:
                return web.json_response({"ready": True})
            return web.json_response({"ready": True, "processes": self._processes()})
        body: dict[str, Any] = {"ready": False}
        if self._draining:
            body["reason"] = "draining"
        elif not self.ready:
            body["reason"] = "warming up"
        else:
            counts = self._processes()
            body["reason"] = f"{counts['ready']} of {counts['expected']} worker processes ready"
        if self.cluster is not None:
            body["processes"] = self._processes()
        return web.json_response(body, status=503, headers={"Retry-After": "1"})

    async def _metrics(self, request: web.Request) -> web.Response:
        if self._gc_pending:
            self._flush_gc_now()
        return web.Response(
            body=generate_latest(self._scrape or self.metrics.registry),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )


EventLoop = Literal["auto", "uvloop", "asyncio"]
"""Which event loop serves: see :func:`loop_factory`."""

_T = TypeVar("_T")


def loop_factory(kind: EventLoop = "auto") -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop a worker runs on (None: asyncio's own).

    ``auto`` takes uvloop when it is installed: the worker's event loop is its
    bottleneck under load (HTTP, feature lookups, batching and rendering all run
    on it), and uvloop's libuv loop costs ~10% less CPU per ranking request than
    asyncio's selector loop (docs/benchmarks.md, "Serving overhead"). uvicorn,
    and so LitServe, make the same choice.

    Raises:
        WorkerConfigError: ``uvloop`` was asked for and is not installed.
    """
    if kind == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if kind == "uvloop":
            raise WorkerConfigError(
                "event_loop 'uvloop' is asked for but uvloop is not installed; "
                "pip install 'edgefeed[workers]' (or uvloop), or set event_loop to auto or asyncio"
            ) from None
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def event_loop_name(kind: EventLoop = "auto") -> str:
    """``uvloop`` or ``asyncio``: what :func:`run_on_loop` with ``kind`` runs on."""
    return "asyncio" if loop_factory(kind) is None else "uvloop"


def run_on_loop(main: Coroutine[Any, Any, _T], kind: EventLoop = "auto") -> _T:
    """Run ``main`` to completion on a new event loop of ``kind`` (like ``asyncio.run``).

    Raises:
        WorkerConfigError: see :func:`loop_factory` (``main`` is closed unrun).
    """
    try:
        factory = loop_factory(kind)
    except WorkerConfigError:
        main.close()
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)


async def run_server(server: InferenceServer, on_ready: Any = None) -> None:
    """Run ``server`` until SIGINT/SIGTERM, then drain and stop."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start()
        if on_ready is not None:
            on_ready(server)
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await server.stop()
