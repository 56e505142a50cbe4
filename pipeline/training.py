"""Point-in-time training sets: for each spine row (an entity id and a read time), the
vector the cache served at that read time, from the same definitions and engine.

"As of" a read time t means: every source change committed at or before t counts, none
committed after it does, in commit order, through the same router (residency, homes,
rows held until their entity's home is known) and the same feature engine
(pipeline.features) the regional workers run; windows are then read at t, as the lookup
client reads a vector's schedule at its read time. A late event (event time before t,
committed after t) is not counted at t: the stream had not seen it. The values are those
a reader at t got once the workers had applied every change committed by t (a reader
during a lag got an older vector; that lag is not reproduced).

What is exact depends on the history given (docs/training.md): changes with their
commit times, in commit order (:func:`changes_from_rows` makes them from the source
tables' current rows). PostgreSQL keeps only the current version of a row: an update
or a delete before the newest one is not in the tables, so a table that is updated in
place is exact only as of its rows' last commits, and a row with no known commit time
is counted from its time column, or else from the start (``notes`` say which).

Memory: the history is held, routed and grouped by entity (as ``edgefeed pipeline
verify`` holds the tables); the spine is read and written in batches, so its size is
not bounded by memory.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from connectors.database import COMMIT_MS
from connectors.settings import TableSettings
from pipeline.envelope import Change, decode_change
from pipeline.exceptions import PipelineError, PoisonEventError, TrainingSetError
from pipeline.features import EntityEngine, EntityState, FeatureEngine
from pipeline.messages import RegionalChange
from pipeline.recompute import debezium_value
from pipeline.routing import Router
from pipeline.settings import EntitySettings
from pipeline.training_columnar import ColumnarHistory, Unsupported

__all__ = [
    "ARROW_TYPES",
    "META_ENTITY",
    "META_NOTES",
    "META_VERSION",
    "TrainingSet",
    "TrainingSetSourceError",
    "changes_from_rows",
    "check_spine",
    "topic_changes",
    "write_training_set",
]

ARROW_TYPES: dict[str, pa.DataType] = {
    "float32": pa.float32(),
    "float64": pa.float64(),
    "int32": pa.int32(),
    "int64": pa.int64(),
    "bool": pa.bool_(),
}
META_VERSION = b"edgefeed.feature_set_version"
META_ENTITY = b"edgefeed.entity"
META_REGION = b"edgefeed.region"
META_AS_OF = b"edgefeed.as_of"
META_NOTES = b"edgefeed.notes"  # JSON list: what in the history is not exact
_UNIT_MS = {"s": None, "ms": 1, "us": 1_000, "ns": 1_000_000}


def changes_from_rows(
    rows: Mapping[str, Iterable[Mapping[str, Any]]],
    time_columns: Mapping[str, str] | None = None,
) -> tuple[list[Change], list[str]]:
    """The source tables' current rows as inserts at their commit times, in commit order.

    Args:
        rows: ``schema.table`` -> its rows (column -> value, as the database returns
            them), each with its commit time in milliseconds under
            :data:`connectors.database.COMMIT_MS` (None or absent: unknown).
        time_columns: ``schema.table`` -> its event-time column: a row without a commit
            time is counted from its event time (exact for an append-only table whose
            rows commit when they happen; a late row counts early).

    Returns:
        The changes, and notes naming the tables whose rows' commit times were unknown.
    """
    time_columns = time_columns or {}
    stamped: list[tuple[int, str, int, dict[str, Any]]] = []
    guessed: dict[str, str] = {}
    for table, table_rows in rows.items():
        column = time_columns.get(table)
        for order, row in enumerate(table_rows):
            commit = row.get(COMMIT_MS)
            after = {c: debezium_value(v) for c, v in row.items() if c != COMMIT_MS}
            if commit is None:
                event = row.get(column) if column else None
                if event is not None:
                    commit = int(event.timestamp() * 1000)
                    guessed.setdefault(table, f"{table}: commit times unknown, taken from {column}")
                else:
                    commit = 0
                    guessed[table] = (
                        f"{table}: commit times unknown, rows counted from the start "
                        "(their current values at every read time)"
                    )
            stamped.append((int(commit), table, order, after))
    stamped.sort(key=lambda s: (s[0], s[1], s[2]))
    changes = [
        Change(table, "c", None, after, lsn, 0, commit)
        for lsn, (commit, table, _, after) in enumerate(stamped, start=1)
    ]
    return changes, sorted(guessed.values())


class TrainingSetSourceError(PipelineError):
    """The history's source (the broker holding the CDC topics) cannot be read.
    Retryable once it is up."""

    retryable = True


async def topic_changes(
    bootstrap: Sequence[str],
    topics: Mapping[str, str],
    options: Mapping[str, Any],
    idle_s: float = 1.0,
) -> tuple[list[Change], list[str]]:
    """Every change in the source tables' Debezium topics, from their start: each
    version of each row with its commit position and time (updates and deletes
    included), as the router read them.

    Args:
        topics: ``schema.table`` -> its change topic.
        options: aiokafka's client options (security).
        idle_s: A topic is read until nothing came for this long (the broker's reported
            end can be the start of its last batch).

    Returns:
        The changes, and notes naming the topics that do not begin with the connector's
        initial snapshot (rows committed before their first record are missing) and
        the records that could not be decoded (dead letters, skipped live too).
    """
    from aiokafka import AIOKafkaConsumer, TopicPartition
    from aiokafka.errors import KafkaError

    changes: list[Change] = []
    notes: list[str] = []
    consumer = AIOKafkaConsumer(
        bootstrap_servers=list(bootstrap),
        client_id="edgefeed-training",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        **dict(options),
    )
    try:
        await asyncio.wait_for(consumer.start(), 30)
    except (KafkaError, OSError, TimeoutError) as exc:
        await consumer.stop()
        raise TrainingSetSourceError(
            f"the broker at {', '.join(bootstrap)} cannot be read ({type(exc).__name__}); "
            "start it, or build from the tables (--source tables)"
        ) from None
    try:
        known = await consumer.topics()
        parts: list[TopicPartition] = []
        for table, topic in sorted(topics.items()):
            partitions = consumer.partitions_for_topic(topic) if topic in known else None
            if not partitions:
                notes.append(f"{table}: topic {topic} does not exist: no history")
                continue
            parts += [TopicPartition(topic, p) for p in sorted(partitions)]
        firsts: dict[TopicPartition, Change] = {}
        skipped: dict[str, int] = {}
        # Read to the ends as of now, and one fetch more (the broker's reported end can
        # be the start of its last batch), or until nothing comes for idle_s: a topic
        # still written does not keep the read going.
        ends: dict[TopicPartition, int] = {}
        if parts:
            consumer.assign(parts)
            await consumer.seek_to_beginning(*parts)
            ends = await consumer.end_offsets(parts)
        behind = {tp for tp in parts if ends.get(tp, 0) > 0}
        rounds_after = 2 if parts else 0
        while behind or rounds_after:
            if not behind:
                rounds_after -= 1
            batch = await consumer.getmany(timeout_ms=int(idle_s * 1000), max_records=5000)
            if not batch:
                break
            for tp, messages in batch.items():
                if messages and messages[-1].offset + 1 >= ends[tp]:
                    behind.discard(tp)
                for message in messages:
                    try:
                        change = decode_change(message.value or b"", offset=message.offset)
                    except PoisonEventError:
                        skipped[tp.topic] = skipped.get(tp.topic, 0) + 1
                        continue
                    if change is not None:
                        firsts.setdefault(tp, change)
                        changes.append(change)
        for table, topic in sorted(topics.items()):
            begun = [c for tp, c in firsts.items() if tp.topic == topic]
            if any(c.op != "r" or c.snapshot in (None, "incremental") for c in begun):
                notes.append(
                    f"{table}: topic {topic} does not begin with the connector's initial "
                    "snapshot (retention passed, or the connector took no snapshot: "
                    "snapshot_mode no_data): rows committed before its first record, if the "
                    "table held any then, are missing"
                )
            if skipped.get(topic):
                notes.append(f"{table}: {skipped[topic]} undecodable records skipped")
    finally:
        with suppress(Exception):
            await asyncio.wait_for(consumer.stop(), 10)
    return changes, notes


class TrainingSet:
    """The history of one entity type, routed and grouped by entity, and the vectors it
    gives at any read time."""

    def __init__(
        self,
        entities: Sequence[EntitySettings],
        tables: Mapping[str, TableSettings],
        regions: Sequence[str],
        entity: str,
        changes: Iterable[Change],
        *,
        region: str | None = None,
        version: int | None = None,
        notes: Sequence[str] = (),
    ) -> None:
        """Args:
        changes: The source's changes with their commit times (any order: they are
            replayed in commit order).
        region: The region whose vectors to give: needed for a shared entity with
            several regions (each region counts its own rows); a personal entity lives
            in its home region (default: wherever it lives).
        version: The feature-set version the caller expects (None: the settings').

        Raises:
            TrainingSetError: an entity type, region or version the settings do not have.
        """
        declared = {e.name: e for e in entities}
        if entity not in declared:
            raise TrainingSetError(
                f"entity type {entity!r} is not declared; declared: {', '.join(declared)}"
            )
        self.settings = declared[entity]
        current = self.settings.version
        if version is not None and version != current:
            raise TrainingSetError(
                f"feature-set version {version} of {entity!r} no longer exists: the settings "
                f"define version {current} only; build with --version {current}, or with the "
                f"settings that defined version {version}"
            )
        if region is not None and region not in regions:
            raise TrainingSetError(f"region {region!r} is not one of: {', '.join(regions)}")
        if region is None and not self.settings.personal and len(regions) > 1:
            raise TrainingSetError(
                f"{entity!r} is shared: each region counts its own rows, so its vectors "
                f"differ by region; name one (--region, one of: {', '.join(regions)})"
            )
        self.entity = entity
        self.region = region
        self.notes = list(notes)
        self.engine: EntityEngine = FeatureEngine(entities, tables).engine(entity)
        self.features = self.engine.schema.features
        router = Router(entities, tables, regions)
        # Entity id (as text) -> (the time the stream routed it, the change), in order.
        self._history: dict[str, list[tuple[int, RegionalChange]]] = {}
        # The states the last spine batch left (entity -> state, changes applied, last
        # read time): a spine sorted by entity and time goes on from them, not from the
        # start of each history. Only the last batch's entities are kept.
        self._carried: dict[str, tuple[EntityState | None, int, int]] = {}
        self._carrying: dict[str, tuple[EntityState | None, int, int]] = {}
        self._columnar: ColumnarHistory | None = None
        # Why the columnar engine does not compute this entity's features (None: it does).
        self.replay_reason: str | None = None
        for change in sorted(changes, key=lambda c: (c.commit_ms, c.lsn, c.seq)):
            try:
                routed = router.route(change)
            except PoisonEventError:
                continue  # the live pipeline dead-letters it too
            for message in routed:
                body = message.change
                if body.entity != entity or (region is not None and message.region != region):
                    continue
                self._history.setdefault(str(body.entity_id), []).append((change.commit_ms, body))

    def metadata(self) -> dict[bytes, bytes]:
        """The file metadata: entity, feature-set version, region, semantics, notes."""
        return {
            META_ENTITY: self.entity.encode(),
            META_VERSION: str(self.settings.version).encode(),
            META_REGION: (self.region or "home").encode(),
            META_AS_OF: b"commit",
            META_NOTES: json.dumps(self.notes).encode(),
        }

    def vectors(self, entity_id: str | int, times_ms: Sequence[int]) -> list[dict[str, Any] | None]:
        """The vector (None: not served) of one entity at each read time (ms, ascending)."""
        key = str(entity_id)
        history = self._history.get(key, [])
        engine = self.engine
        state: EntityState | None = None
        applied = 0
        carried = self._carried.get(key)
        if carried is not None and times_ms and times_ms[0] >= carried[2]:
            state, applied, _ = carried  # on from the previous batch's last read time
        out: list[dict[str, Any] | None] = []
        start = 0
        while start < len(times_ms):
            while applied < len(history) and history[applied][0] <= times_ms[start]:
                with suppress(PoisonEventError):  # dead-lettered live: not counted
                    state, _ = engine.apply(state, history[applied][1])
                applied += 1
            # The read times before the next change are read in one pass.
            end = start + 1
            upcoming = history[applied][0] if applied < len(history) else None
            while end < len(times_ms) and (upcoming is None or times_ms[end] < upcoming):
                end += 1
            if state is None or not engine.served(state):
                out.extend([None] * (end - start))
            else:
                out.extend(engine.vectors_at(state, times_ms[start:end]))
            start = end
        if times_ms:
            self._carrying[key] = (state, applied, times_ms[-1])
        return out

    def output_schema(self, spine: pa.Schema, entity_column: str, time_column: str) -> pa.Schema:
        """The spine's columns, then one per feature, typed as the feature set declares.

        Raises:
            TrainingSetError: the spine lacks a column, has naive timestamps, or has a
                column named like a feature.
        """
        check_spine(spine, entity_column, time_column)
        names = spine.names
        clashes = [f.name for f in self.features if f.name in names]
        if clashes:
            raise TrainingSetError(
                f"spine columns {', '.join(clashes)} are named like features of "
                f"{self.entity!r}; rename them"
            )
        fields = [*spine, *(pa.field(f.name, ARROW_TYPES[f.dtype]) for f in self.features)]
        return pa.schema(fields, metadata=self.metadata())

    def columnar(self) -> ColumnarHistory | None:
        """The history as row-version intervals (pipeline.training_columnar), built on
        first use; None where a feature is not computed there (``replay_reason``)."""
        if self._columnar is None and self.replay_reason is None:
            try:
                self._columnar = ColumnarHistory(self.engine, self._history)
            except Unsupported as exc:
                self.replay_reason = str(exc)
        return self._columnar

    def batches(
        self,
        spine: Iterable[pa.RecordBatch],
        entity_column: str,
        time_column: str,
        schema: pa.Schema | None = None,
        *,
        replay: bool = False,
    ) -> Iterator[pa.RecordBatch]:
        """Each spine batch with the features as of its rows' read times, row for row.

        Args:
            replay: Replay each entity's history through the engine per batch (the
                reference the columnar engine is tested against; much slower).
        """
        columnar = None if replay else self.columnar()
        for batch in spine:
            out = schema or self.output_schema(batch.schema, entity_column, time_column)
            schema = out
            if columnar is None:
                yield self._replayed(batch, entity_column, time_column, out)
                continue
            codes = self._codes(batch, entity_column)
            times = _millis_array(batch, time_column)
            yield pa.RecordBatch.from_arrays(
                [*batch.columns, *columnar.columns(codes, times)], schema=out
            )

    def _codes(self, batch: pa.RecordBatch, column: str) -> np.ndarray:
        """Each row's entity as its index in the history (-1: none), matched as text."""
        values = batch.column(column)
        _no_nulls(values, column)
        known = self._columnar.ids if self._columnar is not None else []
        kind = values.type
        if pa.types.is_integer(kind) or pa.types.is_string(kind) or pa.types.is_large_string(kind):
            text = pc.cast(values, pa.string())  # integers as Python writes them
        else:
            text = pa.array([str(v) for v in values.to_pylist()], pa.string())
        found = pc.index_in(text, value_set=pa.array(known, pa.string()))
        return np.asarray(found.fill_null(-1).to_numpy(zero_copy_only=False), np.int64)

    def _replayed(
        self, batch: pa.RecordBatch, entity_column: str, time_column: str, out: pa.Schema
    ) -> pa.RecordBatch:
        """The reference path: each entity's history replayed through the engine."""
        ids = _required(batch, entity_column)
        times = _millis(batch, time_column)
        by_id: dict[str, list[tuple[int, int]]] = {}
        for row, (entity_id, at) in enumerate(zip(ids, times, strict=True)):
            by_id.setdefault(str(entity_id), []).append((at, row))
        found: list[dict[str, Any] | None] = [None] * batch.num_rows
        self._carried, self._carrying = self._carrying, {}
        for entity_id, wanted in by_id.items():
            wanted.sort()
            for (_, row), vector in zip(
                wanted, self.vectors(entity_id, [at for at, _ in wanted]), strict=True
            ):
                found[row] = vector
        columns = [
            pa.array([v.get(f.name) if v else None for v in found], ARROW_TYPES[f.dtype])
            for f in self.features
        ]
        return pa.RecordBatch.from_arrays([*batch.columns, *columns], schema=out)


