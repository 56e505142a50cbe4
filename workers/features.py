"""Feature lookup for models that read the region's edge cache (the ranking model).

The ranking model sees features only through :class:`FeatureSource`: an async
``get(entity, ids, features)`` returning a float32 matrix (rows = ids, columns =
features, NaN where missing) and a boolean mask of the missing cells.

:class:`EdgeCacheFeatureSource` is the production implementation: it wraps
:class:`edge_cache.AsyncFeatureClient` (one ``MGET`` per lookup, failover to
the region's fallbacks within the entity's residency zone, circuit breakers)
and turns the edge cache's errors into worker errors.

Lookups are coalesced: :class:`EdgeCacheFeatureSource` holds a lookup for a
few event loop turns, and answers every lookup asked for meanwhile with one
lookup per entity (the union of their ids, each id read once) instead of one
round trip per request and entity; the lookups of different entities (a ranking
request's user and items) go together through
:meth:`edge_cache.AsyncFeatureClient.get_many`: one write, one round trip. A
turn of an idle loop takes microseconds, so a lone request pays next to
nothing; under load turns are longer and more requests join (on the ranker's
benchmark, 2 requests per ``MGET`` at saturation). Per request, the answer is
what its own lookup would have returned: its rows, in its order, with its mask;
an error reaches every request of its entity's lookup.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

import numpy as np

from edge_cache import (
    AsyncFeatureClient,
    EdgeCacheError,
    FeatureSchema,
    LookupOverloadedError,
    RegionUnavailableError,
    SchemaVersionError,
    UnknownEntityError,
    UnknownFeatureError,
)
from workers.exceptions import FeatureLookupError, QueueFullError

__all__ = ["LOOKUPS_PER_REQUEST", "EdgeCacheFeatureSource", "FeatureSource", "pool_size"]

#: Concurrent lookups one ranking request makes (its user and its items, gathered).
#: Coalesced requests share them, so this bounds what a request can need.
LOOKUPS_PER_REQUEST = 2

_Group = tuple[str, tuple[str, ...] | None]
_Waiter = tuple[Sequence[str], "asyncio.Future[tuple[np.ndarray, np.ndarray]]"]


def pool_size(concurrency: int) -> int:
    """Connections per region the lookup client needs so that ``concurrency``
    requests in flight never wait for one (``max_connections`` of the client)."""
    return max(1, concurrency) * LOOKUPS_PER_REQUEST


@runtime_checkable
class FeatureSource(Protocol):
    """Where a model reads entity feature vectors from."""

    def get(
        self, entity: str, ids: Sequence[str], features: Sequence[str] | None = None
    ) -> Awaitable[tuple[np.ndarray, np.ndarray]]:
        """Features of ``ids``: (float32 rows x features, NaN when missing; missing mask).

        An ``async def`` implements it; so does a method returning a future.
        """
        ...

    async def aclose(self) -> None:
        """Release connections."""
        ...


class EdgeCacheFeatureSource:
    """Reads features through the edge cache's async lookup client.

    Args:
        client: An :class:`edge_cache.AsyncFeatureClient` for the worker's region
            (built with the schemas of the entities the model reads).
        max_staleness: Vectors older than this count as missing (None: any age).
        owns_client: Close the client in :meth:`aclose`.
        coalesce: Answer the lookups asked for within ``coalesce_turns`` event
            loop turns with one lookup per (entity, features) (see the module's
            docstring). False: one lookup per call.
        coalesce_turns: Loop turns a lookup waits for others to join it (4:
            on the ranker's benchmark, 2 requests per lookup at saturation and
            -34% worker CPU per request, against 1 without coalescing).
    """

    def __init__(
        self,
        client: AsyncFeatureClient,
        max_staleness: float | timedelta | None = None,
        *,
        owns_client: bool = True,
        coalesce: bool = True,
        coalesce_turns: int = 4,
    ) -> None:
        self.client = client
        self._max_staleness = max_staleness
        self._owns = owns_client
        self.coalesce = coalesce
        if coalesce_turns < 0:
            raise ValueError(f"coalesce_turns {coalesce_turns} must be 0 or more")
        self.coalesce_turns = coalesce_turns
        self._pending: dict[_Group, list[_Waiter]] = {}
        self._flushing: set[asyncio.Task[None]] = set()
        #: Lookups sent to the client, and the calls they answered (coalescing's yield).
        self.lookups = 0
        self.calls = 0

    def get(
        self, entity: str, ids: Sequence[str], features: Sequence[str] | None = None
    ) -> Awaitable[tuple[np.ndarray, np.ndarray]]:
        """Look up ``ids`` of ``entity``; see :class:`FeatureSource`.

        Coalescing, it returns a future (no task per call: ``asyncio.gather`` of
        two such lookups costs the caller nothing); otherwise a coroutine.

        Raises:
            QueueFullError: this worker is overloaded, not the region (429,
                Retry-After): every connection of the lookup pool stayed busy for the
                deadline, or the region's answer came in time but the event loop got
                round to it late (see :class:`edge_cache.LookupOverloadedError`).
            FeatureLookupError: the region (and its allowed fallbacks) is
                unavailable (retryable, 503), or the cache's schema does not
                have what the model reads (500).
        """
        self.calls += 1
        if not self.coalesce:
            self.lookups += 1
            return self._lookup(entity, ids, features)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[tuple[np.ndarray, np.ndarray]] = loop.create_future()
        if not self._pending:
            loop.call_soon(self._defer, loop, self.coalesce_turns)
        group = (entity, None if features is None else tuple(features))
        self._pending.setdefault(group, []).append((ids, future))
        return future

    def _defer(self, loop: asyncio.AbstractEventLoop, turns: int) -> None:
        # A turn of an idle loop takes microseconds; of a busy one, as long as the
        # callbacks ready in it: the wait grows with the load that fills it.
        if turns > 0:
            loop.call_soon(self._defer, loop, turns - 1)
        else:
            self._flush()

    def _flush(self) -> None:
        pending, self._pending = self._pending, {}
        if len(pending) == 1:
            ((entity, features), waiters), *_ = pending.items()
            task = asyncio.create_task(self._answer(entity, features, waiters))
        else:  # the user's and the items' lookups: one write, one round trip
            task = asyncio.create_task(self._answer_all(pending))
        self._flushing.add(task)
        task.add_done_callback(self._flushing.discard)

    async def _answer(
        self, entity: str, features: tuple[str, ...] | None, waiters: list[_Waiter]
    ) -> None:
        waiters = [(ids, future) for ids, future in waiters if not future.done()]
        if not waiters:  # every asker was cancelled (client gone) before the turn ended
            return
        self.lookups += 1
        union = _union(waiters)
        try:
            values, mask = await self._lookup(entity, union, features)
        except Exception as exc:  # each asker gets the lookup's error as its own
            _fail(waiters, exc)
            return
        except BaseException:  # cancelled (shutdown): the askers must not hang
            _cancel(waiters)
            raise
        _deliver(waiters, union, values, mask)

    async def _answer_all(self, pending: dict[_Group, list[_Waiter]]) -> None:
        """Every group's lookup in one :meth:`AsyncFeatureClient.get_many` call."""
        groups: list[tuple[str, tuple[str, ...] | None, list[_Waiter], Sequence[str]]] = []
        for (entity, features), waiters in pending.items():
            waiters = [(ids, future) for ids, future in waiters if not future.done()]
            if waiters:
                groups.append((entity, features, waiters, _union(waiters)))
        if not groups:
            return
        self.lookups += len(groups)
        try:
            results = await self.client.get_many(
                [(entity, list(union), features) for entity, features, _, union in groups],
                self._max_staleness,
                return_exceptions=True,
            )
        except Exception as exc:  # not a lookup's error: every asker gets it
            for _, _, waiters, _ in groups:
                _fail(waiters, exc)
            return
        except BaseException:  # cancelled (shutdown): the askers must not hang
            for _, _, waiters, _ in groups:
                _cancel(waiters)
            raise
        try:
            for (entity, _, waiters, union), result in zip(groups, results, strict=True):
                if isinstance(result, Exception):
                    _fail(waiters, _worker_error(entity, result))
                else:
                    _deliver(waiters, union, *_arrays(result))
        finally:  # a group whose answer could not be delivered must not hang its askers
            for _, _, waiters, _ in groups:
                _fail(waiters, FeatureLookupError("feature lookup failed", retryable=True))

    async def _lookup(
        self, entity: str, ids: Sequence[str], features: Sequence[str] | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """One lookup through the client, its errors turned into worker errors."""
        try:
            result = await self.client.get(entity, list(ids), features, self._max_staleness)
        except EdgeCacheError as exc:
            raise _worker_error(entity, exc) from None
        return _arrays(result)

    def schema(self, entity: str) -> FeatureSchema | None:
        """The schema this source reads ``entity`` with (None: not one it reads)."""
        reader = self.client.core.readers.get(entity)
        return None if reader is None else reader.schema

    async def aclose(self) -> None:
        """Finish the lookups in flight, then close the lookup client (when owned)."""
        if self._flushing:
            await asyncio.gather(*self._flushing, return_exceptions=True)
        if self._owns:
            await self.client.close()


def _union(waiters: list[_Waiter]) -> Sequence[str]:
    """The ids of every asker, each once, in the order first asked."""
    if len(waiters) == 1:
        return waiters[0][0]
    return list(dict.fromkeys(i for ids, _ in waiters for i in ids))


def _deliver(
    waiters: list[_Waiter], union: Sequence[str], values: np.ndarray, mask: np.ndarray
) -> None:
    """Each asker its own rows of the lookup of ``union``, in its order."""
    if len(waiters) == 1:
        future = waiters[0][1]
        if not future.done():
            future.set_result((values, mask))
        return
    position = {item: row for row, item in enumerate(union)}
    for ids, future in waiters:
        if not future.done():
            rows = np.fromiter((position[i] for i in ids), dtype=np.intp, count=len(ids))
            future.set_result((values[rows], mask[rows]))


def _fail(waiters: list[_Waiter], exc: BaseException) -> None:
    for _, future in waiters:
        if not future.done():
            future.set_exception(exc)


def _cancel(waiters: list[_Waiter]) -> None:
    for _, future in waiters:
        future.cancel()


def _arrays(result: Any) -> tuple[np.ndarray, np.ndarray]:
    # A corrupt value (result.corrupt, counted and logged by the client) and a
    # stored NaN read as missing: the request's on_missing policy decides.
    values: Any = result.to_numpy()
    return np.asarray(values, dtype=np.float32), np.asarray(result.mask, dtype=bool)


def _worker_error(entity: str, exc: Exception) -> Exception:
    """The edge cache's error as the worker answers it."""
    if isinstance(exc, LookupOverloadedError):  # this worker's overload, not the region's
        return QueueFullError(
            f"this worker takes more requests than it can look up in time: {exc}",
            retry_after_s=exc.retry_after_s,
        )
    if isinstance(exc, RegionUnavailableError):
        return FeatureLookupError(f"feature lookup failed: {exc}", retryable=True)
    if isinstance(exc, SchemaVersionError | UnknownEntityError | UnknownFeatureError):
        return FeatureLookupError(
            f"feature lookup of {entity!r} failed: {exc}; the model's feature list and "
            "the region's schemas disagree",
            retryable=False,
        )
    if isinstance(exc, EdgeCacheError):
        return FeatureLookupError(
            f"feature lookup of {entity!r} failed: {exc}", retryable=exc.retryable
        )
    return exc
