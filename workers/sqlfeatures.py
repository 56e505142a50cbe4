"""Features computed by SQL at request time: the alternative to the edge cache.

A team without a feature cache computes a request's features with a query on
the source database (for instance the user's events of the last 30 minutes).
:class:`SqlFeatureSource` is that code path behind the same
:class:`~workers.features.FeatureSource` protocol as the edge cache lookup, so
a model served with it measures the query as its T_data, inside the worker.

Each entity type has one :class:`SqlFeatureQuery`: a statement taking the
requested ids as one array parameter (``%(ids)s``) and returning one row per
id found, the id first, then the features in the query's declared order.
Connections come from a ``psycopg_pool.AsyncConnectionPool`` (the psycopg
project's pool: concurrent lookups of one request, the user's and the items',
run on two connections at once instead of queueing on one).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

try:
    import psycopg
    from psycopg_pool import AsyncConnectionPool
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        "SQL feature lookups need psycopg and psycopg-pool: pip install 'edgefeed[workers]'"
    ) from exc

from workers.exceptions import FeatureLookupError, WorkerConfigError

__all__ = ["SqlFeatureQuery", "SqlFeatureSource"]


@dataclass(frozen=True, slots=True)
class SqlFeatureQuery:
    """How one entity type's features are computed.

    Attributes:
        sql: A statement with one ``%(ids)s`` parameter (an array of text ids)
            that returns ``(id, feature, feature, ...)`` per id found.
        features: Names of the feature columns, in the statement's order.
    """

    sql: str
    features: tuple[str, ...]

    def __post_init__(self) -> None:
        if "%(ids)s" not in self.sql:
            raise WorkerConfigError(
                "an SqlFeatureQuery's statement must take the ids as %(ids)s (an array of "
                f"text); got {self.sql[:80]!r}"
            )
        if not self.features:
            raise WorkerConfigError("an SqlFeatureQuery needs at least one feature column")


class SqlFeatureSource:
    """Computes features per request with SQL on a PostgreSQL database.

    Args:
        pool: An open ``AsyncConnectionPool`` of the database (size it to the
            lookups in flight: two per ranking request).
        queries: Entity type -> its query.
        owns_pool: Close the pool in :meth:`aclose`.
    """

    def __init__(
        self,
        pool: AsyncConnectionPool[Any],
        queries: Mapping[str, SqlFeatureQuery],
        *,
        owns_pool: bool = True,
    ) -> None:
        self.pool = pool
        self.queries = dict(queries)
        self._owns = owns_pool

    async def get(
        self, entity: str, ids: Sequence[str], features: Sequence[str] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Compute ``features`` of ``ids``; see :class:`~workers.features.FeatureSource`.

        Raises:
            FeatureLookupError: the entity has no query or the query lacks a
                feature (500, not retryable), or the database failed (503, retryable).
        """
        query = self.queries.get(entity)
        if query is None:
            raise FeatureLookupError(
                f"no SQL feature query for entity {entity!r}; queries exist for: "
                f"{', '.join(sorted(self.queries)) or '(none)'}",
                retryable=False,
            )
        wanted = tuple(features) if features is not None else query.features
        missing = [name for name in wanted if name not in query.features]
        if missing:
            raise FeatureLookupError(
                f"the SQL feature query of {entity!r} computes {list(query.features)}, not "
                f"{missing}; add them to the query or serve a model that reads these",
                retryable=False,
            )
        keys = [str(i) for i in ids]
        try:
            async with self.pool.connection() as conn, conn.cursor() as cur:
                await cur.execute(query.sql, {"ids": keys})
                rows = await cur.fetchall()
        except psycopg.Error as exc:
            # The message of a connection error can carry the DSN; name the kind only.
            raise FeatureLookupError(
                f"SQL feature lookup of {entity!r} failed ({type(exc).__name__}); "
                "is the database reachable?",
                retryable=True,
            ) from None
        except TimeoutError:
            raise FeatureLookupError(
                f"SQL feature lookup of {entity!r}: no database connection within the "
                "pool's timeout; the database is unreachable or the pool is too small",
                retryable=True,
            ) from None
        columns = [query.features.index(name) + 1 for name in wanted]
        values = np.full((len(keys), len(wanted)), np.nan, dtype=np.float32)
        where = {key: n for n, key in enumerate(keys)}
        for row in rows:
            n = where.get(str(row[0]))
            if n is None:
                continue
            values[n] = [math.nan if row[col] is None else float(row[col]) for col in columns]
        return values, np.isnan(values)

    async def aclose(self) -> None:
        """Close the pool (when this source owns it)."""
        if self._owns:
            await self.pool.close()
