"""Settings of the CDC source database, the tables it feeds, and the Kafka Connect cluster."""

from __future__ import annotations

import re
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from connectors.secrets import redact_urls
from edgefeed_base.secrets import PasswordFields

__all__ = [
    "ConnectSettings",
    "DatabaseSettings",
    "ReplicationRoleSettings",
    "SnapshotMode",
    "SourceSettings",
    "TableSettings",
]

SnapshotMode = Literal["initial", "no_data", "never", "when_needed", "always", "initial_only"]
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SLOT = re.compile(r"^[a-z0-9_]{1,63}$")


class ConnectSettings(BaseModel):
    """Where the Kafka Connect REST API listens.

    Attributes:
        url: Base URL of the Connect REST API, e.g. ``http://127.0.0.1:8083``.
        timeout_s: Timeout of one REST call, in seconds.
        retries: How often a call is retried on 409 (rebalance in progress) and
            5xx answers or a refused connection, with exponential backoff.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = "http://127.0.0.1:8083"
    timeout_s: float = Field(default=10.0, gt=0)
    retries: int = Field(default=5, ge=0, le=20)

    @field_validator("url")
    @classmethod
    def _http(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            shown = redact_urls(value)
            raise ValueError(f"connect url {shown!r} must start with http:// or https://")
        return value.rstrip("/")


class ReplicationRoleSettings(PasswordFields):
    """The role Debezium connects as: ``LOGIN REPLICATION``, not a superuser.

    ``edgefeed connectors apply`` creates it (or brings it back to these grants)
    as the database settings' user: SELECT on the captured tables, SELECT,
    INSERT, UPDATE on the heartbeat table, CONNECT and schema USAGE; apply
    creates the publication itself, so the role owns nothing. The password is
    given one way, as for the database: ``password``, ``password_env`` (the
    connector config holds ``${env:NAME}``) or ``password_file``
    (``${dir:DIR:FILE}``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    setting_path: ClassVar[str | None] = "database.replication"

    user: str = "edgefeed_cdc"

    @field_validator("user")
    @classmethod
    def _role_name(cls, value: str) -> str:
        if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", value):
            raise ValueError(
                f"replication user {value!r} must be lowercase letters, digits and '_' "
                "(a PostgreSQL role name that needs no quoting)"
            )
        return value

    @model_validator(mode="after")
    def _one_password_source(self) -> ReplicationRoleSettings:
        given = self.password_sources()
        if len(given) != 1:
            raise ValueError(
                "database.replication needs exactly one of password, password_env, "
                f"password_file (got {', '.join(given) or 'none'})"
            )
        return self

    def connect_password_reference(self) -> str:
        """What the connector config holds for the password (a provider reference if any)."""
        if self.password_env:
            return f"${{env:{self.password_env}}}"
        if self.password_file:
            return f"${{dir:{self.password_file.parent}:{self.password_file.name}}}"
        return self.password.get_secret_value()


class DatabaseSettings(PasswordFields):
    """The PostgreSQL database whose changes Debezium captures.

    The password is a secret: it never appears in ``repr``, logs or errors. Give
    it one of three ways:

    - ``password``: inline (usually ``${ENV}``-expanded); sent to Connect in the
      connector config.
    - ``password_env``: the name of an environment variable that both edgefeed
      and every Connect worker have; the connector config holds only
      ``${env:NAME}`` (Connect's EnvVarConfigProvider).
    - ``password_file``: a file holding just the password (a Docker/Kubernetes
      secret) at the same path for edgefeed and the Connect workers; the config
      holds ``${dir:DIR:FILE}`` (Connect's DirectoryConfigProvider).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    setting_path: ClassVar[str | None] = "database"

    host: str = "127.0.0.1"
    port: int = Field(default=5432, ge=1, le=65535)
    dbname: str = "edgefeed"
    user: str = "postgres"
    replication: ReplicationRoleSettings | None = None

    @model_validator(mode="after")
    def _one_password_source(self) -> DatabaseSettings:
        given = self.password_sources()
        if len(given) > 1:
            raise ValueError(f"database has {' and '.join(given)}; give the password one way only")
        return self

    def secrets(self) -> list[str]:
        """Every password these settings hold that can be read now (the database's, the
        replication role's): what to mask in output. A source that cannot be read is
        left out, not an error: a process that does not connect need not have it."""
        found = [self.secret_for_redaction()]
        if self.replication is not None:
            found.append(self.replication.secret_for_redaction())
        return [s for s in found if s]

    def provider_references(self) -> tuple[list[str], list[Path]]:
        """The environment variables and folders the connector config reads through
        Connect's config providers: what a Connect worker must allow, and no more."""
        env: list[str] = []
        folders: list[Path] = []
        for source in (self, self.replication):
            if source is None:
                continue
            if source.password_env:
                env.append(source.password_env)
            if source.password_file:
                folders.append(source.password_file.parent)
        return env, folders

    def connect_password_reference(self) -> str:
        """What the connector config holds for the password (a provider reference if any)."""
        if self.password_env:
            return f"${{env:{self.password_env}}}"
        if self.password_file:
            return f"${{dir:{self.password_file.parent}:{self.password_file.name}}}"
        return self.password.get_secret_value()

    def dsn(self) -> str:
        """A libpq connection string, each value quoted (contains the password: never log it).

        Raises:
            SecretSourceError: ``password_file`` or ``password_env`` gives no password.
        """
        from psycopg.conninfo import make_conninfo  # psycopg only when a connection is made

        return make_conninfo(
            host=self.host,
            port=self.port,
            dbname=self.dbname,
            user=self.user,
            password=self.secret() or None,
        )


class TableSettings(BaseModel):
    """One captured table.

    Attributes:
        name: ``schema.table`` (``public`` if no schema is given).
        key: Columns that identify an entity; they become the Kafka message key
            (``message.key.columns``), so a table needs no primary key.
        home_region_column: Column holding the entity's home region, for tables
            of personal data; None for shared data (items, prices).
        exclude_columns: Columns never captured (``column.exclude.list``).
        snapshot: Include the table's existing rows in the initial snapshot.
        replica_identity: ``full`` makes updates and deletes carry the whole old
            row (``before``); apply sets it on the table. Needed where a change of
            the home region must remove the entity from its old region.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    key: list[str] = Field(min_length=1)
    home_region_column: str | None = None
    exclude_columns: list[str] = Field(default_factory=list)
    snapshot: bool = True
    replica_identity: Literal["default", "full"] = "default"

    @field_validator("name")
    @classmethod
    def _qualified(cls, value: str) -> str:
        parts = value.split(".")
        if len(parts) == 1:
            parts = ["public", *parts]
        if len(parts) != 2 or not all(_IDENT.match(part) for part in parts):
            raise ValueError(
                f"table {value!r} must be 'schema.table' or 'table' made of letters, "
                "digits and underscores"
            )
        return ".".join(parts)

    @field_validator("key", "exclude_columns")
    @classmethod
    def _columns(cls, value: list[str]) -> list[str]:
        for column in value:
            if not _IDENT.match(column):
                raise ValueError(f"column {column!r} must be letters, digits and underscores")
        return value

    @model_validator(mode="after")
    def _key_not_excluded(self) -> TableSettings:
        clash = sorted(set(self.key) & set(self.exclude_columns))
        if clash:
            raise ValueError(
                f"table {self.name}: key column(s) {', '.join(clash)} cannot be excluded"
            )
        if self.home_region_column and self.home_region_column in self.exclude_columns:
            raise ValueError(
                f"table {self.name}: home_region_column {self.home_region_column!r} "
                "cannot be excluded"
            )
        if (
            self.home_region_column
            and self.home_region_column not in self.key
            and self.replica_identity != "full"
        ):
            # With the default replica identity a delete carries only the key
            # columns (Debezium fills the rest of the old row with empty values), so
            # the router could not tell which region must forget the row.
            raise ValueError(
                f"table {self.name}: personal data (home_region_column "
                f"{self.home_region_column!r}) needs replica_identity: full, or its deletes "
                "cannot be routed to the home region; add 'replica_identity: full' to the "
                "table (edgefeed connectors apply sets it on the table)"
            )
        return self

    @property
    def schema_name(self) -> str:
        return self.name.split(".")[0]

    @property
    def table_name(self) -> str:
        return self.name.split(".")[1]


class SourceSettings(BaseModel):
    """One Debezium PostgreSQL connector: a set of tables of the source database.

    Attributes:
        name: Short name; the connector is called ``edgefeed-<name>``.
        tables: The captured tables.
        topic_prefix: Prefix of the change topics, ``<prefix>.<schema>.<table>``.
        slot_name: Replication slot (stable per connector); default ``edgefeed_<name>``.
        publication: Publication name; default ``edgefeed_<name>``.
        snapshot_mode: Debezium's ``snapshot.mode``.
        heartbeat_interval_ms: Heartbeat period, so a quiet database does not make
            the slot retain WAL forever.
        poll_interval_ms: How long Debezium waits for more changes before
            handing a batch to Connect; low values mean fresher caches.
        partitions: Partitions of each change topic Connect creates.
        replication_factor: Replication factor of the change topics.
        include_schema: Embed the JSON schema in each event (bigger messages).
        snapshot_chunk_rows: Rows per chunk of an incremental snapshot (Debezium's
            ``incremental.snapshot.chunk.size``): the burst a streamed change may
            wait behind, and the pacer's step.
        snapshot_rows_per_s: The pace of an incremental snapshot that edgefeed
            signals (``features apply``, ``connectors snapshot``), so that a
            backfill leaves the pipeline room for streaming (connectors/pacing.py);
            0: as fast as Debezium reads.
        extra: Further connector options, applied last (expert use).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    tables: list[TableSettings] = Field(min_length=1)
    topic_prefix: str | None = None
    slot_name: str | None = None
    publication: str | None = None
    snapshot_mode: SnapshotMode = "initial"
    heartbeat_interval_ms: int = Field(default=10_000, ge=100)
    poll_interval_ms: int = Field(default=50, ge=1, le=10_000)
    partitions: int = Field(default=1, ge=1)
    replication_factor: int = Field(default=1, ge=1)
    include_schema: bool = False
    snapshot_chunk_rows: int = Field(default=256, ge=16, le=65_536)
    snapshot_rows_per_s: int = Field(default=2_000, ge=0)
    extra: dict[str, str] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not re.match(r"^[a-z][a-z0-9_]{0,40}$", value):
            raise ValueError(
                f"source name {value!r} must be lowercase letters, digits and underscores, "
                "starting with a letter"
            )
        return value

    @field_validator("slot_name")
    @classmethod
    def _slot(cls, value: str | None) -> str | None:
        if value is not None and not _SLOT.match(value):
            raise ValueError(
                f"slot_name {value!r} must be 1-63 lowercase letters, digits or underscores"
            )
        return value

    @model_validator(mode="after")
    def _unique_tables(self) -> SourceSettings:
        names = [table.name for table in self.tables]
        dupes = sorted({name for name in names if names.count(name) > 1})
        if dupes:
            raise ValueError(f"source {self.name}: table(s) {', '.join(dupes)} declared twice")
        return self

    @property
    def connector_name(self) -> str:
        return f"edgefeed-{self.name}"

    @property
    def effective_topic_prefix(self) -> str:
        return self.topic_prefix or f"edgefeed.{self.name}"

    @property
    def effective_slot_name(self) -> str:
        return self.slot_name or f"edgefeed_{self.name}"

    @property
    def effective_publication(self) -> str:
        return self.publication or f"edgefeed_{self.name}"

    def topic_for(self, table: str) -> str:
        """The change topic of ``table`` (``schema.table`` or ``table``)."""
        qualified = table if "." in table else f"public.{table}"
        return f"{self.effective_topic_prefix}.{qualified}"

    def table(self, name: str) -> TableSettings:
        qualified = name if "." in name else f"public.{name}"
        for table in self.tables:
            if table.name == qualified:
                return table
        raise KeyError(qualified)
