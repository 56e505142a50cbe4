"""The optional in-process near cache, kept coherent by Redis client-side caching.

Redis "server-assisted client-side caching" (``CLIENT TRACKING``): the data
connections of the lookup client are switched to ``CLIENT TRACKING ON
REDIRECT <id>``, so Redis remembers which keys they read and, when one of them
is modified, deleted or expires, pushes an ``invalidate`` message to the
connection ``<id>``. That connection is a RESP3 connection owned by
:class:`InvalidationListener`, whose thread drops the named keys from the
:class:`NearCache`.

On a Redis Cluster there is one such connection per primary, in broadcast mode
(``CLIENT TRACKING ON BCAST PREFIX ...``): Redis pushes an invalidation for every
write under the entity prefixes on that node, so the data connections (owned by
redis-py's cluster client) need no redirect; :class:`ListenerGroup` keeps the
cache off unless every primary's connection is up. The async client uses the
same thread-backed listeners.

Guarantees: an entry is served only while it is younger than the TTL and only
while the invalidation connection is up; an invalidation that arrives while a
read of the same key is in flight prevents that read from filling the cache
(reserve/fill tokens); when the invalidation connection drops, the whole cache
is flushed and disabled until it is back; a data connection that was not
re-pointed at the new invalidation connection is reconnected before its next
near-cached read.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis

__all__ = ["InvalidationListener", "ListenerGroup", "NearCache", "NearCacheConfig"]

log = logging.getLogger(__name__)

_ABSENT = b""  # a cached "no such key" (real values are never empty)


@dataclass(frozen=True, slots=True)
class NearCacheConfig:
    """Bounds of the near cache.

    Attributes:
        max_entries: Most keys held (least recently used are evicted).
        ttl_s: Longest time an entry is served after it was read from Redis,
            even if no invalidation arrives (the bound that holds if the
            invalidation channel silently stalls).
    """

    max_entries: int = 100_000
    ttl_s: float = 1.0

    def __post_init__(self) -> None:
        if self.max_entries < 1 or self.ttl_s <= 0:
            from edge_cache.exceptions import ConfigError

            raise ConfigError(
                f"near cache needs max_entries >= 1 and ttl_s > 0, got {self.max_entries}, "
                f"{self.ttl_s}"
            )


class NearCache:
    """Raw values by key, bounded in size and age, invalidated from outside. Thread-safe."""

    def __init__(
        self, config: NearCacheConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self._clock = clock
        self._data: OrderedDict[str, tuple[bytes, float]] = OrderedDict()
        self._pending: dict[str, int] = {}
        self._tokens = itertools.count(1)
        self._lock = threading.Lock()
        self.generation = 0
        self.active = False  # True only while invalidations can reach us
        self.invalidations = 0

    def __len__(self) -> int:
        return len(self._data)

    def lookup(self, keys: Sequence[str]) -> tuple[list[bytes | None], list[int]]:
        """Cached values (None where absent in Redis) and the indices of keys not cached."""
        values: list[bytes | None] = [None] * len(keys)
        misses: list[int] = []
        if not self.active:
            return values, list(range(len(keys)))
        oldest = self._clock() - self.config.ttl_s
        data = self._data
        with self._lock:
            for index, key in enumerate(keys):
                entry = data.get(key)
                if entry is None or entry[1] <= oldest:
                    misses.append(index)
                    continue
                data.move_to_end(key)
                value = entry[0]
                values[index] = value if value else None
        return values, misses

    def reserve(self, keys: Sequence[str]) -> tuple[int, int]:
        """Mark ``keys`` as being read; returns the token :meth:`fill` needs."""
        token = next(self._tokens)
        with self._lock:
            pending = self._pending
            if len(pending) > 4 * self.config.max_entries:
                pending.clear()  # abandoned reservations (failed reads) must not pile up
            for key in keys:
                pending[key] = token
            return self.generation, token

    def fill(
        self, keys: Sequence[str], values: Sequence[bytes | None], ticket: tuple[int, int]
    ) -> None:
        """Store values read after :meth:`reserve`, unless invalidated meanwhile."""
        generation, token = ticket
        now = self._clock()
        with self._lock:
            if generation != self.generation or not self.active:
                return
            data, pending = self._data, self._pending
            for key, value in zip(keys, values, strict=True):
                if pending.get(key) != token:
                    continue
                del pending[key]
                data[key] = (value if value is not None else _ABSENT, now)
                data.move_to_end(key)
            while len(data) > self.config.max_entries:
                data.popitem(last=False)

    def invalidate(self, keys: Sequence[str] | None) -> None:
        """Drop ``keys`` (None: everything, as after FLUSHALL)."""
        with self._lock:
            self.invalidations += 1
            if keys is None:
                self._data.clear()
                self._pending.clear()
                return
            for key in keys:
                self._data.pop(key, None)
                self._pending.pop(key, None)

    def set_active(self, active: bool) -> None:
        """Turn serving on or off; any change flushes and starts a new generation."""
        with self._lock:
            self._data.clear()
            self._pending.clear()
            self.generation += 1
            self.active = active


class InvalidationListener:
    """Owns the RESP3 connection that receives ``invalidate`` pushes, on a daemon thread.

    Args:
        url: Redis URL of the server (a single-server region, or one cluster primary).
        cache: The near cache to invalidate.
        bcast_prefixes: Broadcast mode (used on clusters): track every key with
            these prefixes written on this server, whoever read it, instead of
            the keys that redirecting data connections read.
        on_state: Called with True when the connection is up, False when lost;
            by default the cache is switched on and off directly.
        reconnect_s: Pause between reconnection attempts.
        connect_timeout_s: Timeout of connecting and of the handshake.
        redis_options: More redis-py options (the reader's ACL user, TLS).
    """

    def __init__(
        self,
        url: str,
        cache: NearCache,
        *,
        bcast_prefixes: Sequence[str] = (),
        on_state: Callable[[bool], None] | None = None,
        reconnect_s: float = 0.5,
        connect_timeout_s: float = 1.0,
        redis_options: Mapping[str, Any] | None = None,
    ) -> None:
        self._bcast = tuple(bcast_prefixes)
        self._on_state = on_state or cache.set_active
        self._pool = redis.ConnectionPool.from_url(
            url,
            protocol=3,
            socket_connect_timeout=connect_timeout_s,
            socket_timeout=connect_timeout_s,
            **(redis_options or {}),
        )
        self.cache = cache
        self.client_id: int | None = None
        self._reconnect_s = reconnect_s
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="edgefeed-near-cache", daemon=True)

    def start(self, wait_s: float = 2.0) -> bool:
        """Start the thread; wait up to ``wait_s`` for the first connection. True if connected."""
        self._thread.start()
        return self.wait(wait_s)

    def wait(self, wait_s: float) -> bool:
        """Wait up to ``wait_s`` for the first connection. True if connected."""
        return self._ready.wait(wait_s)

    def stop(self) -> None:
        """Stop the thread and close the connection (the cache is switched off)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._pool.disconnect()

    def _run(self) -> None:
        while not self._stop.is_set():
            connection: Any = None
            try:
                connection = self._pool.make_connection()
                connection.connect()
                connection.send_command("CLIENT", "ID")
                self.client_id = int(connection.read_response())
                connection._parser.set_invalidation_push_handler(self._on_push)
                if self._bcast:
                    prefixes = [part for p in self._bcast for part in ("PREFIX", p)]
                    connection.send_command("CLIENT", "TRACKING", "ON", "BCAST", *prefixes)
                    connection.read_response()
                self._on_state(True)
                self._ready.set()
                while not self._stop.is_set():
                    if connection.can_read(timeout=0.2):
                        connection.read_response(push_request=True, disconnect_on_error=False)
            except (redis.RedisError, OSError) as exc:
                if self.cache.active:
                    log.warning("near cache disabled: invalidation connection lost (%s)", exc)
            finally:
                self.client_id = None
                self._on_state(False)
                if connection is not None:
                    connection.disconnect()
            self._stop.wait(self._reconnect_s)

    def _on_push(self, message: list[Any]) -> list[Any]:
        keys = message[1] if len(message) > 1 else None
        if keys is None:
            self.cache.invalidate(None)
        else:
            self.cache.invalidate([k.decode() if isinstance(k, bytes) else str(k) for k in keys])
        return message


class ListenerGroup:
    """Several listeners (one per cluster primary) feeding one cache: the cache
    serves only while every one of them is connected."""

    def __init__(self, cache: NearCache, size: int) -> None:
        self.cache = cache
        self._up = [False] * size
        self._lock = threading.Lock()

    def on_state(self, index: int) -> Callable[[bool], None]:
        """The ``on_state`` callback of listener ``index``."""

        def update(up: bool) -> None:
            with self._lock:
                self._up[index] = up
                if not up:
                    self.cache.set_active(False)
                elif all(self._up) and not self.cache.active:
                    self.cache.set_active(True)

        return update
