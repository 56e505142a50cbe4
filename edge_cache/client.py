"""The feature lookup client: what serving code calls on every request.

:class:`FeatureClient` (blocking) and :class:`AsyncFeatureClient` (asyncio)
share :class:`LookupCore`, which does everything but I/O: validating the call,
resolving feature names to positions (once per feature list), choosing the
regions allowed to serve (residency), decoding and assembling the result, and
metrics. The faces only read bytes: one ``MGET`` per call on a single server
(one pipelined ``MGET`` per slot on a cluster), whatever the number of ids.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import numpy as np
import redis
import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from edge_cache.breaker import CircuitBreaker
from edge_cache.exceptions import (
    ConfigError,
    RegionUnavailableError,
    UnknownEntityError,
    UnknownFeatureError,
)
from edge_cache.layout import Decoded, KeyLayout, RecordReader
from edge_cache.metrics import STATS
from edge_cache.nearcache import InvalidationListener, NearCache, NearCacheConfig
from edge_cache.result import FeatureVectors, Projection, build_vectors
from edge_cache.schema import FeatureSchema
from edge_cache.settings import RegionSettings

__all__ = ["AsyncFeatureClient", "FeatureClient", "HasRegions", "LookupCore"]

_FAILURES = (RedisConnectionError, RedisTimeoutError, ConnectionError, TimeoutError, OSError)
_MAX_PROJECTIONS = 1024


class HasRegions(Protocol):
    """Anything with a ``regions`` list, e.g. ``edgefeed.settings.EdgefeedSettings``."""

    @property
    def regions(self) -> Sequence[RegionSettings]: ...


@dataclass(frozen=True, slots=True)
class _Plan:
    schema: FeatureSchema
    reader: RecordReader
    projection: Projection
    ids: tuple[Any, ...]
    keys: list[str]
    max_staleness_us: int | None


def _seconds(value: float | timedelta | None, what: str) -> float | None:
    if value is None:
        return None
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if not seconds >= 0:
        raise ConfigError(
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
    """

    def __init__(
        self,
        region: str,
        regions: Iterable[RegionSettings],
        schemas: Iterable[FeatureSchema],
        *,
        layout: KeyLayout | None = None,
    ) -> None:
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
        key = (entity, tuple(features) if features is not None else None)
        found = self._projections.get(key)
        if found is not None:
            return found
        reader = self.reader(entity)
        schema = reader.schema
        if features is None:
            names = schema.names
        else:
            if isinstance(features, str):
                features = (features,)
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
    ) -> _Plan:
        """Validate a call and resolve everything it needs but I/O."""
        reader = self.reader(entity)
        projection = self.projection(entity, features)
        id_tuple = tuple(ids.tolist()) if isinstance(ids, np.ndarray) else tuple(ids)
        if isinstance(ids, str | bytes):
            raise ConfigError(f"ids must be a sequence of ids, got the single value {ids!r}")
        staleness = _seconds(max_staleness, "max_staleness")
        return _Plan(
            reader.schema,
            reader,
            projection,
            id_tuple,
            self.layout.keys(entity, id_tuple),
            None if staleness is None else round(staleness * 1_000_000),
        )

    def assemble(
        self, plan: _Plan, region: str, decoded: Decoded, near_hits: int
    ) -> FeatureVectors:
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

    def record(self, plan: _Plan, result: FeatureVectors, started: float) -> None:
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
        STATS.failure(region, reason)

    def unavailable(
        self, plan: _Plan, attempts: list[tuple[str, str]], refused: list[tuple[str, str]]
    ) -> RegionUnavailableError:
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


def _reason(exc: BaseException, timeout_s: float) -> tuple[str, str]:
    if isinstance(exc, RedisTimeoutError | TimeoutError):
        return "timeout", f"timed out after {timeout_s:g} s"
    return "connection", f"connection failed ({type(exc).__name__})"


def _pool_options(timeout_s: float) -> dict[str, Any]:
    return {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        # one timeout per call: retries are the breaker's and the failover's job
        "retry": Retry(NoBackoff(), 0),
    }


