"""The lab's data: a synthetic shop's behaviour events in PostgreSQL, the SQL that
computes a request's features from them, and the same features in the edge cache.

The events are generated (a fixed seed; nothing is downloaded) and spread over
the last hour, so the "last 30 minutes" windows hold about half of them. The
SQL is what a team without a feature cache runs per request; the edge cache
holds the result of the same SQL, written by the edge cache's own writer (the
pipeline's sink), so every topology ranks the same inputs.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime

import numpy as np
import psycopg

from edge_cache import AsyncFeatureWriter, FeatureSchema, Position, RegionSettings, Upsert
from edgefeed.lab.exceptions import LabDataError
from workers.distill import LAB_ITEM_FEATURES, LAB_USER_FEATURES
from workers.sqlfeatures import SqlFeatureQuery

__all__ = [
    "ITEM_QUERY",
    "SCHEMA",
    "USER_QUERY",
    "LabData",
    "seed_events",
    "write_edge_cache",
]

SCHEMA = "edgefeed_lab"
_KINDS = np.array(["view", "view", "view", "view", "click", "click", "add_to_cart", "purchase"])
_DDL = f"""
CREATE SCHEMA IF NOT EXISTS {SCHEMA};
CREATE TABLE IF NOT EXISTS {SCHEMA}.items (
    item_id text PRIMARY KEY,
    price   real NOT NULL
);
CREATE TABLE IF NOT EXISTS {SCHEMA}.events (
    user_id     text NOT NULL,
    item_id     text NOT NULL,
    kind        text NOT NULL,
    price       real NOT NULL,
    occurred_at timestamptz NOT NULL
);
CREATE INDEX IF NOT EXISTS events_user_time ON {SCHEMA}.events (user_id, occurred_at);
CREATE INDEX IF NOT EXISTS events_item_time ON {SCHEMA}.events (item_id, occurred_at);
"""

USER_QUERY = SqlFeatureQuery(
    """
SELECT u.id,
       count(e.kind) FILTER (WHERE e.kind = 'view'),
       count(e.kind) FILTER (WHERE e.kind = 'click'),
       count(e.kind) FILTER (WHERE e.kind = 'add_to_cart'),
       count(e.kind) FILTER (WHERE e.kind = 'purchase'),
       coalesce(sum(e.price) FILTER (WHERE e.kind = 'purchase'), 0),
       count(DISTINCT e.item_id)
FROM unnest(%(ids)s::text[]) AS u(id)
LEFT JOIN edgefeed_lab.events e
       ON e.user_id = u.id AND e.occurred_at > now() - interval '30 minutes'
GROUP BY u.id
""",
    LAB_USER_FEATURES,
)
"""A user's behaviour of the last 30 minutes (a user without events gets zeros)."""

ITEM_QUERY = SqlFeatureQuery(
    """
SELECT i.item_id,
       i.price,
       count(e.kind) FILTER (WHERE e.kind = 'view'),
       count(e.kind) FILTER (WHERE e.kind = 'purchase')
FROM edgefeed_lab.items i
LEFT JOIN edgefeed_lab.events e
       ON e.item_id = i.item_id AND e.occurred_at > now() - interval '30 minutes'
WHERE i.item_id = ANY(%(ids)s::text[])
GROUP BY i.item_id, i.price
""",
    LAB_ITEM_FEATURES,
)
"""An item's price and popularity of the last 30 minutes (unknown items: no row)."""


class LabData:
    """The generated shop: ``users`` users, ``items`` items.

    Args:
        users: Number of users (ids ``0`` .. ``users - 1``).
        items: Number of items (ids ``0`` .. ``items - 1``).
        seed: Random seed of everything generated.
    """

    def __init__(self, users: int = 2000, items: int = 500, seed: int = 17) -> None:
        if users < 1 or items < 1:
            raise LabDataError(f"users={users} and items={items} must both be at least 1")
        self.users = users
        self.items = items
        self.seed = seed

    def user_ids(self) -> list[str]:
        return [str(u) for u in range(self.users)]

    def item_ids(self) -> list[str]:
        return [str(i) for i in range(self.items)]

    def requests(self, count: int, candidates: int) -> list[tuple[str, list[str]]]:
        """``count`` ranking requests: (user id, ``candidates`` distinct item ids)."""
        rng = np.random.default_rng(self.seed + 1)
        size = min(candidates, self.items)
        return [
            (
                str(int(rng.integers(self.users))),
                [str(int(i)) for i in rng.choice(self.items, size=size, replace=False)],
            )
            for _ in range(count)
        ]


