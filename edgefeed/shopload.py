"""A load generator for the demo e-commerce schema (edgefeed/data/shop_schema.sql).

Writes users and items once, then a steady stream of behaviour events (views,
clicks, carts, purchases) with occasional price and segment updates, at a
fixed rate of changes per second on an absolute schedule: a slow tick is made
up by the next one, so the achieved rate is the asked one unless PostgreSQL
cannot keep up (then ``behind`` grows and the progress line says so).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from connectors.secrets import redact
from edgefeed.errors import EdgefeedError

__all__ = ["DemoDatabaseError", "LoadProgress", "ShopLoad", "apply_schema"]

SCHEMA_FILE = Path(__file__).resolve().parent / "data" / "shop_schema.sql"
KINDS = ("view", "view", "view", "view", "view", "click", "click", "add_to_cart", "purchase")
COUNTRIES = {"eu-west": ("DE", "FR", "NL"), "us-east": ("US", "CA"), "ap-southeast": ("SG", "ID")}


class DemoDatabaseError(EdgefeedError):
    """The demo's PostgreSQL could not be reached or refused a statement.
    Retryable: start the database (``edgefeed dev up``) or fix ``database:``.
    The message never holds the password."""

    retryable = True


@contextmanager
def _database(dsn: str, doing: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    """A connection to ``dsn``; any psycopg error becomes a :class:`DemoDatabaseError`."""
    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
            yield conn
    except psycopg.Error as exc:
        try:
            where = conninfo_to_dict(dsn)
            password = str(where.get("password") or "")
        except psycopg.Error:
            where, password = {}, dsn
        reason = redact(str(exc).strip().splitlines()[0] if str(exc).strip() else "", [password])
        raise DemoDatabaseError(
            f"cannot {doing} in the database {where.get('user', '?')}@{where.get('host', '?')}:"
            f"{where.get('port', '?')}/{where.get('dbname', '?')} "
            f"({type(exc).__name__}: {reason}); is PostgreSQL running (`edgefeed dev up`) "
            "and are the database settings right?"
        ) from None


def apply_schema(dsn: str, schema_sql: str | None = None) -> None:
    """Create the demo tables if they do not exist.

    Raises:
        DemoDatabaseError: the database could not be reached or refused the schema.
    """
    text = schema_sql if schema_sql is not None else SCHEMA_FILE.read_text(encoding="utf-8")
    with _database(dsn, "create the demo tables") as conn:
        conn.execute(text)


@dataclass(frozen=True, slots=True)
class LoadProgress:
    """Where a load run stands."""

    elapsed_s: float
    changes: int
    target: int

    @property
    def rate(self) -> float:
        return self.changes / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def behind(self) -> int:
        return max(0, self.target - self.changes)


class ShopLoad:
    """Writes the demo shop's rows into PostgreSQL.

    Args:
        dsn: libpq connection string of the source database.
        regions: Home regions to spread the users over.
        users: Number of users (ids 1..users).
        items: Number of items (ids 1..items).
        schema: Schema holding the tables.
        seed: Random seed, so a run can be repeated.
    """

    def __init__(
        self,
        dsn: str,
        regions: Sequence[str],
        *,
        users: int = 300,
        items: int = 100,
        schema: str = "public",
        seed: int = 7,
    ) -> None:
        if users < 1 or items < 1:
            raise ValueError(f"users={users} and items={items} must both be at least 1")
        self.dsn = dsn
        self.regions = list(regions)
        self.users = users
        self.items = items
        self.schema = schema
        self.random = random.Random(seed)

    def home_region(self, user_id: int) -> str:
        return self.regions[(user_id - 1) % len(self.regions)]

    def _table(self, name: str) -> sql.Identifier:
        return sql.Identifier(self.schema, name)

    def seed_rows(self) -> None:
        """Insert (or refresh) every user and item."""
        rng = self.random
        with _database(self.dsn, "seed the demo rows") as conn, conn.cursor() as cur:
            cur.executemany(
                sql.SQL(
                    "INSERT INTO {} (user_id, home_region, country, segment, email) "
                    "VALUES (%s, %s, %s, %s, %s) ON CONFLICT (user_id) DO NOTHING"
                ).format(self._table("users")),
                [
                    (
                        u,
                        self.home_region(u),
                        rng.choice(COUNTRIES.get(self.home_region(u), ("XX",))),
                        rng.randrange(4),
                        f"user{u}@example.org",
                    )
                    for u in range(1, self.users + 1)
                ],
            )
            cur.executemany(
                sql.SQL(
                    "INSERT INTO {} (item_id, category_id, price) VALUES (%s, %s, %s) "
                    "ON CONFLICT (item_id) DO NOTHING"
                ).format(self._table("items")),
                [(i, 1 + i % 12, round(rng.uniform(2, 200), 2)) for i in range(1, self.items + 1)],
            )

    def _events(self, count: int) -> list[tuple[object, ...]]:
        rng = self.random
        rows: list[tuple[object, ...]] = []
        for _ in range(count):
            user = rng.randrange(1, self.users + 1)
            item = rng.randrange(1, self.items + 1)
            rows.append(
                (
                    user,
                    item,
                    1 + item % 12,
                    round(rng.uniform(2, 200), 2),
                    self.home_region(user),
                    rng.choice(KINDS),
                )
            )
        return rows

    def write(self, conn: psycopg.Connection[tuple[object, ...]], count: int) -> None:
        """Write ``count`` changes in one transaction: mostly events, some updates."""
        updates = count // 20
        events = count - 2 * updates
        with conn.transaction(), conn.cursor() as cur:
            with cur.copy(
                sql.SQL(
                    "COPY {} (user_id, item_id, category_id, price, home_region, kind) FROM STDIN"
                ).format(self._table("events"))
            ) as copy:
                for row in self._events(events):
                    copy.write_row(row)
            for _ in range(updates):
                cur.execute(
                    sql.SQL(
                        "UPDATE {} SET price = %s, updated_at = now() WHERE item_id = %s"
                    ).format(self._table("items")),
                    (
                        round(self.random.uniform(2, 200), 2),
                        self.random.randrange(1, self.items + 1),
                    ),
                )
                cur.execute(
                    sql.SQL("UPDATE {} SET segment = %s WHERE user_id = %s").format(
                        self._table("users")
                    ),
                    (self.random.randrange(4), self.random.randrange(1, self.users + 1)),
                )

    def run(
        self,
        rate: float,
        duration_s: float,
        *,
        tick_s: float = 0.05,
        on_progress: Callable[[LoadProgress], None] | None = None,
    ) -> LoadProgress:
        """Write ``rate`` changes per second for ``duration_s`` seconds."""
        if rate <= 0 or duration_s <= 0:
            raise ValueError(f"rate={rate} and duration_s={duration_s} must be positive")
        written = 0
        started = time.monotonic()
        last_report = 0.0
        with _database(self.dsn, "write the demo load") as conn:
            while True:
                elapsed = time.monotonic() - started
                if elapsed >= duration_s:
                    break
                due = int(rate * elapsed) - written
                if due > 0:
                    self.write(conn, due)
                    written += due
                if on_progress is not None and elapsed - last_report >= 0.5:
                    last_report = elapsed
                    on_progress(LoadProgress(elapsed, written, int(rate * elapsed)))
                time.sleep(max(0.0, tick_s - (time.monotonic() - started - elapsed)))
        final = LoadProgress(time.monotonic() - started, written, int(rate * duration_s))
        if on_progress is not None:
            on_progress(final)
        return final