def _mget(client: redis.Redis, keys: list[str]) -> list[bytes | None]:
    """One MGET on a pooled connection, without redis-py's per-command layers
    (retry wrapper, observability hooks): about 10 us less per call."""
    pool = client.connection_pool
    connection = pool.get_connection()
    try:
        connection.send_command("MGET", *keys)  # type: ignore[no-untyped-call]
        return connection.read_response()  # type: ignore[no-any-return]
    except BaseException:
        connection.disconnect()  # type: ignore[no-untyped-call]  # half-read: never reuse
        raise
    finally:
        pool.release(connection)


async def _amget(client: aioredis.Redis, keys: list[str]) -> list[bytes | None]:
    """The asyncio twin of :func:`_mget` (also safe under cancellation by a timeout)."""
    pool = client.connection_pool
    connection = await pool.get_connection()  # type: ignore[no-untyped-call]
    try:
        await connection.send_command("MGET", *keys)
        return await connection.read_response()  # type: ignore[no-any-return]
    except BaseException:
        await connection.disconnect()
        raise
    finally:
        await pool.release(connection)


class _Base:
    def __init__(
        self,
        region: str,
        regions: Iterable[RegionSettings],
        schemas: Iterable[FeatureSchema],
        *,
        timeout_s: float,
        near_cache: NearCacheConfig | None,
        breaker_failures: int,
        breaker_reset_s: float,
        layout: KeyLayout | None,
    ) -> None:
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s={timeout_s!r} must be positive")
        self.core = LookupCore(region, regions, schemas, layout=layout)
        self.timeout_s = timeout_s
        self.region = region
        names = [region, *self.core.home.failover]
        self.breakers = {
            name: CircuitBreaker(
                failure_threshold=breaker_failures, reset_timeout_s=breaker_reset_s
            )
            for name in names
        }
        self.near: NearCache | None = None
        self.listener: InvalidationListener | None = None
        if near_cache is not None:
            if self.core.home.cluster:
                raise ConfigError(
                    f"near cache is supported on single-server regions; {region!r} is a cluster. "
                    "Pass near_cache=None"
                )
            self.near = NearCache(near_cache)
            self.listener = InvalidationListener(self.core.home.redis_url, self.near)

    def _tracking_hook(self) -> Any:
        listener = self.listener

        def enable_tracking(connection: Any) -> None:
            connection.on_connect()
            if listener is not None and listener.client_id is not None:
                connection.send_command("CLIENT", "TRACKING", "ON", "REDIRECT", listener.client_id)
                connection.read_response()

        return enable_tracking


