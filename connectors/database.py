"""Checks and preparation of the source database, before any connector is applied."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql

from connectors.config import HEARTBEAT_TABLE
from connectors.exceptions import SourceValidationError
from connectors.secrets import redact
from connectors.settings import DatabaseSettings, SourceSettings, TableSettings

__all__ = ["check_sources", "prepare_database", "read_rows", "table_columns"]


def _connect(database: DatabaseSettings) -> psycopg.Connection[tuple[object, ...]]:
    try:
        return psycopg.connect(database.dsn(), autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        reason = redact(str(exc).strip(), [database.secret()])
        raise SourceValidationError(
            f"cannot connect to the source database {database.user}@{database.host}:"
            f"{database.port}/{database.dbname}: {reason}; check the database settings"
        ) from None


def check_sources(database: DatabaseSettings, sources: Sequence[SourceSettings]) -> None:
    """Check that logical decoding is on and every declared table and column exists.

    Raises:
        SourceValidationError: listing every problem found, each with its fix.
    """
    problems: list[str] = []
    with _connect(database) as conn:
        row = conn.execute("SHOW wal_level").fetchone()
        wal_level = str(row[0]) if row else "unknown"
        if wal_level != "logical":
            problems.append(
                f"the database runs with wal_level={wal_level!r}; Debezium needs "
                "wal_level=logical (set it in postgresql.conf and restart PostgreSQL)"
            )
        for source in sources:
            for table in source.tables:
                rows = conn.execute(
                    "SELECT column_name FROM information_schema.columns "
                    "WHERE table_schema = %s AND table_name = %s",
                    (table.schema_name, table.table_name),
                ).fetchall()
                columns = {str(r[0]) for r in rows}
                if not columns:
                    problems.append(
                        f"source {source.name}: table {table.name} does not exist in database "
                        f"{database.dbname!r}; create it or remove it from the settings"
                    )
                    continue
                wanted = [("key", c) for c in table.key]
                wanted += [("excluded", c) for c in table.exclude_columns]
                if table.home_region_column:
                    wanted.append(("home_region_column", table.home_region_column))
                for role, column in wanted:
                    if column not in columns:
                        problems.append(
                            f"source {source.name}: {role} column {column!r} is not a column "
                            f"of {table.name} (columns: {', '.join(sorted(columns))})"
                        )
    if problems:
        raise SourceValidationError(
            "the declared sources do not match the database:\n  " + "\n  ".join(problems)
        )


def prepare_database(database: DatabaseSettings, sources: Sequence[SourceSettings]) -> None:
    """Create the heartbeat table and set REPLICA IDENTITY FULL where declared (idempotent)."""
    schema, table = HEARTBEAT_TABLE.split(".")
    with _connect(database) as conn:
        conn.execute(
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {} (source text PRIMARY KEY, ts timestamptz NOT NULL)"
            ).format(sql.Identifier(schema, table))
        )
        for source in sources:
            for declared in source.tables:
                if declared.replica_identity != "full":
                    continue
                row = conn.execute(
                    "SELECT c.relreplident FROM pg_class c JOIN pg_namespace n "
                    "ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relname = %s",
                    (declared.schema_name, declared.table_name),
                ).fetchone()
                if row is not None and row[0] != "f":
                    conn.execute(
                        sql.SQL("ALTER TABLE {} REPLICA IDENTITY FULL").format(
                            sql.Identifier(declared.schema_name, declared.table_name)
                        )
                    )


def table_columns(database: DatabaseSettings, tables: Sequence[str]) -> dict[str, set[str]]:
    """The columns of each ``schema.table`` (an empty set for a table that does not exist)."""
    result: dict[str, set[str]] = {}
    with _connect(database) as conn:
        for name in tables:
            schema, table = name.split(".", 1)
            rows = conn.execute(
                "SELECT column_name FROM information_schema.columns "
                "WHERE table_schema = %s AND table_name = %s",
                (schema, table),
            ).fetchall()
            result[name] = {str(r[0]) for r in rows}
    return result


def read_rows(
    database: DatabaseSettings, tables: Sequence[TableSettings]
) -> dict[str, list[dict[str, Any]]]:
    """The current rows of each table (captured columns only), in key order.

    Raises:
        SourceValidationError: the database cannot be reached.
    """
    result: dict[str, list[dict[str, Any]]] = {}
    with _connect(database) as conn:
        for table in tables:
            columns = [
                str(r[0])
                for r in conn.execute(
                    "SELECT column_name FROM information_schema.columns "
                    "WHERE table_schema = %s AND table_name = %s ORDER BY ordinal_position",
                    (table.schema_name, table.table_name),
                ).fetchall()
                if str(r[0]) not in table.exclude_columns
            ]
            if not columns:
                result[table.name] = []
                continue
            query = sql.SQL("SELECT {} FROM {} ORDER BY {}").format(
                sql.SQL(", ").join(sql.Identifier(c) for c in columns),
                sql.Identifier(table.schema_name, table.table_name),
                sql.SQL(", ").join(sql.Identifier(c) for c in table.key),
            )
            result[table.name] = [
                dict(zip(columns, row, strict=True)) for row in conn.execute(query).fetchall()
            ]
    return result
