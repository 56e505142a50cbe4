"""A regional worker's working states: every entity in memory, or a bounded cache
of the hot ones in front of the local store (pipeline.localstore).

Sans I/O: the store is a port (:class:`StateLoader`), so that the rules run in
unit tests (tests/unit/pipeline/test_local_state.py):

1. A state changed since it last reached the local store is *dirty* and never
   evicted: its newest version exists only here. It is clean again once a
   checkpoint wrote it there (:meth:`StateCache.stored`) and nothing changed it
   since (each change takes a new generation number; the checkpoint passes the
   one it wrote).
2. Clean states are evicted, least recently used first, once the estimated
   memory of the cache is above its budget; a miss reads the state from the
   store again (the entity record and its row chunks).
3. Dirty states above :data:`DIRTY_SHARE` of the budget make the cache
   :attr:`~StateCache.full`: the worker starts a checkpoint then, before its
   interval, so that the estimate stays near the budget. Dirty states above the
   whole budget (changes came faster than a checkpoint stored them) make it
   :attr:`~StateCache.over`: the worker takes no new message until a checkpoint
   stored them (backpressure), so the estimate passes the budget by no more
   than the states one message changes (and one slice of renewals: their
   schedules are bookkeeping to store, and a renewal is a freshness bound).
4. Without a store (``loader`` None) nothing is evicted: the states are the
   whole truth, as before issue 36.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, MutableMapping
from itertools import chain
from typing import Protocol

from pipeline.features import EntityState

__all__ = ["DIRTY_SHARE", "ENTITY_BYTES", "ROW_BYTES", "StateCache", "StateLoader"]

# What one working state costs in memory, measured by benchmarks/scale.py (issue
# 36: 1.7 KB per stored row with its aggregate index, ~2 KB per entity besides):
# the estimate the budget is counted in.
ROW_BYTES = 1_700
ENTITY_BYTES = 2_000
# The share of the budget dirty states may take before a checkpoint is started
# early (:attr:`StateCache.full`): they cannot be evicted until one stores them,
# so without it they grew past the budget between checkpoints (377-509 MB
# against 256 in benchmarks/scale.py). Half: the other half is room for what the
# stream changes while that checkpoint runs (as much again as it stores, at the
# rate it came at), so a checkpoint that keeps up never meets the backpressure
# at the whole budget (:attr:`StateCache.over`), and the clean states, the hot
# ones read again soonest, keep at least half of it once it ends.
DIRTY_SHARE = 0.5


class StateLoader(Protocol):
    def load(self, key: str) -> EntityState | None:
        """The entity's state as the local store holds it (None: none there)."""
        ...


def _weight(state: EntityState) -> int:
    rows = state.get("rows") or {}
    return ENTITY_BYTES + ROW_BYTES * sum(len(r) for r in rows.values())


