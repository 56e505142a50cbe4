"""edgefeed_base: the bottom layer that every edgefeed package may import.

It holds only what every package must share and imports nothing of the project,
so depending on it never creates a cycle nor an arrow up to the composition
root (``edgefeed/``). Today that is the root error, :class:`EdgefeedError`.
"""

from __future__ import annotations

from edgefeed_base.errors import EdgefeedError

__all__ = ["EdgefeedError"]
