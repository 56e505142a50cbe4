"""``edgefeed features history``: a point-in-time training set from the source database
(pipeline.training; docs/training.md)."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from connectors.database import read_rows
from edgefeed.settings import EdgefeedSettings
from pipeline.exceptions import TrainingSetError
from pipeline.training import (
    TrainingSet,
    changes_from_rows,
    check_spine,
    topic_changes,
    write_training_set,
)

__all__ = ["HistoryReport", "build_training_set", "entity_column_of", "source_history"]


@dataclass(frozen=True, slots=True)
class HistoryReport:
    """What ``features history`` wrote."""

    out: Path
    rows: int
    entity: str
    version: int
    notes: list[str]


def entity_column_of(settings: EdgefeedSettings, entity: str) -> str:
    """The spine's default entity column: the entity's id column in its tables
    (``user_id`` for the demo's users)."""
    for declared in settings.entities:
        if declared.name == entity:
            return Counter(declared.tables.values()).most_common(1)[0][0]
    names = ", ".join(e.name for e in settings.entities)
    raise TrainingSetError(f"entity type {entity!r} is not declared; declared: {names}")


def source_history(
    settings: EdgefeedSettings,
    entity: str,
    *,
    region: str | None = None,
    version: int | None = None,
    source: str = "tables",
) -> TrainingSet:
    """The history of ``entity``: with ``source="tables"``, the source tables' current
    rows and their commit times (``track_commit_timestamp``; where unknown, the
    entity's time columns); with ``"topics"``, every change in the tables' Debezium
    topics (updates and deletes included, as far back as the topics reach).

    Raises:
        TrainingSetError: an undeclared entity, region or version.
        SourceValidationError: the database cannot be reached.
        TrainingSetSourceError: the broker cannot be reached (``topics``).
    """
    entity_column_of(settings, entity)
    tables = settings.tables()
    fed = sorted({table for e in settings.entities for table in e.tables})
    if source == "topics":
        topics = {table: settings.topic_of_table()[table] for table in fed}
        changes, notes = asyncio.run(
            topic_changes(
                settings.kafka.bootstrap_servers,
                topics,
                settings.kafka.security.aiokafka_options(),
            )
        )
    elif source == "tables":
        rows = read_rows(settings.database, [tables[name] for name in fed], commit_times=True)
        time_columns = {t: c for e in settings.entities for t, c in e.time_columns.items()}
        changes, notes = changes_from_rows(rows, time_columns)
    else:
        raise TrainingSetError(f"source {source!r} is not one of: tables, topics")
    return TrainingSet(
        settings.entities,
        tables,
        settings.region_names,
        entity,
        changes,
        region=region,
        version=version,
        notes=notes,
    )


def build_training_set(
    settings: EdgefeedSettings,
    entity: str,
    spine: Path,
    out: Path,
    *,
    entity_column: str | None = None,
    time_column: str = "timestamp",
    region: str | None = None,
    version: int | None = None,
    source: str = "tables",
    batch_rows: int = 65_536,
) -> HistoryReport:
    """Write the training set of ``spine`` to ``out`` (see :func:`source_history`).

    Raises:
        TrainingSetError: a bad spine, or an undeclared entity, region or version.
        SourceValidationError: the database cannot be reached.
    """
    if not spine.is_file():
        raise TrainingSetError(f"spine {spine} is not a file; give a Parquet file (--spine)")
    column = entity_column or entity_column_of(settings, entity)
    try:
        schema = pq.read_schema(spine)
    except (pa.ArrowInvalid, OSError) as exc:
        raise TrainingSetError(f"spine {spine} is not a Parquet file ({exc})") from None
    check_spine(schema, column, time_column)  # before the database is read
    training = source_history(settings, entity, region=region, version=version, source=source)
    rows = write_training_set(
        training,
        spine,
        out,
        entity_column=column,
        time_column=time_column,
        batch_rows=batch_rows,
    )
    return HistoryReport(out, rows, entity, training.settings.version, training.notes)
