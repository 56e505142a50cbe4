"""The WAN link's arithmetic, without I/O: when does a chunk arrive at the far end.

A chunk read from one side of a link departs once the link's token bucket
holds enough tokens for its bytes (the bandwidth cap), then arrives one-way
delay (plus jitter) later. Arrivals never overtake each other: TCP delivers a
stream in order, so jitter stretches the gaps between chunks but cannot
reorder them. Everything here takes the clock as an argument, so the schedule
is tested without sleeping (tests/unit/edgefeed/test_wan_shaping.py).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from edgefeed.wan.exceptions import LinkSettingError

__all__ = ["DirectionSchedule", "LinkParams", "RateMeter", "TokenBucket"]

_BITS_PER_MBIT = 1_000_000


@dataclass(frozen=True, slots=True)
class LinkParams:
    """What a link does to the bytes that cross it (both directions alike).

    Attributes:
        delay_ms: One-way delay added to every chunk.
        jitter_ms: Each chunk's delay varies uniformly within +/- this much
            (never below zero, never reordering the stream).
        bandwidth_mbit: Cap per direction in megabits per second; None for none.
        burst_bytes: Bytes the bucket may send at once after an idle period.
    """

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    bandwidth_mbit: float | None = None
    burst_bytes: int = 64 * 1024

    def __post_init__(self) -> None:
        if self.delay_ms < 0:
            raise LinkSettingError(f"delay_ms {self.delay_ms} must be 0 or more")
        if self.jitter_ms < 0:
            raise LinkSettingError(f"jitter_ms {self.jitter_ms} must be 0 or more")
        if self.bandwidth_mbit is not None and self.bandwidth_mbit <= 0:
            raise LinkSettingError(
                f"bandwidth_mbit {self.bandwidth_mbit} must be positive (omit it for no cap)"
            )
        if self.burst_bytes < 1:
            raise LinkSettingError(f"burst_bytes {self.burst_bytes} must be at least 1")

    @property
    def bytes_per_s(self) -> float | None:
        return None if self.bandwidth_mbit is None else self.bandwidth_mbit * _BITS_PER_MBIT / 8


class TokenBucket:
    """A token bucket that lends: a chunk bigger than the tokens left departs when
    the bucket would have refilled enough, and later chunks queue behind it.

    Args:
        rate: Tokens (bytes) added per second.
        burst: Most tokens the bucket holds; it starts full.
    """

    def __init__(self, rate: float, burst: float) -> None:
        if rate <= 0 or burst <= 0:
            raise LinkSettingError(
                f"a token bucket needs rate > 0 and burst > 0, got {rate}, {burst}"
            )
        self.rate, self.burst = rate, burst
        self._tokens = burst
        self._at: float | None = None

    def departure(self, size: int, now: float) -> float:
        """Take ``size`` tokens; the time at which the chunk may leave (>= ``now``)."""
        if self._at is not None:
            elapsed = max(0.0, now - self._at)
            self._tokens = min(self.burst, self._tokens + elapsed * self.rate)
        self._at = max(now, self._at or now)
        self._tokens -= size
        if self._tokens >= 0:
            return now
        return now + (-self._tokens) / self.rate


class DirectionSchedule:
    """The arrival times of one direction of one link (shared by its connections,
    since bandwidth belongs to the link, not to a connection).

    Args:
        params: The link's settings; replace them at run time with :meth:`update`.
        rng: Source of jitter (seeded in tests).
    """

    def __init__(self, params: LinkParams, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()
        self.params = params
        self._bucket = self._bucket_for(params)
        self._last_arrival: dict[int, float] = {}

    @staticmethod
    def _bucket_for(params: LinkParams) -> TokenBucket | None:
        rate = params.bytes_per_s
        return None if rate is None else TokenBucket(rate, params.burst_bytes)

    def update(self, params: LinkParams) -> None:
        """New settings; chunks already scheduled keep their arrival times."""
        self.params = params
        self._bucket = self._bucket_for(params)

    def arrival(self, stream: int, size: int, now: float) -> float:
        """When a chunk of ``size`` bytes read now on ``stream`` reaches the far end."""
        departs = now if self._bucket is None else self._bucket.departure(size, now)
        params = self.params
        delay = params.delay_ms
        if params.jitter_ms:
            delay = max(0.0, delay + self._rng.uniform(-params.jitter_ms, params.jitter_ms))
        arrives = max(departs + delay / 1000.0, self._last_arrival.get(stream, 0.0))
        self._last_arrival[stream] = arrives
        return arrives

    def forget(self, stream: int) -> None:
        """A connection closed: drop its ordering record."""
        self._last_arrival.pop(stream, None)


class RateMeter:
    """Bytes per second over the last ``window_s`` seconds, in one-second buckets.

    A link's throughput as a monitor wants it: recent, not an average since the
    start, and zero soon after traffic stops (a cut link shows 0 B/s).

    Args:
        window_s: Whole seconds the rate is averaged over.
    """

    def __init__(self, window_s: int = 5) -> None:
        if window_s < 1:
            raise LinkSettingError(f"rate window {window_s} s must be at least 1")
        self.window_s = window_s
        self._buckets: dict[int, int] = {}

    def add(self, size: int, now: float) -> None:
        second = int(now)
        self._buckets[second] = self._buckets.get(second, 0) + size
        if len(self._buckets) > self.window_s + 2:
            for old in [s for s in self._buckets if s < second - self.window_s]:
                del self._buckets[old]

    def rate(self, now: float) -> float:
        """Bytes per second over the ``window_s`` whole seconds before the current one."""
        current = int(now)
        first = current - self.window_s
        total = sum(size for second, size in self._buckets.items() if first <= second < current)
        return total / self.window_s