class StateCache(MutableMapping[str, EntityState]):
    """Entity key -> working state; iteration and ``len`` cover the states in memory.

    Dirty and clean states are kept apart, each in the order of their last use, so
    that an eviction pops clean states only: it never walks past dirty ones (a
    cache full of them between checkpoints made every eviction pass a scan).

    Args:
        loader: Reads a state missing here from the local store (None: no store, no
            eviction).
        budget_bytes: Estimated memory above which clean states are evicted.
    """

    def __init__(self, loader: StateLoader | None = None, budget_bytes: int | None = None):
        self.loader = loader
        self.budget_bytes = budget_bytes if loader is not None else None
        self._clean: OrderedDict[str, EntityState] = OrderedDict()  # least recent first
        self._changed: OrderedDict[str, EntityState] = OrderedDict()  # the dirty states
        self._weights: dict[str, int] = {}
        self._dirty: dict[str, int] = {}  # key -> generation of its newest change
        self._generation = 0
        self.weight = 0  # the estimated bytes of the states in memory
        self.dirty_weight = 0  # the part of it in dirty states
        self.loads = 0  # misses read from the store
        self.evictions = 0

    # -- mapping -----------------------------------------------------------------------------

    def __getitem__(self, key: str) -> EntityState:
        state = self.get(key)
        if state is None:
            raise KeyError(key)
        return state

    def get(self, key: str, default: EntityState | None = None) -> EntityState | None:  # type: ignore[override]
        state = self.peek(key)
        if state is not None:
            if self.budget_bytes is not None:
                (self._changed if key in self._dirty else self._clean).move_to_end(key)
            return state
        if self.loader is None:
            return default
        state = self.loader.load(key)
        if state is None:
            return default
        state.loaded = True  # its first vector's index is not kept (EntityEngine.schedule)
        self.loads += 1
        self._clean[key] = state
        weight = self._weights[key] = _weight(state)
        self.weight += weight
        self._evict(spare=1)  # not the state just read: its caller may change it in place
        return state

    def peek(self, key: str) -> EntityState | None:
        """``key``'s state if it is in memory (never read from the store; its place
        in the order of use unchanged)."""
        state = self._changed.get(key)
        return state if state is not None else self._clean.get(key)

    def __setitem__(self, key: str, state: EntityState) -> None:
        """A changed state: dirty until a checkpoint stores it."""
        self._clean.pop(key, None)
        self._changed[key] = state
        if self.budget_bytes is not None:
            self._changed.move_to_end(key)
        self._reweigh(key, state, key in self._dirty)
        self._generation += 1
        self._dirty[key] = self._generation
        self._evict()

    def __delitem__(self, key: str) -> None:
        if key in self._changed:
            del self._changed[key]
        else:
            del self._clean[key]
        weight = self._weights.pop(key, 0)
        self.weight -= weight
        if self._dirty.pop(key, None) is not None:
            self.dirty_weight -= weight

    def __contains__(self, key: object) -> bool:
        return key in self._changed or key in self._clean

    def __iter__(self) -> Iterator[str]:
        return chain(list(self._changed), list(self._clean))

    def __len__(self) -> int:
        return len(self._changed) + len(self._clean)

    def clear(self) -> None:
        self._clean.clear()
        self._changed.clear()
        self._weights.clear()
        self._dirty.clear()
        self.weight = self.dirty_weight = 0

    # -- dirty and clean ---------------------------------------------------------------------

    def changed(self, key: str) -> None:
        """``key``'s bookkeeping changed in place (its rows did not): dirty again,
        its weight as it was (not counted again: this runs for every vector
        written)."""
        if key in self._dirty:
            if self.budget_bytes is not None:
                self._changed.move_to_end(key)
        else:
            state = self._clean.pop(key, None)
            if state is None:
                return
            self._changed[key] = state
            self.dirty_weight += self._weights.get(key, 0)
        self._generation += 1
        self._dirty[key] = self._generation

    def generation(self, key: str) -> int | None:
        """The generation of ``key``'s newest change (None: clean)."""
        return self._dirty.get(key)

    def stored(self, written: list[tuple[str, int | None]]) -> None:
        """A checkpoint wrote these states to the local store, each as of the
        generation given: those unchanged since are clean (evictable) again, in the
        order of their last use."""
        cleaned = set()
        for key, generation in written:
            if generation is not None and self._dirty.get(key) == generation:
                del self._dirty[key]
                self.dirty_weight -= self._weights.get(key, 0)
                cleaned.add(key)
        if not cleaned:
            return
        for key in [k for k in self._changed if k in cleaned]:
            self._clean[key] = self._changed.pop(key)
        self._evict()

    @property
    def dirty(self) -> int:
        return len(self._dirty)

    @property
    def full(self) -> bool:
        """Dirty states hold more than :data:`DIRTY_SHARE` of the budget: a checkpoint
        should store them now, so that they become evictable."""
        budget = self.budget_bytes
        return budget is not None and self.dirty_weight > DIRTY_SHARE * budget

    @property
    def over(self) -> bool:
        """Dirty states hold more than the whole budget (changes came faster than
        checkpoints stored them): no new change should be taken until a checkpoint
        stored them, or the estimate would grow past the budget."""
        budget = self.budget_bytes
        return budget is not None and self.dirty_weight > budget

    # -- internals ---------------------------------------------------------------------------

    def _reweigh(self, key: str, state: EntityState, was_dirty: bool) -> None:
        old = self._weights.get(key, 0)
        new = self._weights[key] = _weight(state)
        self.weight += new - old
        self.dirty_weight += new - (old if was_dirty else 0)

    def _evict(self, spare: int = 0) -> None:
        """Drop clean states, least recently used first, down to the budget (the
        ``spare`` most recent stay)."""
        budget = self.budget_bytes
        if budget is None:
            return
        clean = self._clean
        while self.weight > budget and len(clean) > spare:
            key, _state = clean.popitem(last=False)
            self.weight -= self._weights.pop(key, 0)
            self.evictions += 1
