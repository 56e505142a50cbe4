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
import contextvars
import logging
import os
import select
import socket
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any, Protocol, Self, TypeVar
from urllib.parse import urlsplit, urlunsplit

import numpy as np
import redis
import redis.asyncio as aioredis
from prometheus_client.registry import CollectorRegistry
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.exceptions import ClusterError, RedisClusterException, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from edge_cache._redis import close_client
from edge_cache.breaker import CircuitBreaker
from edge_cache.core import (
    Failure,
    Late,
    LookupCore,
    LookupRun,
    Read,
    ReadRebuilding,
    ReadSchema,
    ReadTypes,
    Reply,
    Step,
)
from edge_cache.exceptions import ConfigError, PoolExhaustedError
from edge_cache.layout import KeyLayout
from edge_cache.metrics import LookupStats
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
_R = TypeVar("_R")


class HasRegions(Protocol):
    """Anything with a ``regions`` list, e.g. ``edgefeed.settings.EdgefeedSettings``."""

    @property
    def regions(self) -> Sequence[RegionSettings]: ...


def _failure(exc: BaseException, timeout_s: float) -> Failure:
    if isinstance(exc, RedisTimeoutError | TimeoutError):
        return Failure("timeout", f"timed out after {timeout_s:g} s")
    return Failure("connection", f"connection failed ({type(exc).__name__})")


# The deadline (time.monotonic()) of the region read in progress in this thread, read by
# every socket of the sync face: redis-py's socket_timeout bounds one recv, so a peer that
# dribbles a byte per read would otherwise hold a call for as long as it likes.
_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "edge_cache_deadline", default=None
)


class _DeadlineSocket:
    """A socket whose every send and receive waits at most until the call's deadline."""

    __slots__ = ("_armed_at", "_armed_for", "_poll", "_requested", "_sock")

    def __init__(self, sock: socket.socket, timeout: float | None) -> None:
        self._sock = sock
        self._requested = timeout  # what redis-py asked for (0: a non-blocking poll)
        self._armed_for: float | None = None  # the deadline the timeout was last set for
        self._armed_at = 0.0
        self._poll = select.poll()
        self._poll.register(sock.fileno(), select.POLLIN)

    def _arm(self) -> None:
        deadline = _DEADLINE.get()
        requested = self._requested
        if deadline is None:
            self._armed_for = None
            self._sock.settimeout(requested)
            return
        now = time.monotonic()
        remaining = deadline - now
        if remaining <= 0:
            raise TimeoutError("the lookup's deadline has passed")
        # Setting a timeout is a system call. The one set for this deadline at most
        # _ARM_SLACK_S ago ends a wait at most that much after the deadline: keep it.
        if self._armed_for == deadline and now - self._armed_at <= _ARM_SLACK_S:
            return
        self._sock.settimeout(remaining if requested is None else min(requested, remaining))
        self._armed_for = deadline
        self._armed_at = now

    def stale(self) -> bool:
        """Anything to read on an idle connection (stray bytes, the peer's close, an
        error) makes it unfit for the next command; one zero-timeout poll tells."""
        return bool(self._poll.poll(0))

    def recv(self, *args: Any) -> bytes:
        self._arm()
        return self._sock.recv(*args)

    def recv_into(self, *args: Any) -> int:
        self._arm()
        return self._sock.recv_into(*args)

    def sendall(self, *args: Any) -> None:
        self._arm()
        self._sock.sendall(*args)

    def settimeout(self, value: float | None) -> None:
        self._requested = value
        self._armed_for = None
        self._sock.settimeout(value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class _DeadlineMixin:
    edgefeed_socket: _DeadlineSocket | None = None

    def _connect(self) -> Any:
        sock = super()._connect()  # type: ignore[misc]
        wrapped = _DeadlineSocket(sock, self.socket_timeout)  # type: ignore[attr-defined]
        self.edgefeed_socket = wrapped
        return wrapped


class _DeadlineConnection(_DeadlineMixin, redis.Connection):
    """A TCP connection whose reads stop at the call's deadline."""


class _DeadlineSSLConnection(_DeadlineMixin, redis.SSLConnection):
    """A TLS connection whose reads stop at the call's deadline."""


_SYNC_READ_SIZE = 256 * 1024
#: How long after a deadline a socket wait may end: the timeout set at a call's first
#: read or write is kept for its next ones within this long (see _DeadlineSocket._arm).
_ARM_SLACK_S = 0.001

#: Turns of the event loop a region's read is given once its deadline has passed,
#: before it is abandoned as the region's timeout (see _ReadDeadline).
GRACE_TURNS = 8
_BACKSTOP_FACTOR = 4


def _pool_options(
    timeout_s: float, url: str | None = None, *, for_asyncio: bool = False
) -> dict[str, Any]:
    options: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        # One timeout per call: retries are the breaker's and the failover's job. The
        # asyncio client gets asyncio's Retry (redis-py 8.2 warns about a sync one).
        "retry": (AsyncRetry if for_asyncio else Retry)(NoBackoff(), 0),
    }
    if for_asyncio:
        # The call's _ReadDeadline bounds every connect and read of the asyncio face.
        # redis-py's own timeouts would cut them at timeout_s on the loop's clock, late
        # replies of a busy loop included (the region blamed for the worker's lag); the
        # connect timeout stays as a looser backstop (it also bounds closing).
        options["socket_timeout"] = None
        options["socket_connect_timeout"] = _BACKSTOP_FACTOR * timeout_s
    if url is not None:  # the sync face: reads bounded by the call's deadline
        # Each socket read re-arms the deadline (two more system calls): read a whole
        # 100-id reply of scheduled values (~112 KB) at once, not in 64 KiB pieces.
        # One buffer per connection, and the sync face holds one per calling thread.
        options["socket_read_size"] = _SYNC_READ_SIZE
        scheme = urlsplit(url).scheme
        if scheme == "redis":
            options["connection_class"] = _DeadlineConnection
        elif scheme == "rediss":
            options["connection_class"] = _DeadlineSSLConnection
    return options


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class _Deadlines:
    """The deadline of each region a call reads from: ``timeout_s`` after its first read."""

    __slots__ = ("_by_region", "timeout_s")

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._by_region: dict[str, float] = {}

    def of(self, region: str) -> float:
        deadline = self._by_region.get(region)
        if deadline is None:
            deadline = self._by_region[region] = time.monotonic() + self.timeout_s
        return deadline