def check_spine(spine: pa.Schema, entity_column: str, time_column: str) -> None:
    """Refuse a spine without its entity or time column, or with naive read times.

    Raises:
        TrainingSetError: naming the column and the fix.
    """
    names = spine.names
    for role, column in (("entity", entity_column), ("time", time_column)):
        if column not in names:
            raise TrainingSetError(
                f"the spine has no {role} column {column!r} (its columns: "
                f"{', '.join(names)}); name it with --{role}-column"
            )
    kind = spine.field(time_column).type
    if not pa.types.is_timestamp(kind) or kind.tz is None:
        raise TrainingSetError(
            f"spine column {time_column!r} is {kind}, not a timestamp with a time zone: "
            "read times must be instants (e.g. pandas' tz_localize('UTC'), or "
            "pa.timestamp('us', tz='UTC'))"
        )


def _no_nulls(values: pa.Array, column: str) -> None:
    if values.null_count:
        first = values.is_null().to_pylist().index(True)
        raise TrainingSetError(
            f"spine column {column!r} is null in {values.null_count} rows (the first: row "
            f"{first} of its batch); every row needs an entity id and a read time"
        )


def _required(batch: pa.RecordBatch, column: str) -> list[Any]:
    values = batch.column(column)
    _no_nulls(values, column)
    return list(values.to_pylist())


