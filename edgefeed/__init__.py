"""edgefeed: the composition root (CLI, settings loading, local stack).

Kept import-light on purpose: ``edgefeed --help`` imports this package, and
the domain packages import nothing of it (their root error lives in
:mod:`edgefeed_base`).
"""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
