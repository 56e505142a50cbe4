"""A small circuit breaker per region, so a dead region costs one timeout, not one per call."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Literal

__all__ = ["BreakerState", "CircuitBreaker"]

BreakerState = Literal["closed", "open", "half_open"]


class CircuitBreaker:
    """Closed -> open after ``failure_threshold`` consecutive failures; after
    ``reset_timeout_s`` one probe call is let through (half-open): its success
    closes the breaker, its failure opens it again. Thread-safe.

    Args:
        failure_threshold: Consecutive failures that open the breaker.
        reset_timeout_s: How long the breaker stays open before a probe.
        clock: Monotonic clock (injectable for tests).
    """

    def __init__(
        self,
        *,
        failure_threshold: int = 1,
        reset_timeout_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failure_threshold < 1 or reset_timeout_s <= 0:
            raise ValueError("failure_threshold must be >= 1 and reset_timeout_s > 0")
        self.failure_threshold = failure_threshold
        self.reset_timeout_s = reset_timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._opened_at: float | None = None
        self._probe_since: float | None = None

    @property
    def state(self) -> BreakerState:
        with self._lock:
            if self._opened_at is None:
                return "closed"
            if self._clock() - self._opened_at >= self.reset_timeout_s:
                return "half_open"
            return "open"

    def allow(self) -> bool:
        """May a call go to the region now? In half-open state only one probe may."""
        if self._opened_at is None:  # fast path, no lock: the common case
            return True
        with self._lock:
            opened: float | None = self._opened_at  # re-read: another thread may have closed it
            if opened is None:
                return True
            now = self._clock()
            if now - opened < self.reset_timeout_s:
                return False
            if self._probe_since is not None and now - self._probe_since < self.reset_timeout_s:
                return False  # a probe is in flight
            self._probe_since = now
            return True

    def success(self) -> None:
        """Report a successful call: closes the breaker."""
        if self._opened_at is None and self._failures == 0:
            return
        with self._lock:
            self._failures = 0
            self._opened_at = None
            self._probe_since = None

    def failure(self) -> None:
        """Report a failed call (timeout, connection error)."""
        with self._lock:
            self._failures += 1
            self._probe_since = None
            if self._opened_at is not None or self._failures >= self.failure_threshold:
                self._opened_at = self._clock()
