"""Checks and preparation of the source database, before any connector is applied."""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import time
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql

from connectors.config import HEARTBEAT_TABLE, signal_table
from connectors.exceptions import SourceValidationError
from connectors.secrets import redact
from connectors.settings import DatabaseSettings, SourceSettings, TableSettings

__all__ = [
    "COMMIT_MS",
    "check_sources",
    "drop_slot",
    "prepare_database",
    "prepare_replication_role",
    "read_rows",
    "scram_verifier",
    "table_columns",
]


_HEARTBEAT_DDL = "CREATE TABLE IF NOT EXISTS {} (source text PRIMARY KEY, ts timestamptz NOT NULL)"
# Debezium's signal table layout (id, type, data in this order: it inserts its
# snapshot watermarks positionally).
_SIGNAL_DDL = (
    "CREATE TABLE IF NOT EXISTS {} "
    "(id varchar(64) PRIMARY KEY, type varchar(32) NOT NULL, data text)"
)


COMMIT_MS = "__edgefeed_commit_ms"  # read_rows(commit_times=True): the row's commit time


def _signal_identifier(source: SourceSettings) -> sql.Identifier:
    return sql.Identifier(*signal_table(source).split("."))


def _connect(database: DatabaseSettings) -> psycopg.Connection[tuple[object, ...]]:
    try:
        return psycopg.connect(database.dsn(), autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        reason = redact(str(exc).strip(), database.secrets())
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
    """Create the heartbeat table and each source's signal table, and set REPLICA
    IDENTITY FULL where declared (idempotent)."""
    schema, table = HEARTBEAT_TABLE.split(".")
    with _connect(database) as conn:
        conn.execute(sql.SQL(_HEARTBEAT_DDL).format(sql.Identifier(schema, table)))
        for source in sources:
            conn.execute(sql.SQL(_SIGNAL_DDL).format(_signal_identifier(source)))
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


def scram_verifier(password: str, *, iterations: int = 4096, salt: bytes | None = None) -> str:
    """PostgreSQL's SCRAM-SHA-256 verifier of ``password`` (RFC 5802, 7677).

    ``ALTER ROLE ... PASSWORD '<verifier>'`` stores it as is, so the password
    itself never reaches the server, its logs or ``pg_stat_activity``.
    """
    salt = salt if salt is not None else os.urandom(16)
    salted = hashlib.pbkdf2_hmac("sha256", password.encode("utf-8"), salt, iterations)
    client_key = hmac.digest(salted, b"Client Key", "sha256")
    stored_key = hashlib.sha256(client_key).digest()
    server_key = hmac.digest(salted, b"Server Key", "sha256")

    def b64(raw: bytes) -> str:
        return base64.b64encode(raw).decode("ascii")

    return f"SCRAM-SHA-256${iterations}:{b64(salt)}${b64(stored_key)}:{b64(server_key)}"


def prepare_replication_role(database: DatabaseSettings, sources: Sequence[SourceSettings]) -> None:
    """Create (or reset) the replication role, its grants and each source's publication.

    Runs as the database settings' user, which must be able to create roles and
    publications (a superuser, or a role with CREATEROLE owning the tables).
    Idempotent; a no-op without ``database.replication``.

    Raises:
        SecretSourceError: the role's (or the database's) ``password_file`` or
            ``password_env`` gives no password; checked before connecting.
        SourceValidationError: the database cannot be reached, or refused a statement.
    """
    role = database.replication
    if role is None:
        return
    password = role.secret()  # never empty: its source gives one, or this raises
    name = sql.Identifier(role.user)
    verifier = sql.Literal(scram_verifier(password))
    attributes = sql.SQL("LOGIN REPLICATION NOSUPERUSER NOCREATEDB NOCREATEROLE NOBYPASSRLS")
    heartbeat = sql.Identifier(*HEARTBEAT_TABLE.split("."))
    with _connect(database) as conn:
        try:
            exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role.user,))
            verb = sql.SQL("ALTER ROLE") if exists.fetchone() else sql.SQL("CREATE ROLE")
            conn.execute(
                sql.SQL("{} {} WITH {} PASSWORD {}").format(verb, name, attributes, verifier)
            )
            conn.execute(
                sql.SQL("GRANT CONNECT ON DATABASE {} TO {}").format(
                    sql.Identifier(database.dbname), name
                )
            )
            conn.execute(sql.SQL(_HEARTBEAT_DDL).format(heartbeat))
            for source in sources:
                conn.execute(sql.SQL(_SIGNAL_DDL).format(_signal_identifier(source)))
            tables = [t for source in sources for t in source.tables]
            schemas = {t.schema_name for t in tables} | {HEARTBEAT_TABLE.split(".")[0]}
            for schema in sorted(schemas):
                conn.execute(
                    sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(sql.Identifier(schema), name)
                )
            for table in tables:
                conn.execute(
                    sql.SQL("GRANT SELECT ON {} TO {}").format(
                        sql.Identifier(table.schema_name, table.table_name), name
                    )
                )
            # The heartbeat query (connectors.config.heartbeat_query) upserts one row.
            conn.execute(
                sql.SQL("GRANT SELECT, INSERT, UPDATE ON {} TO {}").format(heartbeat, name)
            )
            for source in sources:
                # Debezium writes the incremental snapshot's window watermarks there.
                conn.execute(
                    sql.SQL("GRANT SELECT, INSERT ON {} TO {}").format(
                        _signal_identifier(source), name
                    )
                )
            for source in sources:
                listed = sql.SQL(", ").join(
                    [
                        *(sql.Identifier(t.schema_name, t.table_name) for t in source.tables),
                        heartbeat,
                        _signal_identifier(source),
                    ]
                )
                publication = sql.Identifier(source.effective_publication)
                found = conn.execute(
                    "SELECT 1 FROM pg_publication WHERE pubname = %s",
                    (source.effective_publication,),
                ).fetchone()
                statement = (
                    "ALTER PUBLICATION {} SET TABLE {}"
                    if found
                    else ("CREATE PUBLICATION {} FOR TABLE {}")
                )
                conn.execute(sql.SQL(statement).format(publication, listed))
        except psycopg.Error as exc:
            reason = redact(str(exc).strip(), database.secrets())
            raise SourceValidationError(
                f"cannot prepare replication user {role.user!r} as {database.user!r}: {reason}; "
                "the database user must be able to create roles and publications"
            ) from None


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
    database: DatabaseSettings, tables: Sequence[TableSettings], *, commit_times: bool = False
) -> dict[str, list[dict[str, Any]]]:
    """The current rows of each table (captured columns only), in key order.

    Args:
        commit_times: Add to each row, under :data:`COMMIT_MS`, the commit time of its
            current version in milliseconds (``pg_xact_commit_timestamp(xmin)``), or
            None where the server does not know it (``track_commit_timestamp`` off, or
            a row committed before it was turned on).

    Raises:
        SourceValidationError: the database cannot be reached.
    """
    result: dict[str, list[dict[str, Any]]] = {}
    with _connect(database) as conn:
        tracked = False
        if commit_times:
            setting = conn.execute("SHOW track_commit_timestamp").fetchone()
            tracked = bool(setting and str(setting[0]) == "on")
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
            selected: list[sql.Composable] = [sql.Identifier(c) for c in columns]
            names = list(columns)
            if commit_times:
                selected.append(
                    sql.SQL(
                        "(extract(epoch FROM pg_xact_commit_timestamp(xmin)) * 1000)::bigint"
                        if tracked
                        else "NULL::bigint"
                    )
                )
                names.append(COMMIT_MS)
            query = sql.SQL("SELECT {} FROM {} ORDER BY {}").format(
                sql.SQL(", ").join(selected),
                sql.Identifier(table.schema_name, table.table_name),
                sql.SQL(", ").join(sql.Identifier(c) for c in table.key),
            )
            result[table.name] = [
                dict(zip(names, row, strict=True)) for row in conn.execute(query).fetchall()
            ]
    return result


def drop_slot(conn: psycopg.Connection[Any], slot: str, publication: str | None = None) -> None:
    """Drop a replication slot (waiting up to 30 s for its connector to let go) and, when
    named, its publication; either may be gone already."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
            break
        except psycopg.errors.ObjectInUse:
            time.sleep(0.2)
        except psycopg.errors.UndefinedObject:
            break
    if publication is not None:
        conn.execute(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(sql.Identifier(publication)))
