"""The one closed-loop HTTP client every server in benchmarks/peers/serving.py is driven by.

``concurrency`` clients share one aiohttp session (keep-alive, no connection
limit); each sends a request, reads the whole answer and sends the next, until
the window's deadline. T_total is measured here, client-side: from just before
the request is written to the last byte of the answer. Payloads are prepared
before the window starts, so encoding them costs the window nothing; the
per-server wire formats live in serving.py, not here.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp
import numpy as np

__all__ = ["Request", "Window", "closed_loop", "merge", "summarize"]


@dataclass(frozen=True, slots=True)
class Request:
    """One prepared request: path, body and headers, in a server's wire format."""

    path: str
    body: bytes
    headers: dict[str, str]


@dataclass(slots=True)
class Window:
    """What one measured window saw.

    Attributes:
        concurrency: Clients in the loop.
        elapsed_s: Wall time from the first send to the last answer.
        latencies_s: T_total of every successful request.
        errors: Failed requests by kind (``http-503``, ``ClientOSError``...).
        headers: Answer headers kept by ``keep_headers`` (one dict per success).
    """

    concurrency: int
    elapsed_s: float
    latencies_s: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    headers: list[dict[str, str]] = field(default_factory=list)


async def closed_loop(
    session: aiohttp.ClientSession,
    base_url: str,
    requests: Sequence[Request],
    *,
    concurrency: int,
    duration_s: float,
    keep_headers: Callable[[str], bool] | None = None,
) -> Window:
    """Run ``concurrency`` closed-loop clients for ``duration_s`` over ``requests`` (cycled).

    A request that has started when the deadline passes is finished and counted;
    no new one starts after it.
    """
    if concurrency < 1 or not requests:
        raise ValueError("closed_loop needs concurrency >= 1 and at least one request")
    window = Window(concurrency, 0.0)
    position = 0
    start = time.perf_counter()
    deadline = start + duration_s

    async def client() -> None:
        nonlocal position
        while time.perf_counter() < deadline:
            request = requests[position % len(requests)]
            position += 1
            sent = time.perf_counter()
            try:
                async with session.post(
                    base_url + request.path, data=request.body, headers=request.headers
                ) as response:
                    await response.read()
                    status = response.status
                    kept = (
                        {k: v for k, v in response.headers.items() if keep_headers(k)}
                        if keep_headers is not None and status == 200
                        else None
                    )
            except (aiohttp.ClientError, TimeoutError) as exc:
                window.errors[type(exc).__name__] += 1
                continue
            if status != 200:
                window.errors[f"http-{status}"] += 1
                continue
            window.latencies_s.append(time.perf_counter() - sent)
            if kept is not None:
                window.headers.append(kept)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    window.elapsed_s = time.perf_counter() - start
    return window


def merge(windows: Sequence[Window]) -> Window:
    """One result from windows measured at different times (rounds of the same cell)."""
    merged = Window(windows[0].concurrency, sum(w.elapsed_s for w in windows))
    for w in windows:
        merged.latencies_s += w.latencies_s
        merged.errors.update(w.errors)
        merged.headers += w.headers
    return merged


def summarize(window: Window) -> dict[str, object]:
    """Throughput and T_total p50/p95/p99 in ms (JSON-friendly)."""
    values = np.asarray(window.latencies_s) * 1e3
    percentiles = {
        f"p{q}": round(float(np.percentile(values, q)), 3) if values.size else None
        for q in (50, 95, 99)
    }
    return {
        "concurrency": window.concurrency,
        "requests": int(values.size),
        "errors": dict(window.errors),
        "elapsed_s": round(window.elapsed_s, 3),
        "throughput_rps": round(values.size / window.elapsed_s, 2) if window.elapsed_s else 0.0,
        "t_total_ms": percentiles,
    }
