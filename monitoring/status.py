"""Consumer status from the offset history over a window, in the manner of Burrow.

Burrow (LinkedIn's consumer lag checker) judges a consumer by how its committed
offset and its lag moved over a window of observations, not by a fixed lag
threshold: a busy topic may always carry a lag of thousands and be healthy,
while a lag of 3 that never moves means a stuck consumer. The rules, per
partition, over the window (oldest first):

1. The current lag is 0: ``OK``.
2. The group has no live member but the partition has lag: ``STOP`` (Burrow
   infers this from commit timestamps; Kafka's OffsetFetch does not return
   them, so the group's membership from DescribeGroups stands in for them).
3. The lag was 0 somewhere in the window: ``OK`` (the consumer caught up).
4. The committed offset went backwards: ``REWIND``.
5. The committed offset never moved while there was lag: ``STALL``.
6. The offset moved but the lag never went down: ``WARN`` (falling behind).
7. Otherwise ``OK``.

A window needs at least two observations before rules 4-6 can apply. The
group's status is its worst partition's; its severity, as Burrow's group
status, is ``OK``, ``WARN`` or ``ERR`` (``STOP``, ``STALL`` and ``REWIND``).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from monitoring.exceptions import MonitoringConfigError

__all__ = [
    "SEVERITY_OF",
    "STATUS_CODES",
    "Observation",
    "OffsetHistory",
    "PartitionStatus",
    "Severity",
    "evaluate_partition",
    "worst",
]

PartitionStatus = Literal["NOTFOUND", "OK", "WARN", "STOP", "STALL", "REWIND"]
Severity = Literal["OK", "WARN", "ERR"]

#: Burrow's numeric order: the larger, the worse. Exported as metric values.
STATUS_CODES: dict[PartitionStatus, int] = {
    "NOTFOUND": 0,
    "OK": 1,
    "WARN": 2,
    "STOP": 4,
    "STALL": 5,
    "REWIND": 6,
}
SEVERITY_OF: dict[PartitionStatus, Severity] = {
    "NOTFOUND": "WARN",
    "OK": "OK",
    "WARN": "WARN",
    "STOP": "ERR",
    "STALL": "ERR",
    "REWIND": "ERR",
}
_SEVERITY_ORDER: dict[Severity, int] = {"OK": 0, "WARN": 1, "ERR": 2}


@dataclass(frozen=True, slots=True)
class Observation:
    """One look at a partition of a group: when, the committed offset, the lag."""

    at: float
    offset: int
    lag: int


def evaluate_partition(
    window: Sequence[Observation],
    *,
    current_lag: int | None,
    has_members: bool,
    min_span_s: float = 0.0,
) -> tuple[PartitionStatus, str]:
    """Burrow's rules (see the module docstring) applied to one partition.

    Args:
        window: Observations, oldest first, the newest being the current one.
        current_lag: The lag now; None when the group has no committed offset.
        has_members: Whether the group has a live member.
        min_span_s: The window must cover at least this long before the
            movement rules apply.

    Returns:
        The status and a one-line reason a person can act on.
    """
    if current_lag is None or not window:
        return "NOTFOUND", "no committed offset"
    if current_lag == 0:
        return "OK", "caught up"
    if not has_members:
        return "STOP", f"no live consumer in the group and {current_lag} message(s) waiting"
    if len(window) < 2 or window[-1].at - window[0].at < min_span_s:
        return "OK", "window incomplete"
    if any(o.lag == 0 for o in window):
        return "OK", "caught up within the window"
    pairs = list(itertools.pairwise(window))
    if any(b.offset < a.offset for a, b in pairs):
        return "REWIND", "committed offset moved backwards within the window"
    first, last = window[0], window[-1]
    if all(b.offset == a.offset for a, b in pairs):
        return "STALL", (
            f"committed offset stuck at {last.offset} for {last.at - first.at:.1f}s "
            f"while lag went {first.lag} -> {last.lag}"
        )
    if all(b.lag >= a.lag for a, b in pairs):
        return "WARN", (
            f"consuming but lag not decreasing ({first.lag} -> {last.lag}) "
            f"over {last.at - first.at:.1f}s"
        )
    return "OK", "lag decreasing"


def worst(statuses: Iterable[PartitionStatus]) -> PartitionStatus:
    """The worst of ``statuses`` in Burrow's order (``NOTFOUND`` for none)."""
    result: PartitionStatus = "NOTFOUND"
    seen = False
    for status in statuses:
        if not seen or STATUS_CODES[status] > STATUS_CODES[result]:
            result = status
        seen = True
    return result