def _millis_array(batch: pa.RecordBatch, column: str) -> np.ndarray:
    """A timestamp column as integer milliseconds since the epoch (rounded down)."""
    values = batch.column(column)
    _no_nulls(values, column)
    raw = np.asarray(values.cast(pa.int64()).to_numpy(zero_copy_only=False), np.int64)
    unit = values.type.unit
    if unit == "s":
        return raw * 1000
    return raw // (_UNIT_MS[unit] or 1)


def _millis(batch: pa.RecordBatch, column: str) -> list[int]:
    """A timestamp column as integer milliseconds since the epoch (rounded down)."""
    _required(batch, column)
    values = batch.column(column)
    unit = values.type.unit
    raw = values.cast(pa.int64()).to_pylist()
    if unit == "s":
        return [v * 1000 for v in raw]
    return [v // _UNIT_MS[unit] for v in raw]


def write_training_set(
    training: TrainingSet,
    spine: str | Path,
    out: str | Path,
    *,
    entity_column: str,
    time_column: str,
    batch_rows: int = 65_536,
) -> int:
    """Read the spine Parquet file in batches, write the training set beside ``out`` under
    a temporary name, batch by batch, and rename it to ``out``; the rows written.

    Raises:
        TrainingSetError: the spine lacks a column or has naive timestamps.
        FileNotFoundError: no spine file.
    """
    source = pq.ParquetFile(spine)
    schema = training.output_schema(source.schema_arrow, entity_column, time_column)
    target = Path(out)
    partial = target.with_name(f".{target.name}.partial")
    written = 0
    try:
        with pq.ParquetWriter(partial, schema) as writer:
            for batch in training.batches(
                source.iter_batches(batch_size=batch_rows), entity_column, time_column, schema
            ):
                writer.write_batch(batch)
                written += batch.num_rows
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return written
