"""Errors of the local stack (``edgefeed dev``)."""

from __future__ import annotations

from edgefeed.errors import EdgefeedError

__all__ = [
    "DevStackError",
    "MissingBinaryError",
    "NotLoopbackError",
    "PortInUseError",
    "ServiceStartError",
    "UnsupportedLocallyError",
]


class DevStackError(EdgefeedError):
    """Base class of the local stack's errors."""


class MissingBinaryError(DevStackError):
    """A program the local stack needs is not installed. Not retryable: install it
    (the message names the package; ``make install`` installs all of them)."""


class PortInUseError(DevStackError, ValueError):
    """A configured port is already taken by a process the stack did not start.
    Not retryable: stop that process or change the setting the message names."""


class NotLoopbackError(DevStackError, ValueError):
    """A setting points a local service at an address other than loopback; the
    local stack listens on loopback only. Not retryable: fix the setting."""


class UnsupportedLocallyError(DevStackError, ValueError):
    """The settings ask for something the local stack's services cannot do (Kafka
    SASL or TLS: the local broker, Tansu 0.6.0, cannot serve them). Not
    retryable: run the local stack with ``kafka.security.protocol: PLAINTEXT``, or
    run against a broker that supports it (docker compose runs Apache Kafka)."""


class ServiceStartError(DevStackError):
    """A service did not become healthy before its deadline. Retryable: the
    message names its log file, whose tail it quotes."""

    retryable = True
