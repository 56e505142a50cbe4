"""The local stack: real broker, PostgreSQL, Redis and Kafka Connect on loopback, no Docker."""

from __future__ import annotations

from edgefeed.devstack.exceptions import (
    DevStackError,
    MissingBinaryError,
    NotLoopbackError,
    PortInUseError,
    ServiceStartError,
)
from edgefeed.devstack.stack import DevStack, ServiceState, ServiceStatus

__all__ = [
    "DevStack",
    "DevStackError",
    "MissingBinaryError",
    "NotLoopbackError",
    "PortInUseError",
    "ServiceStartError",
    "ServiceState",
    "ServiceStatus",
]