class FeatureClient(_Base):
    """Blocking feature lookups from one region's edge cache, with failover.

    Args:
        region: Home region: read first, and defines the residency zone of
            personal entity types.
        regions: Settings of the home region and of every region in its failover list.
        schemas: Schemas of the entity types to read.
        timeout_s: Timeout of one read from one region (connect and read).
        near_cache: Enable the in-process near cache with these bounds (single-server
            regions only).
        breaker_failures: Consecutive failures that open a region's circuit breaker.
        breaker_reset_s: How long an open breaker skips its region before one probe.
        layout: Key layout (namespace); must match the writer's.
    """

    def __init__(
        self,
        region: str,
        regions: Iterable[RegionSettings],
        schemas: Iterable[FeatureSchema],
        *,
        timeout_s: float = 0.25,
        near_cache: NearCacheConfig | None = None,
        breaker_failures: int = 1,
        breaker_reset_s: float = 1.0,
        layout: KeyLayout | None = None,
    ) -> None:
        super().__init__(
            region,
            regions,
            schemas,
            timeout_s=timeout_s,
            near_cache=near_cache,
            breaker_failures=breaker_failures,
            breaker_reset_s=breaker_reset_s,
            layout=layout,
        )
        self.clients: dict[str, redis.Redis | redis.RedisCluster] = {}
        for name in self.breakers:
            settings = self.core.regions[name]
            options = _pool_options(timeout_s)
            if settings.cluster:
                self.clients[name] = redis.RedisCluster.from_url(settings.redis_url, **options)
            else:
                if name == region and self.listener is not None:
                    options["redis_connect_func"] = self._tracking_hook()
                self.clients[name] = redis.Redis.from_url(settings.redis_url, **options)
        if self.listener is not None:
            self.listener.start()

    @classmethod
    def from_settings(
        cls, settings: HasRegions, region: str, schemas: Iterable[FeatureSchema], **options: Any
    ) -> FeatureClient:
        """Build from loaded settings (``edgefeed.settings.load_settings("edgefeed.yaml")``)."""
        return cls(region, settings.regions, schemas, **options)

    def get(
        self,
        entity: str,
        ids: Sequence[str | int] | np.ndarray[Any, Any],
        features: Sequence[str] | None = None,
        max_staleness: float | timedelta | None = None,
    ) -> FeatureVectors:
        """Read the feature vectors of ``ids``: one round trip, whatever their number.

        Args:
            entity: Entity type.
            ids: Entity ids; rows of the result follow this order.
            features: Feature names (default: all, in schema order).
            max_staleness: Withhold vectors whose source commit is older than this
                (seconds or timedelta); such rows are flagged ``stale``.

        Raises:
            UnknownEntityError: ``entity`` has no schema here.
            UnknownFeatureError: a feature name is not in the schema.
            SchemaVersionError: a value was written by an incompatible schema version.
            RegionUnavailableError: no region allowed to serve the call answered.
        """
        started = time.perf_counter()
        core = self.core
        plan = core.plan(entity, ids, features, max_staleness)
        if not plan.ids:
            return core.assemble(plan, self.region, plan.reader.decode([], []), 0)
        allowed, refused = core.route(plan.schema)
        attempts: list[tuple[str, str]] = []
        for name in allowed:
            breaker = self.breakers[name]
            if not breaker.allow():
                attempts.append((name, "skipped: circuit breaker open after recent failures"))
                core.failed(name, "breaker_open")
                continue
            try:
                raws, near_hits = self._fetch(name, plan.keys)
                decoded = plan.reader.decode(raws, plan.ids)
                if decoded.needs:
                    decoded = self._learn(name, plan, raws, decoded)
            except _FAILURES as exc:
                breaker.failure()
                metric, reason = _reason(exc, self.timeout_s)
                core.failed(name, metric)
                attempts.append((name, reason))
                continue
            breaker.success()
            result = core.assemble(plan, name, decoded, near_hits)
            core.record(plan, result, started)
            return result
        raise core.unavailable(plan, attempts, refused)

    def _fetch(self, name: str, keys: list[str]) -> tuple[list[bytes | None], int]:
        client = self.clients[name]
        near = self.near
        if near is None or name != self.region or not near.active:
            if isinstance(client, redis.RedisCluster):
                return client.mget_nonatomic(keys), 0
            return _mget(client, keys), 0
        values, misses = near.lookup(keys)
        if not misses:
            return values, len(keys)
        missing = [keys[i] for i in misses]
        ticket = near.reserve(missing)
        if near.reset_needed:
            near.reset_needed = False
            client.connection_pool.disconnect()  # type: ignore[union-attr]
        fetched = _mget(client, missing)  # type: ignore[arg-type]
        near.fill(missing, fetched, ticket)
        for index, value in zip(misses, fetched, strict=True):
            values[index] = value
        return values, len(keys) - len(misses)

    def _learn(self, name: str, plan: _Plan, raws: list[bytes | None], decoded: Decoded) -> Decoded:
        client = self.clients[name]
        for version, fingerprint in decoded.needs:
            document = client.get(self.core.layout.schema_key(plan.schema.entity, version))
            plan.reader.learn(version, fingerprint, document)
        return plan.reader.decode(raws, plan.ids)

    def close(self) -> None:
        """Stop the near cache listener and close every connection."""
        if self.listener is not None:
            self.listener.stop()
        for client in self.clients.values():
            client.close()

    def __enter__(self) -> FeatureClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncFeatureClient(_Base):
    """The asyncio face of :class:`FeatureClient`: same arguments, same behaviour.

    The timeout covers the whole read from one region (``asyncio.timeout``).
    """

    def __init__(
        self,
        region: str,
        regions: Iterable[RegionSettings],
        schemas: Iterable[FeatureSchema],
        *,
        timeout_s: float = 0.25,
        near_cache: NearCacheConfig | None = None,
        breaker_failures: int = 1,
        breaker_reset_s: float = 1.0,
        layout: KeyLayout | None = None,
    ) -> None:
        super().__init__(
            region,
            regions,
            schemas,
            timeout_s=timeout_s,
            near_cache=near_cache,
            breaker_failures=breaker_failures,
            breaker_reset_s=breaker_reset_s,
            layout=layout,
        )
        self.clients: dict[str, aioredis.Redis | aioredis.RedisCluster] = {}
        for name in self.breakers:
            settings = self.core.regions[name]
            options = _pool_options(timeout_s)
            if settings.cluster:
                self.clients[name] = aioredis.RedisCluster.from_url(settings.redis_url, **options)
            else:
                if name == region and self.listener is not None:
                    options["redis_connect_func"] = self._async_tracking_hook()
                self.clients[name] = aioredis.Redis.from_url(settings.redis_url, **options)
        if self.listener is not None:
            self.listener.start()

    def _async_tracking_hook(self) -> Any:
        listener = self.listener

        async def enable_tracking(connection: Any) -> None:
            await connection.on_connect()
            if listener is not None and listener.client_id is not None:
                await connection.send_command(
                    "CLIENT", "TRACKING", "ON", "REDIRECT", listener.client_id
                )
                await connection.read_response()

        return enable_tracking

    @classmethod
    def from_settings(
        cls, settings: HasRegions, region: str, schemas: Iterable[FeatureSchema], **options: Any
    ) -> AsyncFeatureClient:
        """Build from loaded settings (``edgefeed.settings.load_settings("edgefeed.yaml")``)."""
        return cls(region, settings.regions, schemas, **options)

    async def get(
        self,
        entity: str,
        ids: Sequence[str | int] | np.ndarray[Any, Any],
        features: Sequence[str] | None = None,
        max_staleness: float | timedelta | None = None,
        *,
        timeout_s: float | None = None,
    ) -> FeatureVectors:
        """See :meth:`FeatureClient.get`; ``timeout_s`` overrides the client's per call."""
        started = time.perf_counter()
        core = self.core
        plan = core.plan(entity, ids, features, max_staleness)
        if not plan.ids:
            return core.assemble(plan, self.region, plan.reader.decode([], []), 0)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        allowed, refused = core.route(plan.schema)
        attempts: list[tuple[str, str]] = []
        for name in allowed:
            breaker = self.breakers[name]
            if not breaker.allow():
                attempts.append((name, "skipped: circuit breaker open after recent failures"))
                core.failed(name, "breaker_open")
                continue
            try:
                async with asyncio.timeout(timeout):
                    raws, near_hits = await self._fetch(name, plan.keys)
                    decoded = plan.reader.decode(raws, plan.ids)
                    if decoded.needs:
                        decoded = await self._learn(name, plan, raws, decoded)
            except _FAILURES as exc:
                breaker.failure()
                metric, reason = _reason(exc, timeout)
                core.failed(name, metric)
                attempts.append((name, reason))
                continue
            breaker.success()
            result = core.assemble(plan, name, decoded, near_hits)
            core.record(plan, result, started)
            return result
        raise core.unavailable(plan, attempts, refused)

    async def _fetch(self, name: str, keys: list[str]) -> tuple[list[bytes | None], int]:
        client = self.clients[name]
        near = self.near
        if near is None or name != self.region or not near.active:
            if isinstance(client, aioredis.RedisCluster):
                return await client.mget_nonatomic(keys), 0
            return await _amget(client, keys), 0
        values, misses = near.lookup(keys)
        if not misses:
            return values, len(keys)
        missing = [keys[i] for i in misses]
        ticket = near.reserve(missing)
        if near.reset_needed:
            near.reset_needed = False
            await client.connection_pool.disconnect()  # type: ignore[union-attr]
        fetched = await _amget(client, missing)  # type: ignore[arg-type]
        near.fill(missing, fetched, ticket)
        for index, value in zip(misses, fetched, strict=True):
            values[index] = value
        return values, len(keys) - len(misses)

    async def _learn(
        self, name: str, plan: _Plan, raws: list[bytes | None], decoded: Decoded
    ) -> Decoded:
        client = self.clients[name]
        for version, fingerprint in decoded.needs:
            document = await client.get(self.core.layout.schema_key(plan.schema.entity, version))
            plan.reader.learn(version, fingerprint, document)
        return plan.reader.decode(raws, plan.ids)

    async def close(self) -> None:
        """Stop the near cache listener and close every connection."""
        if self.listener is not None:
            await asyncio.to_thread(self.listener.stop)
        for client in self.clients.values():
            await client.aclose()

    async def __aenter__(self) -> AsyncFeatureClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
