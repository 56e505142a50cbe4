"""Free loopback ports for a local stack started beside others (tests, benchmarks,
the fault suite): each run picks its own, so several can run on one machine."""

from __future__ import annotations

import random
import socket

__all__ = ["free_port", "free_ports"]

# Every port handed out in this process: a stack's settings take a dozen, drawn one
# call at a time before any is bound, and drawn independently two came out equal (a
# site's link and another region's broker; the stack refused the settings).
_GIVEN: set[int] = set()


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int, *, also_free_offset: int | None = None) -> list[int]:
    """Ports free right now, distinct, below the kernel's ephemeral range (32768+), none
    handed out before by this process.

    Args:
        also_free_offset: Also require ``port + offset`` to be free (a Redis
            Cluster node uses its port + 10000 for the cluster bus).
    """
    rng = random.Random()
    if len(_GIVEN) > 6000:  # half the range: those given long ago are bound or let go
        _GIVEN.clear()
    ports: list[int] = []
    while len(ports) < count:
        port = rng.randrange(20000, 32000)
        if port in ports or port in _GIVEN or not _bindable(port):
            continue
        if also_free_offset is not None and not _bindable(port + also_free_offset):
            continue
        ports.append(port)
    _GIVEN.update(ports)
    return ports


def free_port() -> int:
    """One port as :func:`free_ports` gives them."""
    return free_ports(1)[0]
