"""The per-region Redis edge cache: key layout, writer and the feature lookup client."""

from __future__ import annotations

from edge_cache.settings import RegionSettings

__all__ = ["RegionSettings"]