def _connect(dsn: str, doing: str) -> psycopg.Connection[tuple[object, ...]]:
    try:
        return psycopg.connect(dsn, autocommit=True, connect_timeout=10)
    except psycopg.Error as exc:
        # The message of a connection error may quote the DSN: name the kind only.
        raise LabDataError(
            f"cannot {doing}: PostgreSQL refused or is down ({type(exc).__name__}); start "
            "it with `edgefeed dev up` and check database: in the settings"
        ) from None


def seed_events(dsn: str, data: LabData, events: int) -> int:
    """(Re)create the lab's tables with ``events`` generated events of the last hour.

    Returns:
        The source position (WAL LSN) after the load, for the cache writes.

    Raises:
        LabDataError: the database is unreachable or refused a statement.
    """
    rng = np.random.default_rng(data.seed)
    prices = np.round(rng.uniform(2, 200, size=data.items), 2)
    # A few users and items are much busier than the rest, as in a real shop.
    user_weight = rng.pareto(1.5, size=data.users) + 1
    item_weight = rng.pareto(1.5, size=data.items) + 1
    users = rng.choice(data.users, size=events, p=user_weight / user_weight.sum())
    items = rng.choice(data.items, size=events, p=item_weight / item_weight.sum())
    kinds = _KINDS[rng.integers(len(_KINDS), size=events)]
    # Ages of 0-25 and 35-60 minutes: no event is within 5 minutes of the 30-minute
    # boundary, so the vectors written into the cache at load time stay equal to what
    # the per-request SQL computes for the whole run (every topology ranks the same
    # inputs) as long as the run lasts under 5 minutes.
    ages_s = rng.uniform(0, 1500, size=events) + np.where(rng.random(events) < 0.5, 0, 2100)
    with _connect(dsn, "load the lab's events") as conn:
        try:
            conn.execute(_DDL)
            with conn.transaction():
                conn.execute(f"TRUNCATE {SCHEMA}.items, {SCHEMA}.events")
                with conn.cursor() as cur:
                    with cur.copy(f"COPY {SCHEMA}.items (item_id, price) FROM STDIN") as copy:
                        for item, price in enumerate(prices):
                            copy.write_row((str(item), float(price)))
                    with cur.copy(
                        f"COPY {SCHEMA}.events (user_id, item_id, kind, price, occurred_at) "
                        "FROM STDIN"
                    ) as copy:
                        now = time.time()
                        for user, item, kind, age in zip(users, items, kinds, ages_s, strict=True):
                            copy.write_row(
                                (
                                    str(user),
                                    str(item),
                                    str(kind),
                                    float(prices[item]),
                                    datetime.fromtimestamp(now - float(age), tz=UTC),
                                )
                            )
            conn.execute(f"ANALYZE {SCHEMA}.items, {SCHEMA}.events")
            row = conn.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn").fetchone()
        except psycopg.Error as exc:
            raise LabDataError(
                f"loading the lab's events failed: {type(exc).__name__}: "
                f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            ) from None
    return int(row[0]) if row is not None else 1  # type: ignore[call-overload]


def _features(dsn: str, query: SqlFeatureQuery, ids: list[str]) -> dict[str, dict[str, float]]:
    with _connect(dsn, "compute the cache's features") as conn:
        try:
            rows = conn.execute(query.sql, {"ids": ids}).fetchall()
        except psycopg.Error as exc:
            raise LabDataError(
                f"computing the lab's features failed: {type(exc).__name__}"
            ) from None
    return {
        str(row[0]): {
            name: float(value)  # type: ignore[arg-type]
            for name, value in zip(query.features, row[1:], strict=True)
        }
        for row in rows
    }


async def write_edge_cache(
    dsn: str,
    region: RegionSettings,
    user_schema: FeatureSchema,
    item_schema: FeatureSchema,
    data: LabData,
    position: int,
) -> int:
    """Compute every user's and item's features with the lab's SQL and write them
    into ``region``'s cache with the edge cache's writer; the number of vectors.

    Raises:
        LabDataError: the database failed.
    """
    users = await asyncio.to_thread(_features, dsn, USER_QUERY, data.user_ids())
    items = await asyncio.to_thread(_features, dsn, ITEM_QUERY, data.item_ids())
    now = time.time()
    ops = [
        Upsert(user_schema.entity, key, values, Position(position), now)
        for key, values in users.items()
    ]
    ops += [
        Upsert(item_schema.entity, key, values, Position(position), now)
        for key, values in items.items()
    ]
    writer = AsyncFeatureWriter.from_region(region, [user_schema, item_schema])
    try:
        await writer.publish_schemas()
        for start in range(0, len(ops), 1000):
            await writer.write(ops[start : start + 1000], freshness=True)
    finally:
        await writer.close()
    return len(ops)