def worst_severity(severities: Iterable[Severity]) -> Severity:
    """The worst of ``severities`` (``OK`` for none)."""
    result: Severity = "OK"
    for severity in severities:
        if _SEVERITY_ORDER[severity] > _SEVERITY_ORDER[result]:
            result = severity
    return result


class Series:
    """The last ``window`` ``(time, value)`` points of one counter, with the same
    merging of close points as :class:`OffsetHistory`, for rates over the window."""

    def __init__(self, window: int, min_interval_s: float = 0.0) -> None:
        self.min_interval_s = min_interval_s
        self._points: deque[tuple[float, int]] = deque(maxlen=window)

    def add(self, at: float, value: int) -> None:
        points = self._points
        if len(points) > 1 and at - points[-2][0] < self.min_interval_s:
            points[-1] = (at, value)
        else:
            points.append((at, value))

    def increase(self) -> int:
        """How much the value grew over the window (0 for fewer than two points)."""
        if len(self._points) < 2:
            return 0
        return max(self._points[-1][1] - self._points[0][1], 0)

    def rate(self) -> float | None:
        """Growth per second over the window; None until two points span some time."""
        if len(self._points) < 2:
            return None
        (t0, _), (t1, _) = self._points[0], self._points[-1]
        return self.increase() / (t1 - t0) if t1 > t0 else None


class OffsetHistory:
    """The last ``window`` observations of every (group, topic, partition).

    Args:
        window: How many observations the rules look at (Burrow's ``intervals``,
            10 by default there too).
        max_age_s: Observations older than this are forgotten, so a restart of
            the collection after a long gap does not judge on stale data.
        min_interval_s: An observation closer than this to the one before the
            last replaces the last (Burrow's ``min-distance``).
    """

    def __init__(
        self, window: int = 10, max_age_s: float = 600.0, min_interval_s: float = 0.0
    ) -> None:
        if window < 2:
            raise MonitoringConfigError(
                f"window {window} is too short: the rules compare at least 2 observations"
            )
        if max_age_s <= 0:
            raise MonitoringConfigError(f"max_age_s {max_age_s} must be positive")
        self.window = window
        self.max_age_s = max_age_s
        self.min_interval_s = min_interval_s
        self._data: dict[tuple[str, str, int], deque[Observation]] = {}

    def add(self, group: str, topic: str, partition: int, observation: Observation) -> None:
        key = (group, topic, partition)
        history = self._data.get(key)
        if history is None:
            history = self._data[key] = deque(maxlen=self.window)
        if len(history) > 1 and observation.at - history[-2].at < self.min_interval_s:
            history[-1] = observation
            return
        history.append(observation)

    def window_of(self, group: str, topic: str, partition: int, now: float) -> list[Observation]:
        """The observations within ``max_age_s`` of ``now``, oldest first."""
        history = self._data.get((group, topic, partition), ())
        return [o for o in history if now - o.at <= self.max_age_s]

    def forget_except(self, keys: Iterable[tuple[str, str, int]]) -> None:
        """Drop partitions no longer seen (a deleted group or topic)."""
        keep = set(keys)
        for key in list(self._data):
            if key not in keep:
                del self._data[key]
