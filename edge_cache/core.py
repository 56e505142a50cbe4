"""The lookup logic that needs no I/O, shared by the sync and async clients.

:class:`LookupCore` validates a call, resolves feature names to positions once
per feature list, picks the regions allowed to serve it (residency), runs the
failover (breakers, near cache, schema registry reads), assembles the result
and keeps the metrics. :meth:`LookupCore.lookup` is a generator that yields the
reads it needs (:class:`Read`, :class:`ReadSchema`) and is sent their answers
(or a :class:`Failure`): the clients in :mod:`edge_cache.client` only execute
those steps, so the sync and async faces share one failover loop.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from edge_cache.exceptions import (
    ConfigError,
    InvalidValueError,
    LookupOverloadedError,
    LookupTimeoutError,
    RegionUnavailableError,
    UnknownEntityError,
    UnknownFeatureError,
)
from edge_cache.layout import Decoded, KeyLayout, RecordReader
from edge_cache.metrics import LookupStats
from edge_cache.result import FeatureVectors, Projection, build_vectors
from edge_cache.schema import FeatureSchema
from edge_cache.settings import RegionSettings

if TYPE_CHECKING:
    from edge_cache.breaker import CircuitBreaker
    from edge_cache.nearcache import NearCache

__all__ = [
    "Failure",
    "Late",
    "Lookup",
    "LookupCore",
    "LookupRun",
    "Plan",
    "Read",
    "ReadRebuilding",
    "ReadSchema",
    "Reply",
    "Step",
]

_MAX_PROJECTIONS = 1024
log = logging.getLogger(__name__)


class Plan(NamedTuple):  # a NamedTuple: built on every call, and cheaper than a dataclass
    schema: FeatureSchema
    reader: RecordReader
    projection: Projection
    ids: tuple[Any, ...]
    keys: list[str]
    max_staleness_us: int | None
    at_us: int  # the read time: windows are read as of it (default: the call's start)


@dataclass(frozen=True, slots=True)
class Read:
    """A step of a lookup: ``MGET keys`` from ``region``; answer: the values (None:
    absent) and how many of the keys exist (``EXISTS``), or None if unknown.

    Attributes:
        region: Region to read from.
        keys: Keys to read.
        tracked: Read through a connection tracked into the near cache's invalidation
            connection (the values will be cached in the process).
    """

    region: str
    keys: list[str]
    tracked: bool = False


@dataclass(frozen=True, slots=True)
class ReadSchema:
    """A step of a lookup: ``GET key`` (a schema registry document) from ``region``."""

    region: str
    key: str


@dataclass(frozen=True, slots=True)
class ReadTypes:
    """A step of a lookup: ``TYPE`` of each key (pipelined) in ``region``; answer: the
    type names. Asked only when a read found keys that exist but hold no string."""

    region: str
    keys: list[str]


@dataclass(frozen=True, slots=True)
class ReadRebuilding:
    """A step of a lookup: ``HGETALL`` of the region's list of history rebuilds in
    progress (``ef:rebuilding``); asked at most every :data:`REBUILD_CHECK_S` per region,
    after a successful read; answer: the hash (a Failure keeps what was known)."""

    region: str
    key: str


REBUILD_CHECK_S = 1.0  # how often a client asks a region which entity types are rebuilding


@dataclass(frozen=True, slots=True)
class Failure:
    """What a face sends back when a step's read failed (timeout, connection).

    Attributes:
        metric: Reason label of ``edgefeed_lookup_region_failures_total``.
        reason: The reason as the error names it (``timed out after 0.25 s``).
    """

    metric: str
    reason: str


@dataclass(frozen=True, slots=True)
class Late(Failure):
    """A Failure that is not the region's: the step's deadline passed while the region
    kept answering other reads (the asyncio face's event loop was behind). A data read
    that ends so is shed (:class:`LookupOverloadedError`): no breaker, no failure
    metric, no failover.

    Attributes:
        retry_after_s: When a retry is likely to be served.
    """

    retry_after_s: float = 0.0


Step = Read | ReadSchema | ReadTypes | ReadRebuilding
#: What a face sends back for a step, or a Failure: for a Read, the values and how many
#: of the keys exist (None when the face cannot tell: a cluster); for a ReadSchema, the
#: document; for a ReadTypes, the type names.
Reply = (
    tuple[list[bytes | None], int | None] | list[str] | bytes | dict[bytes, bytes] | Failure | None
)
#: The generator :meth:`LookupCore.lookup` returns: yields steps, is sent their answers.
Lookup = Generator[Step, Reply, FeatureVectors]


class LookupRun:
    """Drives the generator of :meth:`LookupCore.lookup` for a face::

        step = run.send(None)
        while step is not None:
            step = run.send(execute(step))   # or: await execute(step)
        return run.result

    Raises (from :meth:`send`): whatever the lookup raises (RegionUnavailableError...).
    """

    __slots__ = ("_result", "_steps")

    def __init__(self, steps: Lookup) -> None:
        self._steps = steps
        self._result: FeatureVectors | None = None

    def send(self, reply: Reply) -> Step | None:
        """Answer the last step (None at first); the next step, or None when done."""
        try:
            return self._steps.send(reply)
        except StopIteration as done:
            self._result = done.value
            return None

    @property
    def result(self) -> FeatureVectors:
        """The call's result, once :meth:`send` returned None."""
        if self._result is None:
            raise RuntimeError("the lookup has not finished: send() has steps left")
        return self._result


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


def _read_time_us(at: datetime | float) -> int:
    """A read time (aware datetime, or seconds since the epoch) in microseconds."""
    if isinstance(at, datetime):
        if at.tzinfo is None:
            raise InvalidValueError(
                f"at={at!r} is a naive datetime; give a timezone (datetime.now(UTC))"
            )
        return round(at.timestamp() * 1_000_000)
    if isinstance(at, bool) or not isinstance(at, int | float) or not math.isfinite(at):
        raise InvalidValueError(f"at={at!r} must be an aware datetime or seconds since the epoch")
    return round(at * 1_000_000)


class LookupCore:
    """Everything a lookup does except I/O (shared by the sync and async clients).

    Args:
        region: The client's home region (it reads there first).
        regions: Every region's settings (at least the home region and its failovers).
        schemas: Schemas of the entity types this client reads.
        layout: Key layout; must match the writer's.
        max_staleness: Default staleness bound of a call that gives none.
        stats: Where the metrics go (default: a private, unregistered :class:`LookupStats`).
    """

    def __init__(
        self,
        region: str,
        regions: Iterable[RegionSettings],
        schemas: Iterable[FeatureSchema],
        *,
        layout: KeyLayout | None = None,
        max_staleness: float | timedelta | None = None,
        stats: LookupStats | None = None,
    ) -> None:
        self.stats = stats if stats is not None else LookupStats()
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
        # region -> (monotonic time of the last check, entity types rebuilding there)
        self.rebuilding: dict[str, tuple[float, frozenset[str]]] = {}
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
        at: datetime | float | None = None,
    ) -> Plan:
        """Validate a call and resolve everything it needs but I/O."""
        reader = self.reader(entity)
        projection = self.projection(entity, features)
        if isinstance(ids, (str, bytes)):  # a tuple: no union object built per call
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
            time.time_ns() // 1000 if at is None else _read_time_us(at),
        )

    def assemble(self, plan: Plan, region: str, decoded: Decoded, near_hits: int) -> FeatureVectors:
        """The result of a call from the values ``region`` returned: each vector as in
        force at the read time (windows read as of then: see ``FeatureSchema.slots``)."""
        now_us = plan.at_us
        return build_vectors(
            entity=plan.schema.entity,
            ids=plan.ids,
            region=region,
            projection=plan.projection,
            decoded=decoded,
            now_us=now_us,
            max_staleness_us=plan.max_staleness_us,
            near_hits=near_hits,
            corrupt=tuple(sorted(decoded.corrupt)),
            rebuilding=plan.schema.entity in self.rebuilding.get(region, (0.0, frozenset()))[1],
        )

    def record(self, plan: Plan, result: FeatureVectors, started: float) -> None:
        """Update the metrics of one served call."""
        entity = plan.schema.entity
        n = len(plan.ids)
        found = len(result._rows)
        stale = int(result.stale.sum()) if plan.max_staleness_us is not None else 0
        home = self.home.name
        self.stats.lookup(
            home,
            entity,
            time.perf_counter() - started,
            found,
            n - found - stale,
            stale,
            result.near_hits,
        )
        if result.region != home:
            self.stats.fallback(home, result.region, entity)
        for _, reason in result.corrupt:
            kind = "wrong_type" if " holds a Redis " in reason else "format"
            self.stats.corrupt_value(result.region, entity, kind)
            log.warning("lookup of %r in %s: %s", entity, result.region, reason)

    def failed(self, region: str, reason: str) -> None:
        """Count a failed (or skipped) read from ``region``."""
        self.stats.failure(region, reason)

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
        timed_out = bool(attempts) and all(r.startswith("timed out") for _, r in attempts)
        kind_of_error = LookupTimeoutError if timed_out else RegionUnavailableError
        return kind_of_error(
            f"no region could serve {kind} for home region {self.home.name!r}: {detail}",
            self.home.name,
            every,
        )

    def start(
        self,
        plan: Plan,
        breakers: Mapping[str, CircuitBreaker],
        near: NearCache | None,
        started: float,
    ) -> LookupRun:
        """The state machine of one call: see :class:`LookupRun`."""
        return LookupRun(self.lookup(plan, breakers, near, started))

    def lookup(
        self,
        plan: Plan,
        breakers: Mapping[str, CircuitBreaker],
        near: NearCache | None,
        started: float,
    ) -> Lookup:
        """The failover loop of one call, as a generator of I/O steps.

        Yields :class:`Read` and :class:`ReadSchema` steps; the face executes each and
        sends back its answer, or a :class:`Failure` when the region did not answer (the
        region is then counted failed and the next allowed region is tried), or a
        :class:`Late` when the face was too slow to take an answer. Returns the result
        (``StopIteration.value``).

        Raises:
            RegionUnavailableError: no region allowed to serve the call answered.
            LookupOverloadedError: a read ended :class:`Late`.
            SchemaVersionError: a value's schema version cannot be read safely.
        """
        if not plan.ids:
            return self.assemble(plan, self.home.name, plan.reader.decode([], []), 0)
        home = self.home.name
        if near is not None and near.active:
            # everything in the near cache: no I/O, so no breaker either
            cached, misses = near.lookup(plan.keys)
            if not misses:
                decoded = plan.reader.decode(cached, plan.ids, plan.at_us)
                if not decoded.needs:
                    result = self.assemble(plan, home, decoded, len(plan.keys))
                    self.record(plan, result, started)
                    return result
        allowed, refused = self.route(plan.schema)
        attempts: list[tuple[str, str]] = []
        for name in allowed:
            breaker = breakers[name]
            if not breaker.allow():
                attempts.append((name, "skipped: circuit breaker open after recent failures"))
                self.failed(name, "breaker_open")
                continue
            read = yield from self._read_region(
                plan, name, near if name == home and near is not None and near.active else None
            )
            if isinstance(read, Late):
                raise LookupOverloadedError(read.reason, name, retry_after_s=read.retry_after_s)
            if isinstance(read, Failure):
                breaker.failure()
                self.failed(name, read.metric)
                attempts.append((name, read.reason))
                continue
            breaker.success()
            result = self.assemble(plan, name, read[0], read[1])
            self.record(plan, result, started)
            return result
        raise self.unavailable(plan, attempts, refused)

    def _read_region(
        self, plan: Plan, name: str, near: NearCache | None
    ) -> Generator[Step, Any, tuple[Decoded, int] | Failure]:
        """Read and decode the call's values from one region (through the near cache)."""
        keys = plan.keys
        if near is None:
            answer = yield Read(name, keys)
            if isinstance(answer, Failure):
                return answer
            raws, existing = answer
            read_keys, read_values = keys, raws
            hits = 0
        else:
            raws, misses = near.lookup(keys)
            hits = len(keys) - len(misses)
            read_keys, read_values, existing = [], [], 0
            if misses:
                read_keys = [keys[i] for i in misses]
                ticket = near.reserve(read_keys)
                answer = yield Read(name, read_keys, tracked=True)
                if isinstance(answer, Failure):
                    return answer
                read_values, existing = answer
                near.fill(read_keys, read_values, ticket)
                for index, value in zip(misses, read_values, strict=True):
                    raws[index] = value
        checked = self.rebuilding.get(name)
        if checked is None or time.monotonic() - checked[0] >= REBUILD_CHECK_S:
            listed = yield ReadRebuilding(name, self.layout.rebuild_key())
            if isinstance(listed, dict):
                entities = self.layout.rebuilding_entities(listed)
                self.rebuilding[name] = (time.monotonic(), entities)
        decoded = plan.reader.decode(raws, plan.ids, plan.at_us)
        if decoded.needs:
            for version, fingerprint in decoded.needs:
                document = yield ReadSchema(
                    name, self.layout.schema_key(plan.schema.entity, version)
                )
                if isinstance(document, Failure):
                    return document
                plan.reader.learn(version, fingerprint, document)
            decoded = plan.reader.decode(raws, plan.ids, plan.at_us)
        found = len(read_values) - read_values.count(None)
        if existing is not None and existing > found:
            # MGET reads a key of another Redis type (a hash...) as nil: name it, never
            # let it pass for an absent entity
            absent = [
                key for key, value in zip(read_keys, read_values, strict=True) if value is None
            ]
            types = yield ReadTypes(name, absent)
            if isinstance(types, Failure):
                return types
            wrong = {
                k: t for k, t in zip(absent, types, strict=True) if t not in ("none", "string")
            }
            if wrong:
                extra = tuple(
                    (
                        index,
                        f"key {key!r} holds a Redis {wrong[key]}, not an edgefeed value "
                        "(a string); is another application writing under this key namespace?",
                    )
                    for index, key in enumerate(keys)
                    if key in wrong
                )
                decoded = replace(decoded, corrupt=decoded.corrupt + extra)
        return decoded, hits
