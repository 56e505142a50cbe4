"""The feature lookup client: what serving code calls on every request.

:class:`FeatureClient` (blocking) and :class:`AsyncFeatureClient` (asyncio)
share :class:`~edge_cache.core.LookupCore`, which does everything but I/O:
validating the call, resolving feature names to positions (once per feature
list), choosing the regions allowed to serve (residency), decoding and
assembling the result, and metrics. The faces only read bytes: one ``MGET``
per call on a single server (one pipelined ``MGET`` per slot on a cluster),
whatever the number of ids.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

import numpy as np
import redis
import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.exceptions import ClusterError, RedisClusterException
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from edge_cache._redis import close_client
from edge_cache.breaker import CircuitBreaker
from edge_cache.core import LookupCore, Plan
from edge_cache.exceptions import ConfigError
from edge_cache.layout import Decoded, KeyLayout
from edge_cache.nearcache import InvalidationListener, ListenerGroup, NearCache, NearCacheConfig
from edge_cache.result import FeatureVectors
from edge_cache.schema import FeatureSchema
from edge_cache.settings import RegionSettings

__all__ = ["AsyncFeatureClient", "FeatureClient", "HasRegions"]

# What makes a region "failed" (breaker, failover): no answer, or a cluster that cannot serve.
_FAILURES = (
    RedisConnectionError,
    RedisTimeoutError,
    ClusterError,
    RedisClusterException,
    ConnectionError,
    TimeoutError,
    OSError,
)
log = logging.getLogger(__name__)


class HasRegions(Protocol):
    """Anything with a ``regions`` list, e.g. ``edgefeed.settings.EdgefeedSettings``."""

    @property
    def regions(self) -> Sequence[RegionSettings]: ...


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


def _mget(client: redis.Redis, keys: list[str], redirect: int | None = None) -> list[bytes | None]:
    """One MGET on a pooled connection, without redis-py's per-command layers
    (retry wrapper, observability hooks): several microseconds less per call.

    With ``redirect`` (near cache on), the connection must be tracking into that
    invalidation connection; one connected before the listener (re)connected is
    reconnected first, so nothing it reads can reach the near cache untracked.
    """
    pool = client.connection_pool
    connection = pool.get_connection()
    try:
        if redirect is not None and getattr(connection, "edgefeed_redirect", None) != redirect:
            connection.disconnect()  # type: ignore[no-untyped-call]  # reconnects, tracked
        connection.send_command("MGET", *keys)  # type: ignore[no-untyped-call]
        return connection.read_response()  # type: ignore[no-any-return]
    except BaseException:
        connection.disconnect()  # type: ignore[no-untyped-call]  # half-read: never reuse
        raise
    finally:
        pool.release(connection)


async def _amget(
    client: aioredis.Redis, keys: list[str], redirect: int | None = None
) -> list[bytes | None]:
    """The asyncio twin of :func:`_mget` (also safe under cancellation by a timeout)."""
    pool = client.connection_pool
    connection = await pool.get_connection()  # type: ignore[no-untyped-call]
    try:
        if redirect is not None and getattr(connection, "edgefeed_redirect", None) != redirect:
            await connection.disconnect()
        await connection.send_command("MGET", *keys)
        return await connection.read_response()  # type: ignore[no-any-return]
    except BaseException:
        await connection.disconnect()
        raise
    finally:
        await pool.release(connection)


def _cluster_primaries(url: str, timeout_s: float) -> list[str]:
    """URLs (same scheme, credentials and database as ``url``) of the cluster's primaries."""
    options = _pool_options(timeout_s)
    with redis.Redis.from_url(url, **options) as probe:  # see FeatureClient._client
        probe.ping()
    cluster = redis.RedisCluster.from_url(url, **options)
    try:
        nodes = [(node.host, node.port) for node in cluster.get_primaries()]  # type: ignore[no-untyped-call]
    finally:
        close_client(cluster)
    return [node_url(url, host, port) for host, port in nodes]


