"""Debezium PostgreSQL connector configs generated from the settings.

Every default here is one that users otherwise learn the hard way; each is
explained in docs/connectors.md.
"""

from __future__ import annotations

import re

from connectors.settings import DatabaseSettings, SourceSettings

__all__ = [
    "CONNECTOR_CLASS",
    "HEARTBEAT_TABLE",
    "heartbeat_query",
    "notification_topic",
    "render_connector_config",
    "signal_table",
    "worker_provider_properties",
]

CONNECTOR_CLASS = "io.debezium.connector.postgresql.PostgresConnector"
HEARTBEAT_TABLE = "public.edgefeed_heartbeat"
JSON_CONVERTER = "org.apache.kafka.connect.json.JsonConverter"
SIGNAL_TABLE_PREFIX = "public.edgefeed_signal_"


def signal_table(source: SourceSettings) -> str:
    """The source's Debezium signal table (``execute-snapshot`` goes there).

    One per source, not one shared: every connector reads the signals of the
    tables in its publication, and a signal meant for one connector would make
    the others open snapshot windows for tables they do not capture.
    """
    return f"{SIGNAL_TABLE_PREFIX}{source.name}"


def notification_topic(source: SourceSettings) -> str:
    """The topic Debezium's sink notification channel writes snapshot progress to."""
    return f"{source.effective_topic_prefix}.notifications"


_PROVIDERS = "org.apache.kafka.common.config.provider"


def worker_provider_properties(database: DatabaseSettings) -> dict[str, str]:
    """The Connect worker properties for config providers: only what the connector needs.

    The EnvVarConfigProvider may read only the variables the settings name
    (``allowlist.pattern``), the DirectoryConfigProvider only the folders of
    the password files (``allowed.paths``); a provider the settings do not use
    is not configured, and no FileConfigProvider at all. Without these limits
    anyone who may create a connector can read any variable or file of the
    worker through ``${env:..}`` or ``${file:..}`` in a config. Connectors may
    not override their clients' configs either (they could configure providers
    there).
    """
    env, folders = database.provider_references()
    props = {"connector.client.config.override.policy": "None"}
    names: list[str] = []
    if env:
        names.append("env")
        props["config.providers.env.class"] = f"{_PROVIDERS}.EnvVarConfigProvider"
        pattern = "|".join(re.escape(name) for name in sorted(set(env)))
        props["config.providers.env.param.allowlist.pattern"] = f"^({pattern})$"
    if folders:
        names.append("dir")
        props["config.providers.dir.class"] = f"{_PROVIDERS}.DirectoryConfigProvider"
        allowed = ",".join(sorted({str(folder) for folder in folders}))
        props["config.providers.dir.param.allowed.paths"] = allowed
    if names:
        props["config.providers"] = ",".join(names)
    return props


def heartbeat_query(source: SourceSettings) -> str:
    """The statement Debezium runs on each heartbeat: a write to a captured table,
    so the replication slot advances even when the declared tables are quiet."""
    return (
        # source.name is validated to [a-z0-9_], so it is safe inside the literal.
        f"INSERT INTO {HEARTBEAT_TABLE} (source, ts) VALUES ('{source.name}', now()) "  # noqa: S608
        "ON CONFLICT (source) DO UPDATE SET ts = EXCLUDED.ts"
    )


def render_connector_config(database: DatabaseSettings, source: SourceSettings) -> dict[str, str]:
    """The connector config for one source, as Kafka Connect takes it (all strings)."""
    tables = [table.name for table in source.tables]
    excluded = [f"{t.name}.{column}" for t in source.tables for column in t.exclude_columns]
    key_columns = ";".join(f"{t.name}:{','.join(t.key)}" for t in source.tables)
    snapshot_tables = [t.name for t in source.tables if t.snapshot]
    schemas = "true" if source.include_schema else "false"
    config: dict[str, str] = {
        "connector.class": CONNECTOR_CLASS,
        "tasks.max": "1",  # a PostgreSQL connector always runs one task
        "plugin.name": "pgoutput",
        "database.hostname": database.host,
        "database.port": str(database.port),
        "database.user": database.user,
        "database.password": database.connect_password_reference(),
        "database.dbname": database.dbname,
        "topic.prefix": source.effective_topic_prefix,
        "table.include.list": ",".join([*tables, HEARTBEAT_TABLE, signal_table(source)]),
        "message.key.columns": key_columns,
        "slot.name": source.effective_slot_name,
        "publication.name": source.effective_publication,
        "publication.autocreate.mode": "filtered",
        "snapshot.mode": source.snapshot_mode,
        "heartbeat.interval.ms": str(source.heartbeat_interval_ms),
        "heartbeat.action.query": heartbeat_query(source),
        "tombstones.on.delete": "true",
        "skipped.operations": "none",
        "decimal.handling.mode": "string",
        "time.precision.mode": "adaptive_time_microseconds",
        "interval.handling.mode": "string",
        "poll.interval.ms": str(source.poll_interval_ms),
        "max.batch.size": "4096",
        "max.queue.size": "16384",
        "key.converter": JSON_CONVERTER,
        "value.converter": JSON_CONVERTER,
        "key.converter.schemas.enable": schemas,
        "value.converter.schemas.enable": schemas,
        # Incremental snapshots (``edgefeed connectors snapshot``): signals are rows of
        # the signal table, read from the WAL like any change; progress goes to a topic.
        "signal.data.collection": signal_table(source),
        "signal.enabled.channels": "source",
        "incremental.snapshot.chunk.size": str(source.snapshot_chunk_rows),
        "notification.enabled.channels": "sink",
        "notification.sink.topic.name": notification_topic(source),
        "topic.creation.default.partitions": str(source.partitions),
        "topic.creation.default.replication.factor": str(source.replication_factor),
    }
    if excluded:
        config["column.exclude.list"] = ",".join(excluded)
    if snapshot_tables != tables:
        config["snapshot.include.collection.list"] = ",".join(snapshot_tables) or HEARTBEAT_TABLE
    if database.replication is not None:
        # Debezium connects as the replication role; the publication is created
        # by ``edgefeed connectors apply`` as the admin user (the role owns no table).
        config["database.user"] = database.replication.user
        config["database.password"] = database.replication.connect_password_reference()
        config["publication.autocreate.mode"] = "disabled"
    config.update(source.extra)
    return config
