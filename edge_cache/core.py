"""The lookup logic that needs no I/O, shared by the sync and async clients.

:class:`LookupCore` validates a call, resolves feature names to positions once
per feature list, picks the regions allowed to serve it (residency), assembles
the result and keeps the metrics. The clients in :mod:`edge_cache.client` only
move bytes.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any, NamedTuple

import numpy as np

from edge_cache.exceptions import (
    ConfigError,
    InvalidValueError,
    RegionUnavailableError,
    UnknownEntityError,
    UnknownFeatureError,
)
from edge_cache.layout import Decoded, KeyLayout, RecordReader
from edge_cache.metrics import STATS
from edge_cache.result import FeatureVectors, Projection, build_vectors
from edge_cache.schema import FeatureSchema
from edge_cache.settings import RegionSettings

__all__ = ["LookupCore", "Plan"]

_MAX_PROJECTIONS = 1024


class Plan(NamedTuple):  # a NamedTuple: built on every call, and cheaper than a dataclass
    schema: FeatureSchema
    reader: RecordReader
    projection: Projection
    ids: tuple[Any, ...]
    keys: list[str]
    max_staleness_us: int | None


def _seconds(value: float | timedelta | None, what: str) -> float | None:
    if value is None:
        return None
    try:
        seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if not seconds >= 0:
        raise InvalidValueError(
            f"{what}={value!r} must be a non-negative number of seconds or a timedelta"
        )
    return seconds


class LookupCore:
    """Everything a lookup does except I/O (shared by the sync and async clients).

    Args:
        region: The client's home region (it reads there first).
        regions: Every region's settings (at least the home region and its failovers).
        schemas: Schemas of the entity types this client reads.
        layout: Key layout; must match the writer's.
        max_staleness: Default staleness bound of a call that gives none.
    """

    def __init__(
        self,
        region: str,
        regions: Iterable[RegionSettings],
        schemas: Iterable[FeatureSchema],
        *,
        layout: KeyLayout | None = None,
        max_staleness: float | timedelta | None = None,
    ) -> None:
        default = _seconds(max_staleness, "max_staleness")
        self.default_staleness_us = None if default is None else round(default * 1_000_000)
        self.regions: dict[str, RegionSettings] = {r.name: r for r in regions}
        if region not in self.regions:
            raise ConfigError(
                f"region {region!r} not in regions: {', '.join(self.regions) or '(none)'}"
            )
        self.home = self.regions[region]
        for name in self.home.failover:
            if name not in self.regions:
                raise ConfigError(
                    f"region {region!r} fails over to {name!r}, which is not among the regions "
                    f"given: {', '.join(self.regions)}"
                )
        self.layout = layout or KeyLayout()
        self.readers: dict[str, RecordReader] = {}
        for schema in schemas:
            if schema.entity in self.readers:
                raise ConfigError(f"two schemas given for entity type {schema.entity!r}")
            self.readers[schema.entity] = RecordReader(schema, self.layout)
        if not self.readers:
            raise ConfigError("a FeatureClient needs at least one FeatureSchema")
        self._projections: dict[tuple[str, tuple[str, ...] | None], Projection] = {}
        self._routes: dict[bool, tuple[list[str], list[tuple[str, str]]]] = {}
        for personal in (False, True):
            self._routes[personal] = self._route(personal)

    def _route(self, personal: bool) -> tuple[list[str], list[tuple[str, str]]]:
        home = self.home
        allowed = [home.name]
        refused: list[tuple[str, str]] = []
        for name in home.failover:
            zone = self.regions[name].residency_zone
            if personal and zone != home.residency_zone:
                refused.append(
                    (
                        name,
                        f"not tried: zone {zone!r} is outside residency zone "
                        f"{home.residency_zone!r} of personal data",
                    )
                )
            else:
                allowed.append(name)
        return allowed, refused

    def route(self, schema: FeatureSchema) -> tuple[list[str], list[tuple[str, str]]]:
        """Regions allowed to serve ``schema``, in order, and those refused for residency."""
        return self._routes[schema.personal]

    def projection(self, entity: str, features: Sequence[str] | None) -> Projection:
        """The resolved feature list (cached: names are resolved once per list).

        Raises:
            UnknownEntityError: no schema for ``entity``.
            UnknownFeatureError: a name is not in the schema; the message lists the valid ones.
        """
        if isinstance(features, str):
            features = (features,)
        key = (entity, tuple(features) if features is not None else None)
        found = self._projections.get(key)
        if found is not None:
            return found
        reader = self.reader(entity)
        schema = reader.schema
        if features is None:
            names = schema.names
        else:
            names = tuple(features)
            unknown = [n for n in names if schema.position(n) is None]
            if unknown:
                raise UnknownFeatureError(
                    f"unknown feature(s) {', '.join(map(repr, unknown))} for entity type "
                    f"{entity!r} (schema v{schema.version}); valid: {', '.join(schema.names)}"
                )
        positions = np.asarray([schema.position(n) for n in names], dtype=np.intp)
        projection = Projection(reader.record, names, positions)
        if len(self._projections) >= _MAX_PROJECTIONS:
            self._projections.clear()
        self._projections[key] = projection
        return projection

    def reader(self, entity: str) -> RecordReader:
        """The value reader of ``entity`` (raises :class:`UnknownEntityError`)."""
        reader = self.readers.get(entity)
        if reader is None:
            raise UnknownEntityError(
                f"unknown entity type {entity!r}; this client has schemas for: "
                f"{', '.join(sorted(self.readers))}"
            )
        return reader

    def plan(
        self,
        entity: str,
        ids: Sequence[str | int] | np.ndarray[Any, Any],
        features: Sequence[str] | None,
        max_staleness: float | timedelta | None,
    ) -> Plan:
        """Validate a call and resolve everything it needs but I/O."""
        reader = self.reader(entity)
        projection = self.projection(entity, features)
        if isinstance(ids, str | bytes):
            raise InvalidValueError(
                f"ids must be a sequence of ids, got the single value {ids!r}; pass [{ids!r}]"
            )
        id_tuple = tuple(ids.tolist()) if isinstance(ids, np.ndarray) else tuple(ids)
        if max_staleness is None:
            staleness_us = self.default_staleness_us
        else:
            staleness = _seconds(max_staleness, "max_staleness")
            staleness_us = None if staleness is None else round(staleness * 1_000_000)
        return Plan(
            reader.schema,
            reader,
            projection,
            id_tuple,
            self.layout.keys(entity, id_tuple),
            staleness_us,
        )

    def assemble(self, plan: Plan, region: str, decoded: Decoded, near_hits: int) -> FeatureVectors:
        """The result of a call from the values ``region`` returned."""
        return build_vectors(
            entity=plan.schema.entity,
            ids=plan.ids,
            region=region,
            projection=plan.projection,
            decoded=decoded,
            now_us=time.time_ns() // 1000 if plan.max_staleness_us is not None else 0,
            max_staleness_us=plan.max_staleness_us,
            near_hits=near_hits,
        )

    def record(self, plan: Plan, result: FeatureVectors, started: float) -> None:
        """Update the metrics of one served call."""
        entity = plan.schema.entity
        n = len(plan.ids)
        found = len(result._rows)
        stale = int(result.stale.sum()) if plan.max_staleness_us is not None else 0
        home = self.home.name
        STATS.lookup(
            home,
            entity,
            time.perf_counter() - started,
            found,
            n - found - stale,
            stale,
            result.near_hits,
        )
        if result.region != home:
            STATS.fallback(home, result.region, entity)

    def failed(self, region: str, reason: str) -> None:
        """Count a failed (or skipped) read from ``region``."""
        STATS.failure(region, reason)

    def unavailable(
        self, plan: Plan, attempts: list[tuple[str, str]], refused: list[tuple[str, str]]
    ) -> RegionUnavailableError:
        """The error of a call no region could serve, naming every region and why."""
        schema = plan.schema
        every = tuple(attempts + refused)
        kind = (
            f"personal entity type {schema.entity!r} (residency zone {self.home.residency_zone!r})"
            if schema.personal
            else f"entity type {schema.entity!r}"
        )
        detail = "; ".join(f"{name}: {reason}" for name, reason in every)
        return RegionUnavailableError(
            f"no region could serve {kind} for home region {self.home.name!r}: {detail}",
            self.home.name,
            every,
        )
