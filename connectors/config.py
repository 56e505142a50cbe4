"""Debezium PostgreSQL connector configs generated from the settings.

Every default here is one that users otherwise learn the hard way; each is
explained in docs/connectors.md.
"""

from __future__ import annotations

from connectors.settings import DatabaseSettings, SourceSettings

__all__ = [
    "CONNECTOR_CLASS",
    "HEARTBEAT_TABLE",
    "heartbeat_query",
    "render_connector_config",
]

CONNECTOR_CLASS = "io.debezium.connector.postgresql.PostgresConnector"
HEARTBEAT_TABLE = "public.edgefeed_heartbeat"
JSON_CONVERTER = "org.apache.kafka.connect.json.JsonConverter"


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
        "table.include.list": ",".join([*tables, HEARTBEAT_TABLE]),
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
        "topic.creation.default.partitions": str(source.partitions),
        "topic.creation.default.replication.factor": str(source.replication_factor),
    }
    if excluded:
        config["column.exclude.list"] = ",".join(excluded)
    if snapshot_tables != tables:
        config["snapshot.include.collection.list"] = ",".join(snapshot_tables) or HEARTBEAT_TABLE
    config.update(source.extra)
    return config
