"""Feature lookup for models that read the region's edge cache (the ranking model).

The ranking model sees features only through :class:`FeatureSource`: an async
``get(entity, ids, features)`` returning a float32 matrix (rows = ids, columns =
features, NaN where missing) and a boolean mask of the missing cells.

Two implementations:

:class:`EdgeCacheFeatureSource`
    Adapts the edge_cache package's ``AsyncFeatureClient`` (the read path the
    pipeline writes for). This is the seam with :mod:`edge_cache`.
:class:`RedisFeatureSource`
    Reads a minimal documented layout straight from a region's Redis, for the
    workers' own tests and the demo until the edge cache client is wired in:

    - ``{namespace}:{entity}:schema`` -> JSON list of feature names, in vector order;
    - ``{namespace}:{entity}:{id}`` -> the entity's vector, packed little-endian
      float32 (4 bytes per feature, NaN for a missing value).

    One ``MGET`` per call, so a lookup is one round trip whatever the id count.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from workers.exceptions import MissingFeaturesError

__all__ = [
    "DEFAULT_NAMESPACE",
    "EdgeCacheFeatureSource",
    "FeatureSource",
    "RedisFeatureSource",
    "write_features",
]

DEFAULT_NAMESPACE = "edgefeed:features"


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


def _schema_key(namespace: str, entity: str) -> str:
    return f"{namespace}:{entity}:schema"


def _entity_key(namespace: str, entity: str, entity_id: str) -> str:
    return f"{namespace}:{entity}:{entity_id}"


class RedisFeatureSource:
    """Reads the documented packed-float32 layout from one region's Redis.

    Args:
        client: A ``redis.asyncio.Redis`` (bytes responses, i.e. without
            ``decode_responses``).
        namespace: Key prefix.
    """

    def __init__(self, client: Any, namespace: str = DEFAULT_NAMESPACE) -> None:
        self._client = client
        self._namespace = namespace
        self._schemas: dict[str, list[str]] = {}

    @classmethod
    def from_url(cls, url: str, namespace: str = DEFAULT_NAMESPACE) -> RedisFeatureSource:
        """Connect lazily to ``redis://host:port/db``."""
        import redis.asyncio as aioredis

        return cls(aioredis.Redis.from_url(url), namespace)

    async def _schema(self, entity: str, refresh: bool = False) -> list[str] | None:
        if refresh or entity not in self._schemas:
            raw = await self._client.get(_schema_key(self._namespace, entity))
            if raw is None:
                return None
            self._schemas[entity] = [str(name) for name in json.loads(raw)]
        return self._schemas[entity]

    async def get(
        self, entity: str, ids: Sequence[str], features: Sequence[str] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Look up ``ids`` of ``entity``; see :class:`FeatureSource`.

        Raises:
            MissingFeaturesError: the entity has no schema, or ``features`` names
                a feature the schema lacks.
        """
        schema = await self._schema(entity)
        keys = [_entity_key(self._namespace, entity, entity_id) for entity_id in ids]
        raws: list[bytes | None] = list(await self._client.mget(keys)) if keys else []
        if schema is not None and any(
            raw is not None and len(raw) != 4 * len(schema) for raw in raws
        ):
            schema = await self._schema(entity, refresh=True)  # written with a newer schema
        if schema is None:
            raise MissingFeaturesError(
                f"region cache has no feature schema for entity {entity!r} "
                f"(key {_schema_key(self._namespace, entity)!r}); sync the entity first"
            )
        if features is None:
            columns = list(range(len(schema)))
        else:
            unknown = [name for name in features if name not in schema]
            if unknown:
                raise MissingFeaturesError(
                    f"features {unknown} are not in the {entity!r} schema "
                    f"({', '.join(schema)}); fix the model's feature list"
                )
            columns = [schema.index(name) for name in features]
        values = np.full((len(ids), len(columns)), np.nan, dtype=np.float32)
        for row, raw in enumerate(raws):
            if raw is not None and len(raw) == 4 * len(schema):
                values[row] = np.frombuffer(raw, dtype="<f4")[columns]
        return values, np.isnan(values)

    async def aclose(self) -> None:
        """Close the Redis connection pool."""
        await self._client.aclose()


async def write_features(
    client: Any,
    entity: str,
    schema: Sequence[str],
    rows: Mapping[str, np.ndarray],
    namespace: str = DEFAULT_NAMESPACE,
) -> None:
    """Write ``rows`` (id -> vector in ``schema`` order) in :class:`RedisFeatureSource`'s layout."""
    pipe = client.pipeline(transaction=False)
    pipe.set(_schema_key(namespace, entity), json.dumps(list(schema)))
    for entity_id, vector in rows.items():
        packed = np.asarray(vector, dtype="<f4")
        if packed.shape != (len(schema),):
            raise ValueError(
                f"vector of {entity} {entity_id!r} has shape {packed.shape}; "
                f"the schema has {len(schema)} features"
            )
        pipe.set(_entity_key(namespace, entity, entity_id), packed.tobytes())
    await pipe.execute()


class EdgeCacheFeatureSource:
    """Adapts the edge_cache package's async feature client to :class:`FeatureSource`.

    The client's ``get(entity, ids, features, max_staleness=...)`` returns a
    result whose ``to_numpy()`` is the float32 matrix with NaN for missing
    values; the mask is taken from the result's ``mask`` when it has one, else
    from the NaNs.

    Args:
        client: ``edge_cache.AsyncFeatureClient`` (or anything with that ``get``).
        max_staleness: Passed through to the client.
    """

    def __init__(self, client: Any, max_staleness: Any = None) -> None:
        self._client = client
        self._max_staleness = max_staleness

    async def get(
        self, entity: str, ids: Sequence[str], features: Sequence[str] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Look up ``ids`` of ``entity`` through the edge cache client."""
        result = await self._client.get(
            entity,
            list(ids),
            list(features) if features is not None else None,
            max_staleness=self._max_staleness,
        )
        values = result.to_numpy()
        if isinstance(values, tuple):
            values = values[0]
        values = np.asarray(values, dtype=np.float32)
        mask = getattr(result, "mask", None)
        mask = np.isnan(values) if mask is None else np.asarray(mask, dtype=bool)
        return values, mask

    async def aclose(self) -> None:
        """Close the underlying client when it can be closed."""
        close = getattr(self._client, "aclose", None) or getattr(self._client, "close", None)
        if close is not None:
            result = close()
            if hasattr(result, "__await__"):
                await result