def _pack_reads(keys: list[str]) -> bytes:
    """``MGET keys`` and ``EXISTS keys`` in the Redis protocol, in one buffer.

    The lookup's hot path: redis-py's packer checks and converts every argument in
    Python, twice here (one command each); this writes each key's bulk string once
    and shares it, which saves about a third of a 100-key call's client time.
    """
    text = "".join([f"${len(key)}\r\n{key}\r\n" for key in keys])
    if text.isascii():  # every key's length in characters is its length in bytes
        body = text.encode()
    else:
        body = b"".join([b"$%d\r\n%b\r\n" % (len(key), key) for key in map(str.encode, keys)])
    count = len(keys) + 1
    return b"*%d\r\n$4\r\nMGET\r\n%b*%d\r\n$6\r\nEXISTS\r\n%b" % (count, body, count, body)


class _Connections:
    """The sync face's connections to one region, kept checked out between calls.

    redis-py's checkout (``get_connection`` and ``release``) costs about 9 us a call,
    as much as the lookup's own work: a fork check and a lock each way, observability
    events, and a non-blocking peek at the socket between two timeout changes (four
    system calls). A lookup needs less: the same process, and an idle socket with
    nothing to read (a zero-timeout poll). Connections taken from the pool wait here
    between calls (``list.pop``/``append`` are atomic: any thread may take one); one
    that failed goes back to the pool disconnected. A connection that is not a
    :class:`_DeadlineConnection` (a Unix socket URL) goes through the pool each time.
    """

    __slots__ = ("_idle", "_pid", "pool")

    def __init__(self, pool: redis.ConnectionPool) -> None:
        self.pool = pool
        self._idle: list[Any] = []
        self._pid = os.getpid()

    def take(self) -> Any:
        if self._pid != os.getpid():  # a forked child: the parent's sockets are not its own
            self._idle = []
            self._pid = os.getpid()
        try:
            connection = self._idle.pop()
        except IndexError:
            return self.pool.get_connection()  # redis-py's full checks; connects
        sock = connection.edgefeed_socket
        if not connection.is_connected or sock is None or sock.stale():
            # what redis-py's pool does with such a connection: reconnect it
            try:
                connection.disconnect()
                connection.connect()
            except BaseException:
                self.drop(connection)  # the region's failure; the pool gets it back
                raise
        return connection

    def give(self, connection: Any) -> None:
        """Keep a connection that completed its command (nothing left to read)."""
        if isinstance(connection, _DeadlineMixin) and self._pid == os.getpid():
            self._idle.append(connection)
        else:
            self.pool.release(connection)

    def drop(self, connection: Any) -> None:
        """Hand back a connection whose command failed, disconnected (half-read)."""
        connection.disconnect()
        self.pool.release(connection)

    def close(self) -> None:
        """Return every idle connection to the pool (which the client then closes)."""
        idle, self._idle = self._idle, []
        for connection in idle:
            self.pool.release(connection)


