"""The vectors each region's cache should hold, recomputed from the source tables.

The oracle of ``edgefeed pipeline verify`` and of the fault tests: the current rows
of every table that feeds an entity go through the same router (residency) and the
same feature engine as the live pipeline, once, in key order. After any sequence of
crashes, replays and redeliveries, the live caches must equal this.

What it cannot see: commit times (a row's event time falls back to the commit time
only where an entity declares no ``time_columns`` for a table; aggregates over such
tables are reported as not verifiable), and deleted rows (they are gone from the
tables, as they should be from the caches).
"""

from __future__ import annotations

import base64
import math
import time as time_module
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time
from decimal import Decimal
from typing import Any

from connectors.settings import TableSettings
from pipeline.envelope import Change
from pipeline.exceptions import PoisonEventError
from pipeline.features import EntityState, FeatureEngine
from pipeline.routing import Router
from pipeline.settings import EntitySettings

__all__ = ["Mismatch", "RegionExpectation", "compare", "debezium_value", "expected_vectors"]


def debezium_value(value: Any) -> Any:
    """A column value as Debezium's JSON converter writes it with edgefeed's connector
    settings (decimals as strings, times as ISO 8601, bytes as base64)."""
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value.isoformat()
    if isinstance(value, date | time):
        return value.isoformat()
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(value)).decode()
    return value


@dataclass(slots=True)
class RegionExpectation:
    """What one region's cache should hold: entity type -> id text -> vector."""

    vectors: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    unverifiable: set[str] = field(default_factory=set)  # entity.feature names


def expected_vectors(
    entities: Sequence[EntitySettings],
    tables: Mapping[str, TableSettings],
    regions: Sequence[str],
    rows: Mapping[str, Iterable[Mapping[str, Any]]],
    at_ms: int | None = None,
) -> dict[str, RegionExpectation]:
    """The vectors per region, from the current ``rows`` of each table, with windows
    read at ``at_ms`` (default: now).

    Args:
        rows: ``schema.table`` -> its rows (column -> value, as the database returns
            them; converted with :func:`debezium_value`).
    """
    if at_ms is None:
        at_ms = int(time_module.time() * 1000)
    router = Router(entities, tables, regions)
    engines = {region: FeatureEngine(entities, tables) for region in regions}
    states: dict[str, dict[str, EntityState]] = {region: {} for region in regions}
    ids: dict[str, dict[str, Any]] = {region: {} for region in regions}
    lsn = 0
    # The entities' own personal rows first: they set the homes the router routes
    # the entities' other personal rows by (pipeline.homes).
    order = sorted(rows, key=lambda table: (table not in router.home_tables, table))
    for table in order:
        for row in rows[table]:
            lsn += 1
            after = {column: debezium_value(value) for column, value in row.items()}
            change = Change(table, "r", None, after, lsn, 0, 0)
            try:
                routed = router.route(change)
            except PoisonEventError:
                continue  # the live pipeline dead-letters it too
            for message in routed:
                key = message.key or ""
                engine = engines[message.region].engine(message.change.entity)
                try:
                    state, changed = engine.apply(states[message.region].get(key), message.change)
                except PoisonEventError:
                    continue
                if changed:
                    states[message.region][key] = state
                    ids[message.region][key] = message.change.entity_id
    result: dict[str, RegionExpectation] = {}
    for region in regions:
        expectation = RegionExpectation()
        for entity in entities:
            for aggregate in entity.aggregates:
                if aggregate.table not in entity.time_columns:
                    expectation.unverifiable.update(
                        f"{entity.name}.{name}" for name in aggregate.feature_names
                    )
        for key, state in states[region].items():
            entity_type = key.split(":", 1)[0]
            op = engines[region].engine(entity_type).write_op(ids[region][key], state, at_ms)
            values = getattr(op, "values", None)
            if values is None:
                continue
            expectation.vectors.setdefault(entity_type, {})[str(ids[region][key])] = dict(values)
        result[region] = expectation
    return result


@dataclass(frozen=True, slots=True)
class Mismatch:
    """One difference between a region's cache and the recomputation."""

    region: str
    entity: str
    entity_id: str
    what: str  # "missing", "unexpected", or the feature name
    expected: Any = None
    found: Any = None


def _same(expected: Any, found: Any) -> bool:
    if expected is None or found is None:
        return expected is None and found is None
    if isinstance(expected, float) or isinstance(found, float):
        try:
            return math.isclose(float(expected), float(found), rel_tol=1e-6, abs_tol=1e-9)
        except (TypeError, ValueError):
            return False
    return bool(expected == found)


def compare(
    region: str,
    expectation: RegionExpectation,
    found: Mapping[str, Mapping[str, Mapping[str, Any] | None]],
) -> list[Mismatch]:
    """The differences between ``expectation`` and what the cache holds.

    Args:
        found: entity type -> id text -> vector read from the cache (None: no value),
            for every id expected and every id the cache holds.
    """
    mismatches: list[Mismatch] = []
    for entity, vectors in sorted(found.items()):
        expected_of = expectation.vectors.get(entity, {})
        for entity_id, vector in sorted(vectors.items()):
            expected = expected_of.get(entity_id)
            if expected is None and vector is not None:
                mismatches.append(Mismatch(region, entity, entity_id, "unexpected"))
                continue
            if expected is not None and vector is None:
                mismatches.append(Mismatch(region, entity, entity_id, "missing"))
                continue
            if expected is None or vector is None:
                continue
            for name, value in expected.items():
                if f"{entity}.{name}" in expectation.unverifiable:
                    continue
                if not _same(value, vector.get(name)):
                    mismatches.append(
                        Mismatch(region, entity, entity_id, name, value, vector.get(name))
                    )
    return mismatches
