"""edgefeed: the composition root (CLI, settings loading, local stack).

Kept import-light on purpose: domain packages import :mod:`edgefeed.errors`,
which must not pull in the CLI, pydantic models or the local stack.
"""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