def _pack_get(key: str) -> bytes:
    raw = key.encode()
    return b"*2\r\n$3\r\nGET\r\n$%d\r\n%b\r\n" % (len(raw), raw)


def _get_one(connection: Any, key: str) -> tuple[list[bytes | None], int]:
    """One key: ``GET`` alone. It tells a key of another Redis type by itself (a
    WRONGTYPE error), so it needs no ``EXISTS``: one command and one reply less."""
    connection.send_packed_command([_pack_get(key)])
    try:
        value = connection.read_response()
    except ResponseError as exc:
        if not str(exc).startswith("WRONGTYPE"):
            raise
        return [None], 1  # exists, holds no string: the caller asks its TYPE
    return [value], 0 if value is None else 1


def _mget(
    connections: _Connections, keys: list[str], redirect: int | None = None
) -> tuple[list[bytes | None], int]:
    """One MGET (a GET for one key) on a kept connection, without redis-py's per-command layers
    (retry wrapper, observability hooks, the pool's checkout): about 15 us less
    per call. An ``EXISTS`` of the same keys rides along in the same write (it
    tells a key of another Redis type, which MGET reads as nil, from an absent one).

    With ``redirect`` (near cache on), the connection must be tracking into that
    invalidation connection; one connected before the listener (re)connected is
    reconnected first, so nothing it reads can reach the near cache untracked.
    """
    connection = connections.take()
    try:
        if redirect is not None and getattr(connection, "edgefeed_redirect", None) != redirect:
            connection.disconnect()  # reconnects, tracked
        if len(keys) == 1:
            values, existing = _get_one(connection, keys[0])
        else:
            connection.send_packed_command([_pack_reads(keys)])
            values = connection.read_response()
            existing = int(connection.read_response())
    except BaseException:
        connections.drop(connection)  # half-read: never reuse
        raise
    connections.give(connection)
    return values, existing


async def _amget(
    client: aioredis.Redis, keys: list[str], redirect: int | None = None
) -> tuple[list[bytes | None], int]:
    """The asyncio twin of :func:`_mget` (also safe under cancellation by a timeout)."""
    pool = client.connection_pool
    connection = await pool.get_connection()  # type: ignore[no-untyped-call]
    try:
        if redirect is not None and getattr(connection, "edgefeed_redirect", None) != redirect:
            await connection.disconnect()
        await connection.send_packed_command(_pack_reads(keys))
        values = await connection.read_response()
        return values, int(await connection.read_response())
    except BaseException:
        await connection.disconnect()
        raise
    finally:
        await pool.release(connection)


async def _amget_many(
    client: aioredis.Redis, key_lists: Sequence[list[str]], redirect: int | None = None
) -> list[tuple[list[bytes | None], int] | ResponseError]:
    """Several :func:`_amget` reads in one write on one connection; their answers in
    order. An error reply (an ACL refusing one read's keys) is that read's answer:
    it is read whole, so the replies after it stay in step."""
    pool = client.connection_pool
    connection = await pool.get_connection()  # type: ignore[no-untyped-call]
    try:
        if redirect is not None and getattr(connection, "edgefeed_redirect", None) != redirect:
            await connection.disconnect()
        await connection.send_packed_command(b"".join([_pack_reads(keys) for keys in key_lists]))
        answers: list[tuple[list[bytes | None], int] | ResponseError] = []
        for _ in key_lists:
            refused: ResponseError | None = None
            values: Any = None
            existing = 0
            try:
                values = await connection.read_response()
            except ResponseError as exc:
                refused = exc
            try:
                existing = int(await connection.read_response())
            except ResponseError as exc:
                refused = refused or exc
            answers.append(refused if refused is not None else (values, existing))
        return answers
    except BaseException:
        await connection.disconnect()
        raise
    finally:
        await pool.release(connection)


