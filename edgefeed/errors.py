"""The root of every edgefeed exception, as the composition root names it.

The class lives in :mod:`edgefeed_base.errors` (the bottom layer, which the domain
packages import); this is the same class, so ``except edgefeed.errors.EdgefeedError``
catches every package's errors.
"""

from __future__ import annotations

from edgefeed_base.errors import EdgefeedError

__all__ = ["EdgefeedError"]
