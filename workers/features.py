"""Feature lookup for models that read the region's edge cache (the ranking model).

The ranking model sees features only through :class:`FeatureSource`: an async
``get(entity, ids, features)`` returning a float32 matrix (rows = ids, columns =
features, NaN where missing) and a boolean mask of the missing cells.

:class:`EdgeCacheFeatureSource` is the production implementation: it wraps
:class:`edge_cache.AsyncFeatureClient` (one ``MGET`` per lookup, failover to
the region's fallbacks within the entity's residency zone, circuit breakers)
and turns the edge cache's errors into worker errors.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

import numpy as np

from edge_cache import (
    AsyncFeatureClient,
    EdgeCacheError,
    PoolExhaustedError,
    RegionUnavailableError,
    SchemaVersionError,
    UnknownEntityError,
    UnknownFeatureError,
)
from workers.exceptions import FeatureLookupError, QueueFullError

__all__ = ["LOOKUPS_PER_REQUEST", "EdgeCacheFeatureSource", "FeatureSource", "pool_size"]

#: Concurrent lookups one ranking request makes (its user and its items, gathered).
LOOKUPS_PER_REQUEST = 2


def pool_size(concurrency: int) -> int:
    """Connections per region the lookup client needs so that ``concurrency``
    requests in flight never wait for one (``max_connections`` of the client)."""
    return max(1, concurrency) * LOOKUPS_PER_REQUEST


@runtime_checkable
class FeatureSource(Protocol):
    """Where a model reads entity feature vectors from."""

    async def get(
        self, entity: str, ids: Sequence[str], features: Sequence[str] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Features of ``ids``: (float32 rows x features, NaN when missing; missing mask)."""
        ...

    async def aclose(self) -> None:
        """Release connections."""
        ...


class EdgeCacheFeatureSource:
    """Reads features through the edge cache's async lookup client.

    Args:
        client: An :class:`edge_cache.AsyncFeatureClient` for the worker's region
            (built with the schemas of the entities the model reads).
        max_staleness: Vectors older than this count as missing (None: any age).
        owns_client: Close the client in :meth:`aclose`.
    """

    def __init__(
        self,
        client: AsyncFeatureClient,
        max_staleness: float | timedelta | None = None,
        *,
        owns_client: bool = True,
    ) -> None:
        self.client = client
        self._max_staleness = max_staleness
        self._owns = owns_client

    async def get(
        self, entity: str, ids: Sequence[str], features: Sequence[str] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Look up ``ids`` of ``entity``; see :class:`FeatureSource`.

        Raises:
            QueueFullError: every connection of the lookup pool stayed busy until the
                deadline: this worker is overloaded, not the region (429, Retry-After).
            FeatureLookupError: the region (and its allowed fallbacks) is
                unavailable (retryable, 503), or the cache's schema does not
                have what the model reads (500).
        """
        try:
            result = await self.client.get(entity, list(ids), features, self._max_staleness)
        except PoolExhaustedError as exc:
            raise QueueFullError(
                f"feature lookups are queued beyond their deadline: {exc}",
                retry_after_s=exc.retry_after_s,
            ) from None
        except RegionUnavailableError as exc:
            raise FeatureLookupError(f"feature lookup failed: {exc}", retryable=True) from None
        except (SchemaVersionError, UnknownEntityError, UnknownFeatureError) as exc:
            raise FeatureLookupError(
                f"feature lookup of {entity!r} failed: {exc}; the model's feature list and "
                "the region's schemas disagree",
                retryable=False,
            ) from None
        except EdgeCacheError as exc:
            raise FeatureLookupError(
                f"feature lookup of {entity!r} failed: {exc}", retryable=exc.retryable
            ) from None
        # A corrupt value (result.corrupt, counted and logged by the client) and a
        # stored NaN read as missing: the request's on_missing policy decides.
        values: Any = result.to_numpy()
        return np.asarray(values, dtype=np.float32), np.asarray(result.mask, dtype=bool)

    async def aclose(self) -> None:
        """Close the lookup client (when this source owns it)."""
        if self._owns:
            await self.client.close()