def _cluster_primaries(url: str, timeout_s: float, auth: dict[str, Any]) -> list[str]:
    """URLs (same scheme, credentials and database as ``url``) of the cluster's primaries."""
    options = {**_pool_options(timeout_s), **auth}
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


class _ReadDeadline:
    """``asyncio.timeout_at(when)`` for a region's read, blind to this process's own lag.

    A reply Redis sent in time can still be read late: the event loop reads it only
    when it gets round to it, after every callback ready before it (a burst of
    requests, a GC pause, a CPU another process holds). A plain timeout then fires
    first and blames the region for the worker's lag. Here the deadline, once passed,
    gives the read :data:`GRACE_TURNS` more turns of the loop: a reply already on its
    socket is read in two, and the read completes; a region that has not answered
    (dead, hanging, dribbling) is still cut, after a few turns (microseconds on an idle
    loop; on a busy one, the loop's own lag). Raises TimeoutError like asyncio's.
    """

    __slots__ = ("_handle", "_timeout", "_when")

    def __init__(self, when: float) -> None:
        self._when = when  # on the loop's clock
        self._timeout = asyncio.Timeout(None)
        self._handle: asyncio.Handle | None = None

    async def __aenter__(self) -> None:
        await self._timeout.__aenter__()
        self._handle = asyncio.get_running_loop().call_at(self._when, self._turn, GRACE_TURNS)

    def _turn(self, left: int) -> None:
        loop = asyncio.get_running_loop()
        if left > 0:
            self._handle = loop.call_soon(self._turn, left - 1)
        else:
            self._handle = None
            self._timeout.reschedule(loop.time())  # cancels the read: TimeoutError

    async def __aexit__(self, *exc_info: Any) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        await self._timeout.__aexit__(*exc_info)


