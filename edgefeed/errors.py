"""The root of every edgefeed exception.

This module imports nothing from edgefeed, so the domain packages (connectors,
pipeline, edge_cache, preprocess, workers) may import it without depending on
the composition root. It is the one exception to "domain packages do not import
edgefeed/".
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
