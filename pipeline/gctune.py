"""Keeping CPython's cyclic garbage collector from pausing the stream.

A regional worker holds its entity states in memory: hundreds of thousands of
long-lived containers. CPython's full collections scan every tracked object,
and at 2,000 changes/s on the benchmark machine they paused the worker for
120-270 ms every few seconds (the router, 70-120 ms): most of the p99 freshness.
The objects that survived a while are almost never garbage, so the tuner moves
them out of the collector's sight (``gc.freeze``) once a second, and only every
``full_every_s`` unfreezes everything for one full collection, which reclaims any
reference cycles that were frozen while still reachable and became garbage later.
Reference counting frees everything else as usual.
"""

from __future__ import annotations

import gc
import logging
import time

__all__ = ["GcTuner"]

log = logging.getLogger("edgefeed.pipeline")


class GcTuner:
    """Call ``tick()`` about once a second from the event loop."""

    def __init__(self, full_every_s: float = 600.0) -> None:
        self.full_every_s = full_every_s
        self._last_full = time.monotonic()

    def tick(self) -> None:
        now = time.monotonic()
        if now - self._last_full >= self.full_every_s:
            self._last_full = now
            started = time.perf_counter()
            gc.unfreeze()
            found = gc.collect()
            log.info(
                "full garbage collection: %d unreachable objects, %.0f ms",
                found,
                (time.perf_counter() - started) * 1000,
            )
        else:
            gc.collect(1)  # the young generations: cheap, and cycles made since the last tick
        gc.freeze()