class _Base(ABC):
    """Feature lookups from one region's edge cache, with failover.

    Args:
        region: Home region: read first, and defines the residency zone of
            personal entity types.
        regions: Settings of the home region and of every region in its failover list.
        schemas: Schemas of the entity types to read.
        timeout_s: Deadline of the whole read from one region: connect and every
            round trip of the call (not one socket read). A call that fails over gives
            each region it tries its own ``timeout_s``. The asyncio face counts it from
            when the call holds one of the region's ``max_connections`` (the wait for
            one, this process's own queue, is bounded by ``timeout_s`` apart), and
            reads a reply that came in time but found the event loop busy (see
            :class:`AsyncFeatureClient`).
        near_cache: Enable the in-process near cache with these bounds.
        breaker_failures: Consecutive failures that open a region's circuit breaker.
        breaker_reset_s: How long an open breaker skips its region before one probe.
        layout: Key layout (namespace); must match the writer's.
        max_staleness: Default staleness bound of every call (a call's own
            ``max_staleness`` wins); None: no bound.
        registry: Prometheus registry the lookup metrics are exposed in (clients of
            one registry share them); None: kept in ``stats`` only.
        max_connections: Connections per region of the asyncio face: calls beyond it
            queue for up to ``timeout_s``, then fail with :class:`PoolExhaustedError`
            (never counted against the region). Size it from the caller's concurrency
            (concurrent calls: a call holds one connection of a region at a time).
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
        registry: CollectorRegistry | None = None,
        max_connections: int = 100,
    ) -> None:
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s={timeout_s!r} must be positive")
        if isinstance(max_connections, bool) or not isinstance(max_connections, int):
            raise ConfigError(f"max_connections={max_connections!r} must be an int >= 1")
        if max_connections < 1:
            raise ConfigError(f"max_connections={max_connections!r} must be >= 1")
        self.core = LookupCore(
            region,
            regions,
            schemas,
            layout=layout,
            max_staleness=max_staleness,
            stats=LookupStats.of(registry),
        )
        self.stats = self.core.stats
        self.timeout_s = timeout_s
        self.max_connections = max_connections
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
                self.listener = InvalidationListener(
                    self.core.home.redis_url,
                    self.near,
                    redis_options=self.core.home.redis_options("reader"),
                )
                self.listeners = [self.listener]
        self._connect_regions()
        self._start_listeners()

    @abstractmethod
    def _connect_regions(self) -> None:
        """Open the face's connections to every region (sync or async pools)."""

    @classmethod
    def from_settings(
        cls, settings: HasRegions, region: str, schemas: Iterable[FeatureSchema], **options: Any
    ) -> Self:
        """Build from loaded settings (``edgefeed.settings.load_settings("edgefeed.yaml")``)."""
        return cls(region, settings.regions, schemas, **options)

    def _cluster_listeners(self, near: NearCache) -> list[InvalidationListener]:
        """One broadcast-mode listener per primary of the home cluster: it is told of
        every write under the entity prefixes on its node, so reads need no hook."""
        url = self.core.home.redis_url
        try:
            primaries = _cluster_primaries(
                url, self.timeout_s, self.core.home.redis_options("reader")
            )
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
                node_url,
                near,
                bcast_prefixes=prefixes,
                on_state=group.on_state(index),
                redis_options=self.core.home.redis_options("reader"),
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

    Same arguments as :class:`AsyncFeatureClient` (see :class:`_Base`); every socket
    read and write of a call stops at its deadline.
    """

    def _connect_regions(self) -> None:
        self.clients: dict[str, redis.Redis | redis.RedisCluster] = {}
        self.connections: dict[str, _Connections] = {}  # single servers
        for name in self.breakers:
            settings = self.core.regions[name]
            options = {
                **_pool_options(self.timeout_s, settings.redis_url),
                **settings.redis_options("reader"),
            }
            if settings.cluster:
                continue  # a cluster client connects when built: see _client
            if name == self.region and self.listener is not None:
                options["redis_connect_func"] = self._tracking_hook()
            client = redis.Redis.from_url(settings.redis_url, **options)
            self.clients[name] = client
            self.connections[name] = _Connections(client.connection_pool)

    def get(
        self,
        entity: str,
        ids: Sequence[str | int] | np.ndarray[Any, Any],
        features: Sequence[str] | None = None,
        max_staleness: float | timedelta | None = None,
        *,
        at: datetime | float | None = None,
    ) -> FeatureVectors:
        """Read the feature vectors of ``ids``: one round trip, whatever their number.

        Args:
            entity: Entity type.
            ids: Entity ids; rows of the result follow this order.
            features: Feature names (default: all, in schema order).
            max_staleness: Withhold vectors whose source commit is older than this
                (seconds or timedelta); such rows are flagged ``stale``.
            at: The read time windows are read as of (aware datetime or seconds
                since the epoch; default: now). Values hold what the worker last
                scheduled: a time past the schedule's end reads its last vector.

        Raises:
            UnknownEntityError: ``entity`` has no schema here.
            UnknownFeatureError: a feature name is not in the schema.
            SchemaVersionError: a value was written by an incompatible schema version.
            RegionUnavailableError: no region allowed to serve the call answered.
        """
        started = time.perf_counter()
        plan = self.core.plan(entity, ids, features, max_staleness, at)
        run = self.core.start(plan, self.breakers, self.near, started)
        deadlines = _Deadlines(self.timeout_s)
        step = run.send(None)
        while step is not None:
            step = run.send(self._execute(step, deadlines.of(step.region)))
        return run.result

    def _execute(self, step: Step, deadline: float) -> Reply:
        token = _DEADLINE.set(deadline)
        try:
            connections = self.connections.get(step.region)
            if connections is not None and type(step) is Read:  # a single server's read
                listener = self.listener
                redirect = listener.client_id if step.tracked and listener is not None else None
                return _mget(connections, step.keys, redirect)
            client = self._client(step.region)
            if isinstance(step, ReadSchema):
                return client.get(step.key)  # type: ignore[return-value]
            if isinstance(step, ReadRebuilding):
                return client.hgetall(step.key)  # type: ignore[return-value]
            if isinstance(step, ReadTypes):
                pipe = client.pipeline(transaction=False)
                for key in step.keys:
                    pipe.type(key)
                return [_text(t) for t in pipe.execute()]
            # a cluster: the single servers' reads are answered above
            return client.mget_nonatomic(step.keys), None  # type: ignore[union-attr]
        except _FAILURES as exc:
            return _failure(exc, self.timeout_s)
        finally:
            _DEADLINE.reset(token)

    def _client(self, name: str) -> redis.Redis | redis.RedisCluster:
        client = self.clients.get(name)
        if client is None:
            # A cluster client discovers the slots when built: build it on first use, so
            # an unreachable fallback cluster is a failed read, not a failed constructor.
            url = self.core.regions[name].redis_url
            options = {
                **_pool_options(self.timeout_s, url),
                **self.core.regions[name].redis_options("reader"),
            }
            # Probe the seed node first: a RedisCluster whose discovery fails leaks its
            # socket, and most failures (node down or hanging) show up right here.
            with redis.Redis.from_url(url, **options) as probe:
                probe.ping()
            try:
                client = redis.RedisCluster.from_url(url, **options)
            except RedisClusterException as exc:
                raise RedisConnectionError(f"cluster of region {name!r}: {exc}") from exc
            self.clients[name] = client
        return client

    def close(self) -> None:
        """Stop the near cache listener and close every connection."""
        for listener in self.listeners:
            listener.stop()
        for connections in self.connections.values():
            connections.close()
        for client in self.clients.values():
            close_client(client)

    def __enter__(self) -> FeatureClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncFeatureClient(_Base):
    """The asyncio face of :class:`FeatureClient`: same arguments, same behaviour.

    At most ``max_connections`` calls per region read from it at once (each holds one
    of its connections); the others queue. Only the region's own time counts against
    it (breaker, failover, ``edgefeed_lookup_region_failures_total``):

    * the deadline starts once the call holds a connection and covers its connect
      and round trips; a call still queued after ``timeout_s`` is shed with
      :class:`PoolExhaustedError` (this process takes more than it can serve);
    * a reply that arrived in time but found the event loop busy is read: past the
      deadline a read gets :data:`GRACE_TURNS` more turns of the loop;
    * a read cut at its deadline while the region answered other reads after this
      call got its connection is this process's backlog, not the region's: the call
      is shed with :class:`LookupOverloadedError`. A region that answers no read for
      a whole deadline is timed out and counted failed as ever.
    """

    def _connect_regions(self) -> None:
        self.clients: dict[str, aioredis.Redis | aioredis.RedisCluster] = {}
        self.gates = {name: asyncio.Semaphore(self.max_connections) for name in self.breakers}
        # loop time of each region's latest answer: the evidence that it is alive
        self._answered: dict[str, float] = {}
        for name in self.breakers:
            settings = self.core.regions[name]
            options = {
                **_pool_options(self.timeout_s, for_asyncio=True),
                **settings.redis_options("reader"),
            }
            if settings.cluster:
                self.clients[name] = aioredis.RedisCluster.from_url(settings.redis_url, **options)
            else:
                if name == self.region and self.listener is not None:
                    options["redis_connect_func"] = self._async_tracking_hook()
                # the gate keeps in-flight reads at max_connections: the pool never runs dry
                options["max_connections"] = self.max_connections
                self.clients[name] = aioredis.Redis.from_url(settings.redis_url, **options)

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

    async def get(
        self,
        entity: str,
        ids: Sequence[str | int] | np.ndarray[Any, Any],
        features: Sequence[str] | None = None,
        max_staleness: float | timedelta | None = None,
        *,
        at: datetime | float | None = None,
        timeout_s: float | None = None,
    ) -> FeatureVectors:
        """See :meth:`FeatureClient.get`; ``timeout_s`` overrides the client's per call.

        Raises:
            LookupOverloadedError: this process could not serve the call in time while
                the region answered (:class:`PoolExhaustedError` when it waited that
                long for a connection); the region is not counted failed.
        """
        started = time.perf_counter()
        plan = self.core.plan(entity, ids, features, max_staleness, at)
        run = self.core.start(plan, self.breakers, self.near, started)
        budget = self.timeout_s if timeout_s is None else timeout_s
        return await self._drive(run, run.send(None), budget)

    async def get_many(
        self,
        lookups: Sequence[
            tuple[str, Sequence[str | int] | np.ndarray[Any, Any], Sequence[str] | None]
        ],
        max_staleness: float | timedelta | None = None,
        *,
        at: datetime | float | None = None,
        timeout_s: float | None = None,
        return_exceptions: bool = False,
    ) -> list[FeatureVectors | Exception]:
        """Several lookups at once, each ``(entity, ids, features)`` as :meth:`get` takes
        them; their results in the same order, each what :meth:`get` would return.

        Their first data reads that go to the same region (not a cluster's) travel in
        one write and come back in one round trip on one connection: a ranking
        request's user and items cost the event loop one send and one wake-up instead
        of two of each. What a lookup still needs after that read (failover, a schema,
        the region's rebuilds, ``TYPE`` of wrong-typed keys) runs concurrently with
        the others', each as in :meth:`get`, within the same region deadline. A
        failed joint read is the failure of each lookup in it; an error reply to one
        lookup's commands (an ACL refusing its keys) is that lookup's alone.

        Args:
            return_exceptions: Put a lookup's error in its place in the list instead of
                raising it (as :func:`asyncio.gather` does).

        Raises:
            The first lookup's error, in the order of ``lookups``, unless
            ``return_exceptions`` (see :meth:`get`); an argument error before any
            I/O.
        """
        started = time.perf_counter()
        budget = self.timeout_s if timeout_s is None else timeout_s
        results: list[FeatureVectors | Exception | None] = [None] * len(lookups)
        pending: list[tuple[int, LookupRun, Step]] = []
        for index, (entity, ids, features) in enumerate(lookups):
            try:
                plan = self.core.plan(entity, ids, features, max_staleness, at)
                run = self.core.start(plan, self.breakers, self.near, started)
                step = run.send(None)
            except Exception as exc:
                if not return_exceptions:
                    raise
                results[index] = exc
                continue
            if step is None:  # answered by the near cache
                results[index] = run.result
            else:
                pending.append((index, run, step))
        since: tuple[str, float] | None = None  # the joint read's region and its start
        joint = self._joinable([step for _, _, step in pending])
        if joint:
            region = pending[joint[0]][2].region
            rest = [entry for position, entry in enumerate(pending) if position not in joint]
            try:
                reads = [pending[position][2] for position in joint]
                asked, replies = await self._read_jointly(reads, budget)  # type: ignore[arg-type]
                since = (region, asked)
            except Exception as exc:  # no connection in time (PoolExhaustedError)
                replies = [exc] * len(joint)
            for position, reply in zip(joint, replies, strict=True):
                index, run, _ = pending[position]
                if isinstance(reply, Exception):  # this lookup's error reply, as get raises it
                    results[index] = reply
                    continue
                try:
                    after = run.send(reply)
                except Exception as exc:
                    results[index] = exc
                    continue
                if after is None:
                    results[index] = run.result
                else:
                    rest.append((index, run, after))
            pending = rest
        if pending:
            outcomes = await asyncio.gather(
                *(self._drive(run, step, budget, since) for _, run, step in pending),
                return_exceptions=True,
            )
            for (index, _, _), outcome in zip(pending, outcomes, strict=True):
                if isinstance(outcome, Exception | FeatureVectors):
                    results[index] = outcome
                else:  # cancelled, or worse: not a lookup's error
                    raise outcome
        if not return_exceptions:
            for result in results:
                if isinstance(result, Exception):
                    raise result
        return results  # type: ignore[return-value]

    async def _drive(
        self,
        run: LookupRun,
        step: Step | None,
        budget: float,
        since: tuple[str, float] | None = None,
    ) -> FeatureVectors:
        """Run a lookup's steps from ``step`` on, each region's within ``budget`` from
        when the call got one of its connections (for ``since``'s region: from when
        the joint read that went before got its connection)."""
        held: str | None = None  # the region one of whose connections this call holds
        asked = 0.0
        try:
            while step is not None:
                if step.region != held:
                    if held is not None:
                        self.gates[held].release()
                        held = None
                    await self._admit(step.region, budget)
                    held = step.region
                    asked = asyncio.get_running_loop().time()  # the region's time starts
                    if since is not None and since[0] == held:
                        asked, since = since[1], None  # it started with the joint read
                step = run.send(await self._execute(step, asked, budget))
        finally:
            if held is not None:
                self.gates[held].release()
        return run.result

    async def _admit(self, region: str, wait_s: float) -> None:
        """Wait for one of ``region``'s connections: this process's own queue, never
        counted against the region (breaker, failover); shed after ``wait_s``."""
        try:
            async with asyncio.timeout(wait_s):
                await self.gates[region].acquire()
        except TimeoutError:
            raise PoolExhaustedError(
                f"all {self.max_connections} connections to region {region!r} stayed busy "
                f"for the call's {wait_s:g} s: this process sends more concurrent "
                "lookups than its pool holds; raise max_connections or admit fewer requests",
                region,
                retry_after_s=wait_s,
            ) from None

    def _joinable(self, steps: Sequence[Step]) -> list[int]:
        """Positions of the steps that can share one write: data reads (``MGET``) from
        the region of the first one, tracked alike, on a client that is not a cluster
        (a cluster spreads keys over nodes); [] when fewer than two."""
        reads = [position for position, step in enumerate(steps) if isinstance(step, Read)]
        if len(reads) < 2:
            return []
        first = steps[reads[0]]
        assert isinstance(first, Read)
        if isinstance(self.clients[first.region], aioredis.RedisCluster):
            return []
        joint = [
            position
            for position in reads
            if steps[position].region == first.region and steps[position].tracked == first.tracked  # type: ignore[union-attr]
        ]
        return joint if len(joint) > 1 else []

    async def _read_jointly(
        self, reads: Sequence[Read], budget_s: float
    ) -> tuple[float, list[Reply | Exception]]:
        """Data reads of one region, tracked alike (:meth:`_joinable`), in one write and
        one round trip (see :meth:`get_many`): the loop time the region's connection
        was had, and each read's answer, Failure (the joint read's) or error reply
        (its own)."""
        region = reads[0].region
        await self._admit(region, budget_s)
        try:
            asked = asyncio.get_running_loop().time()
            listener = self.listener
            redirect = listener.client_id if reads[0].tracked and listener is not None else None
            reply = await self._within(
                region,
                _amget_many(
                    self.clients[region],  # type: ignore[arg-type]
                    [read.keys for read in reads],
                    redirect,
                ),
                asked,
                budget_s,
            )
        finally:
            self.gates[region].release()
        if isinstance(reply, Failure):
            return asked, [reply] * len(reads)
        return asked, list(reply)

    async def _execute(self, step: Step, asked: float, budget_s: float) -> Reply:
        """One step, within the region's deadline (``budget_s`` after ``asked``, the
        loop time the call got the region's connection)."""
        return await self._within(step.region, self._read(step), asked, budget_s)

    async def _within(
        self, region: str, read: Awaitable[_R], asked: float, budget_s: float
    ) -> _R | Failure:
        """``read``'s answer, or a Failure if it did not come within the region's
        deadline: the region's failure, or a Late, a timeout while the region answered
        others (this process's)."""
        try:
            async with _ReadDeadline(asked + budget_s):
                reply = await read
        except _FAILURES as exc:
            answered = self._answered.get(region)
            if isinstance(exc, TimeoutError | RedisTimeoutError) and (
                answered is not None and answered > asked
            ):
                # The region answered other reads while this one waited (grace turns
                # included): the time went to this process's backlog, not to the region.
                return Late(
                    "timeout",
                    f"region {region!r} kept answering other lookups while this one "
                    f"waited past its {budget_s:g} s deadline: this process is behind (more "
                    "concurrent requests than its event loop serves in time, or new "
                    "connections); admit fewer requests or add workers",
                    retry_after_s=budget_s,
                )
            return _failure(exc, budget_s)
        self._answered[region] = asyncio.get_running_loop().time()
        return reply

    async def _read(self, step: Step) -> Reply:
        client = self.clients[step.region]
        if isinstance(step, ReadSchema):
            return await client.get(step.key)  # type: ignore[return-value]
        if isinstance(step, ReadRebuilding):
            return await client.hgetall(step.key)  # type: ignore[return-value]
        if isinstance(step, ReadTypes):
            pipe = client.pipeline(transaction=False)
            for key in step.keys:
                pipe.type(key)
            return [_text(t) for t in await pipe.execute()]
        if isinstance(client, aioredis.RedisCluster):
            return await client.mget_nonatomic(step.keys), None
        listener = self.listener
        redirect = listener.client_id if step.tracked and listener is not None else None
        return await _amget(client, step.keys, redirect)

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
