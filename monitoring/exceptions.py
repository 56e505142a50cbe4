"""Errors of the monitoring package. Messages never contain a secret."""

from __future__ import annotations

from edgefeed_base.errors import EdgefeedError

__all__ = [
    "MonitoringConfigError",
    "MonitoringError",
    "SourceUnavailableError",
]


class MonitoringError(EdgefeedError):
    """Base class of the monitoring package's errors."""


class MonitoringConfigError(MonitoringError, ValueError):
    """A monitoring option is out of range (a window shorter than two samples, a
    negative budget, a port outside 0..65535). Not retryable: fix the option."""


class SourceUnavailableError(MonitoringError):
    """A monitored system (the Kafka cluster, a region's Redis, PostgreSQL,
    Kafka Connect) could not be reached or answered with an error. Retryable:
    the next collection round tries again; the report marks the section.

    Attributes:
        source: Which system: ``kafka``, ``redis:<region>``, ``postgres``, ``connect``,
            ``wan`` (the local stack's WAN emulator).
    """

    retryable = True

    def __init__(self, source: str, message: str) -> None:
        super().__init__(f"{source}: {message}")
        self.source = source