def node_url(url: str, host: str, port: int) -> str:
    """``url`` pointed at another node: scheme, credentials and database kept."""
    parts = urlsplit(url)
    auth = parts.netloc.rpartition("@")[0]
    return urlunsplit(parts._replace(netloc=f"{auth + '@' if auth else ''}{host}:{port}"))


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
        max_staleness: float | timedelta | None,
    ) -> None:
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s={timeout_s!r} must be positive")
        self.core = LookupCore(region, regions, schemas, layout=layout, max_staleness=max_staleness)
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
        self.listener: InvalidationListener | None = None  # single server
        self.listeners: list[InvalidationListener] = []  # every one, cluster included
        if near_cache is not None:
            self.near = NearCache(near_cache)
            if self.core.home.cluster:
                self.listeners = self._cluster_listeners(self.near)
            else:
                self.listener = InvalidationListener(self.core.home.redis_url, self.near)
                self.listeners = [self.listener]

    def _cluster_listeners(self, near: NearCache) -> list[InvalidationListener]:
        """One broadcast-mode listener per primary of the home cluster: it is told of
        every write under the entity prefixes on its node, so reads need no hook."""
        url = self.core.home.redis_url
        try:
            primaries = _cluster_primaries(url, self.timeout_s)
        except _FAILURES as exc:
            log.warning(
                "near cache of %s stays off: cannot list the cluster's primaries (%s)",
                self.region,
                exc,
            )
            return []
        prefixes = [self.core.layout.prefix(entity) for entity in self.core.readers]
        group = ListenerGroup(near, len(primaries))
        return [
            InvalidationListener(
                node_url, near, bcast_prefixes=prefixes, on_state=group.on_state(index)
            )
            for index, node_url in enumerate(primaries)
        ]

    def _start_listeners(self) -> None:
        # started together, waited for together: a dead region costs at most one timeout
        deadline = time.monotonic() + self.timeout_s
        for listener in self.listeners:
            listener.start(wait_s=0)
        for listener in self.listeners:
            listener.wait(max(0.0, deadline - time.monotonic()))

    def _tracking_hook(self) -> Any:
        listener = self.listener

        def enable_tracking(connection: Any) -> None:
            connection.on_connect()
            target = listener.client_id if listener is not None else None
            if target is not None:
                connection.send_command("CLIENT", "TRACKING", "ON", "REDIRECT", target)
                connection.read_response()
            connection.edgefeed_redirect = target

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
        max_staleness: Default staleness bound of every call (a call's own
            ``max_staleness`` wins); None: no bound.
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
        max_staleness: float | timedelta | None = None,
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
            max_staleness=max_staleness,
        )
        self.clients: dict[str, redis.Redis | redis.RedisCluster] = {}
        for name in self.breakers:
            settings = self.core.regions[name]
            options = _pool_options(timeout_s)
            if settings.cluster:
                continue  # a cluster client connects when built: see _client
            if name == region and self.listener is not None:
                options["redis_connect_func"] = self._tracking_hook()
            self.clients[name] = redis.Redis.from_url(settings.redis_url, **options)
        self._start_listeners()

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

    def _client(self, name: str) -> redis.Redis | redis.RedisCluster:
        client = self.clients.get(name)
        if client is None:
            # A cluster client discovers the slots when built: build it on first use, so
            # an unreachable fallback cluster is a failed read, not a failed constructor.
            url = self.core.regions[name].redis_url
            # Probe the seed node first: a RedisCluster whose discovery fails leaks its
            # socket, and most failures (node down or hanging) show up right here.
            with redis.Redis.from_url(url, **_pool_options(self.timeout_s)) as probe:
                probe.ping()
            try:
                client = redis.RedisCluster.from_url(url, **_pool_options(self.timeout_s))
            except RedisClusterException as exc:
                raise RedisConnectionError(f"cluster of region {name!r}: {exc}") from exc
            self.clients[name] = client
        return client

    def _fetch(self, name: str, keys: list[str]) -> tuple[list[bytes | None], int]:
        client = self._client(name)
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
        if isinstance(client, redis.RedisCluster):
            fetched = client.mget_nonatomic(missing)
        else:
            redirect = self.listener.client_id if self.listener is not None else None
            fetched = _mget(client, missing, redirect)
        near.fill(missing, fetched, ticket)
        for index, value in zip(misses, fetched, strict=True):
            values[index] = value
        return values, len(keys) - len(misses)

    def _learn(self, name: str, plan: Plan, raws: list[bytes | None], decoded: Decoded) -> Decoded:
        client = self._client(name)
        for version, fingerprint in decoded.needs:
            document = client.get(self.core.layout.schema_key(plan.schema.entity, version))
            plan.reader.learn(version, fingerprint, document)
        return plan.reader.decode(raws, plan.ids)

    def close(self) -> None:
        """Stop the near cache listener and close every connection."""
        for listener in self.listeners:
            listener.stop()
        for client in self.clients.values():
            close_client(client)

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
        max_staleness: float | timedelta | None = None,
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
            max_staleness=max_staleness,
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
        self._start_listeners()

    def _async_tracking_hook(self) -> Any:
        listener = self.listener

        async def enable_tracking(connection: Any) -> None:
            await connection.on_connect()
            target = listener.client_id if listener is not None else None
            if target is not None:
                await connection.send_command("CLIENT", "TRACKING", "ON", "REDIRECT", target)
                await connection.read_response()
            connection.edgefeed_redirect = target

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
        near = self.near
        if near is not None and near.active:
            # everything in the near cache: no I/O, so no timeout scope and no breaker
            cached, misses = near.lookup(plan.keys)
            if not misses:
                decoded = plan.reader.decode(cached, plan.ids)
                if not decoded.needs:
                    result = core.assemble(plan, self.region, decoded, len(plan.keys))
                    core.record(plan, result, started)
                    return result
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
        if isinstance(client, aioredis.RedisCluster):
            fetched = await client.mget_nonatomic(missing)
        else:
            redirect = self.listener.client_id if self.listener is not None else None
            fetched = await _amget(client, missing, redirect)
        near.fill(missing, fetched, ticket)
        for index, value in zip(misses, fetched, strict=True):
            values[index] = value
        return values, len(keys) - len(misses)

    async def _learn(
        self, name: str, plan: Plan, raws: list[bytes | None], decoded: Decoded
    ) -> Decoded:
        client = self.clients[name]
        for version, fingerprint in decoded.needs:
            document = await client.get(self.core.layout.schema_key(plan.schema.entity, version))
            plan.reader.learn(version, fingerprint, document)
        return plan.reader.decode(raws, plan.ids)

    async def close(self) -> None:
        """Stop the near cache listener and close every connection."""
        for listener in self.listeners:
            await asyncio.to_thread(listener.stop)
        for client in self.clients.values():
            await client.aclose()

    async def __aenter__(self) -> AsyncFeatureClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
