"""Closed-loop load generation and the latency-budget table.

``concurrency`` clients each send a request, wait for the answer, and send the
next (a closed loop, as in Triton's perf_analyzer): throughput and latency
then reflect what the worker sustains, not what the generator offers. With a
``rate``, the same clients are paced: request ``n`` goes no earlier than
``n / rate`` seconds after the start, so latency can be read below saturation
too (still at most ``concurrency`` in flight).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from workers.client import InferenceAnswer, WorkerClient
from workers.exceptions import WorkerResponseError
from workers.timing import LatencyBreakdown

__all__ = ["TERMS", "LoadResult", "closed_loop", "latency_table"]

TERMS = ("network", "data", "model", "service", "total")
RequestMaker = Callable[[WorkerClient, int], Awaitable[InferenceAnswer]]


@dataclass(frozen=True, slots=True)
class LoadResult:
    """What one closed-loop run measured.

    Attributes:
        concurrency: Clients in the loop.
        elapsed_s: Wall time of the measured phase.
        latencies: One breakdown per successful request.
        batch_rows: Batch rows each successful request rode in.
        errors: Failed requests by server error type.
        details: T_service by phase (ms) of each successful request whose
            answer carried it.
    """

    concurrency: int
    elapsed_s: float
    latencies: tuple[LatencyBreakdown, ...]
    batch_rows: tuple[int, ...]
    errors: dict[str, int] = field(default_factory=dict)
    details: tuple[Mapping[str, float], ...] = ()

    @property
    def throughput(self) -> float:
        """Successful requests per second."""
        return len(self.latencies) / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def values_ms(self, term: str) -> np.ndarray:
        """One term (``network`` ... ``total``) of every request, in ms."""
        attribute = "total_s" if term == "total" else f"{term}_s"
        return np.array([getattr(item, attribute) for item in self.latencies]) * 1e3

    def percentile_ms(self, term: str, q: float) -> float:
        """The ``q``-th percentile of ``term`` in ms (NaN without successes)."""
        values = self.values_ms(term)
        return float(np.percentile(values, q)) if values.size else float("nan")

    def summary(self) -> dict[str, object]:
        """Throughput, mean batch and p50/p95/p99 of every term (JSON-friendly)."""
        return {
            "concurrency": self.concurrency,
            "requests": len(self.latencies),
            "errors": dict(self.errors),
            "throughput_rps": round(self.throughput, 2),
            "mean_batch_rows": round(float(np.mean(self.batch_rows)), 2)
            if self.batch_rows
            else 0.0,
            "latency_ms": {
                term: {f"p{q}": round(self.percentile_ms(term, q), 3) for q in (50, 95, 99)}
                for term in TERMS
            },
        }


async def closed_loop(
    client: WorkerClient,
    make_request: RequestMaker,
    *,
    concurrency: int,
    requests: int,
    warmup_requests: int = 0,
    rate: float | None = None,
) -> LoadResult:
    """Run ``requests`` requests from ``concurrency`` closed-loop clients.

    ``make_request(client, n)`` sends request number ``n``. Warm-up requests
    run first and are not measured. ``rate`` (requests/s; None: as fast as
    answers come) paces the clients: request ``n`` waits for its slot,
    ``n / rate`` seconds after the measured phase began. A worker slower than
    ``rate`` makes it a plain closed loop again.

    Raises:
        ValueError: ``rate`` is not a positive number.
    """
    if rate is not None and not rate > 0:
        raise ValueError(f"rate {rate!r} must be a positive number of requests per second")
    if warmup_requests:
        # Not measured: a failed warm-up request (a busy machine's timeout) must not end the run.
        await asyncio.gather(
            *(make_request(client, -1 - i) for i in range(warmup_requests)),
            return_exceptions=True,
        )
    counter = iter(range(requests))
    latencies: list[LatencyBreakdown] = []
    rows: list[int] = []
    details: list[Mapping[str, float]] = []
    errors: Counter[str] = Counter()

    async def loop() -> None:
        for n in counter:
            if rate is not None:
                wait = start + n / rate - time.perf_counter()
                if wait > 0:
                    await asyncio.sleep(wait)
            try:
                answer = await make_request(client, n)
            except WorkerResponseError as exc:
                errors[exc.error_type] += 1
                continue
            latencies.append(answer.latency)
            rows.append(answer.batch_rows)
            if answer.phases_ms:
                details.append(answer.phases_ms)

    start = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    return LoadResult(
        concurrency, elapsed, tuple(latencies), tuple(rows), dict(errors), tuple(details)
    )


def latency_table(result: LoadResult) -> list[tuple[str, float, float, float]]:
    """Rows ``(term, p50 ms, p95 ms, p99 ms)`` for T_network ... T_total."""
    return [
        (
            term,
            result.percentile_ms(term, 50),
            result.percentile_ms(term, 95),
            result.percentile_ms(term, 99),
        )
        for term in TERMS
    ]
