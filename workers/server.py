"""The inference server: aiohttp HTTP front, one dynamic batcher and runner per model.

Endpoints:

``POST /v1/models/{name}/infer``
    Body in the model's format; optional ``X-Edgefeed-Deadline-Ms`` budget.
    Answers JSON with the latency terms in ``X-Edgefeed-T-*-Ms`` headers and
    ``Server-Timing``. Errors answer ``{"error": {"type", "message", "retryable"}}``
    with 4xx for bad input, 429/503 plus ``Retry-After`` for backpressure and
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
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import signal
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

try:
    from aiohttp import web
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError("the model workers need aiohttp: pip install 'edgefeed[workers]'") from exc
import numpy as np
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from workers.batcher import BatchingConfig, DynamicBatcher
from workers.connections import ConnectionGuard, GuardedTCPSite
from workers.exceptions import (
    BadRequestError,
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
)
from workers.metrics import WorkerMetrics
from workers.models.base import ServedModel
from workers.runtime import ModelRunner, RuntimeConfig
from workers.timing import HEADER_DEADLINE_MS, ServerTiming

__all__ = ["InferenceServer", "ServerConfig", "run_server"]

log = logging.getLogger(__name__)

_MAX_MESSAGE = 1024


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

    def __post_init__(self) -> None:
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
class _Slot:
    model: ServedModel
    runner: ModelRunner | None = None
    batcher: DynamicBatcher | None = None


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
    """

    def __init__(
        self,
        models: Sequence[ServedModel],
        *,
        runtime: RuntimeConfig | None = None,
        batching: BatchingConfig | None = None,
        config: ServerConfig | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.runtime = runtime or RuntimeConfig()
        self.batching = batching or BatchingConfig()
        self.config = config or ServerConfig()
        self.metrics = (
            WorkerMetrics(self.config.region)
            if registry is None
            else WorkerMetrics(self.config.region, registry)
        )
        region = self.config.region
        self._guard = ConnectionGuard(
            header_timeout_s=self.config.header_timeout_s,
            max_connections=self.config.max_connections,
            on_refused=self.metrics.connections_refused.labels(region).inc,
            on_timeout=self.metrics.slow_clients.labels(region, "header").inc,
            on_open_change=self.metrics.connections.labels(region).set,
        )
        self._slots = {model.name: _Slot(model) for model in models}
        if len(self._slots) != len(models):
            raise ValueError("model names must be distinct")
        self._ready = False
        self._draining = False
        self._stopped = False
        self._runner: web.AppRunner | None = None
        self._site: GuardedTCPSite | None = None
        self._warmup: asyncio.Task[None] | None = None
        self.warmup_ms: dict[str, dict[int, float]] = {}
        self.port = 0

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:41234``."""
        return f"http://{self.config.host}:{self.port}"

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
        app = web.Application(
            client_max_size=self.config.max_payload_bytes, middlewares=[self._guard.middleware]
        )
        app.router.add_post("/v1/models/{model}/infer", self._infer)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def start(self, wait_ready: bool = True) -> None:
        """Listen, then load and warm up the models (readiness turns 200 after)."""
        self._runner = web.AppRunner(
            self.make_app(),
            access_log=None,
            shutdown_timeout=self.config.drain_timeout_s,
            keepalive_timeout=self.config.keepalive_timeout_s,
        )
        await self._runner.setup()
        self._site = GuardedTCPSite(self._runner, self.config.host, self.config.port, self._guard)
        await self._site.start()
        self.port = self._site.port
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
            labels = (self.config.region, name)

            def on_batch(rows: int, seconds: float, labels: tuple[str, str] = labels) -> None:
                self.metrics.batch_rows.labels(*labels).observe(rows)
                self.metrics.forward_seconds.labels(*labels).observe(seconds)

            slot.runner = runner
            slot.batcher = DynamicBatcher(
                runner.execute, self.batching, runner.estimate, on_batch, executor=thread
            )
            slot.batcher.start()
            log.info(
                "model %s ready on %s (%s); warm-up ms per batch size: %s",
                name,
                runner.device,
                runner.precision,
                self.warmup_ms[name],
            )
        self._ready = True
        self.metrics.ready.labels(self.config.region).set(1)

    async def stop(self) -> None:
        """Drain: refuse new requests (503), finish queued ones, close the listener.

        Idempotent: a second call returns at once.
        """
        if self._stopped:
            return
        self._stopped = True
        self._draining = True
        self.metrics.ready.labels(self.config.region).set(0)
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
        for slot in self._slots.values():
            await slot.model.aclose()

    async def __aenter__(self) -> InferenceServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

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
            headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
            body["retry_after_ms"] = round(exc.retry_after_s * 1e3, 3)
        self.metrics.rejected.labels(self.config.region, model, _reason(exc)).inc()
        self.metrics.requests.labels(self.config.region, model, str(exc.http_status)).inc()
        response = web.json_response({"error": body}, status=exc.http_status, headers=headers)
        if isinstance(exc, RequestTimeoutError):
            response.force_close()  # the rest of a late body must not be read as a request
        return response

    async def _infer(self, request: web.Request) -> web.Response:
        start = time.perf_counter()
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
        body = await self._read_body(request)
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
        labels = (self.config.region, slot.model.name)
        self.metrics.queue_depth.labels(*labels).set(slot.batcher.queue_depth + 1)
        remaining = None
        if budget is not None:
            remaining = budget - (time.perf_counter() - start)
        if budget is not None and remaining is not None and remaining <= 0:
            raise DeadlineExceededError(
                f"budget of {budget * 1e3:.1f} ms was spent before queueing "
                f"(decode and feature lookup took {data_s * 1e3:.1f} ms)"
            )
        result = await slot.batcher.submit(prepared.inputs, prepared.rows, remaining)
        self.metrics.queue_depth.labels(*labels).set(slot.batcher.queue_depth)
        text = self._render(slot, prepared, result.output)
        server_s = time.perf_counter() - start
        timing = ServerTiming(
            data_s=data_s,
            model_s=result.model_s,
            service_s=max(0.0, server_s - data_s - result.model_s),
            batch_rows=result.batch_rows,
        )
        for term, value in (
            ("data", timing.data_s),
            ("model", timing.model_s),
            ("service", timing.service_s),
            ("server", server_s),
        ):
            self.metrics.latency.labels(*labels, term).observe(value)
        self.metrics.requests.labels(*labels, "200").inc()
        return web.Response(text=text, content_type="application/json", headers=timing.headers())

    async def _read_body(self, request: web.Request) -> bytes:
        """The request body, within ``body_timeout_s``; a vanished client is told apart."""
        limit = self.config.max_payload_bytes
        timeout = self.config.body_timeout_s
        try:
            async with asyncio.timeout(timeout):
                return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise PayloadTooLargeError(
                f"payload is over the limit of {limit} bytes; preprocess (resize) at the "
                "edge or raise max_payload_bytes"
            ) from None
        except TimeoutError:
            self.metrics.slow_clients.labels(self.config.region, "body").inc()
            raise RequestTimeoutError(
                f"request body did not arrive within {timeout:g} s "
                "(ServerConfig.body_timeout_s); send it at once or raise the timeout"
            ) from None
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            peer = request.remote or "?"
            raise ClientDisconnectedError(
                f"client {peer} disconnected before its request body arrived ({type(exc).__name__})"
            ) from None

    def _render(self, slot: _Slot, prepared: Any, output: np.ndarray) -> str:
        """The answer's JSON; non-finite outputs are counted, then refused or nulled."""
        labels = (self.config.region, slot.model.name)
        if output.dtype.kind in "fc":
            bad = int(np.count_nonzero(~np.isfinite(output)))
            if bad:
                self.metrics.nonfinite_outputs.labels(*labels).inc(bad)
        try:
            # allow_nan=False: a NaN that a model's render lets through is a 500,
            # never an unparseable 200.
            return json.dumps(slot.model.render(prepared, output), allow_nan=False)
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

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _readyz(self, request: web.Request) -> web.Response:
        if self.ready:
            return web.json_response({"ready": True})
        reason = "draining" if self._draining else "warming up"
        return web.json_response(
            {"ready": False, "reason": reason}, status=503, headers={"Retry-After": "1"}
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.metrics.registry),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )


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
