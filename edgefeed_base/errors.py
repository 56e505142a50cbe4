"""The root of every edgefeed exception.

Every package's ``exceptions.py`` subclasses :class:`EdgefeedError`, so a caller's
``except EdgefeedError`` catches them all; ``edgefeed.errors`` re-exports it for
callers of the composition root. This module imports nothing of the project.
"""

from __future__ import annotations

__all__ = ["EdgefeedError"]


class EdgefeedError(Exception):
    """Base class of every error edgefeed raises on purpose.

    Attributes:
        retryable: True when the same call may succeed later without any change
            (a service still starting, a rebalance in progress); False when the
            input or the environment must be fixed first.
    """

    retryable: bool = False
