"""A regional worker's working states: every entity in memory, or a bounded cache
of the hot ones in front of the local store (pipeline.localstore).

Sans I/O: the store is a port (:class:`StateLoader`), so that the rules run in
unit tests (tests/unit/pipeline/test_state_cache.py):

1. A state changed since it last reached the local store is *dirty* and never
   evicted: its newest version exists only here. It is clean again once a
   checkpoint wrote it there (:meth:`StateCache.stored`) and nothing changed it
   since (each change takes a new generation number; the checkpoint passes the
   one it wrote).
2. Clean states are evicted, least recently used first, once the estimated
   memory of the cache is above its budget; a miss reads the state from the
   store again (the entity record and its row chunks).
3. Without a store (``loader`` None) nothing is evicted: the states are the
   whole truth, as before issue 36.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, MutableMapping
from typing import Protocol

from pipeline.features import EntityState

__all__ = ["ENTITY_BYTES", "ROW_BYTES", "StateCache", "StateLoader"]

# What one working state costs in memory, measured by benchmarks/scale.py (issue
# 36: 1.7 KB per stored row with its aggregate index, ~2 KB per entity besides):
# the estimate the budget is counted in.
ROW_BYTES = 1_700
ENTITY_BYTES = 2_000
EVICT_SCAN = 256  # states looked at by one eviction pass, at most


class StateLoader(Protocol):
    def load(self, key: str) -> EntityState | None:
        """The entity's state as the local store holds it (None: none there)."""
        ...


def _weight(state: EntityState) -> int:
    rows = state.get("rows") or {}
    return ENTITY_BYTES + ROW_BYTES * sum(len(r) for r in rows.values())


class StateCache(MutableMapping[str, EntityState]):
    """Entity key -> working state; iteration and ``len`` cover the states in memory.

    Args:
        loader: Reads a state missing here from the local store (None: no store, no
            eviction).
        budget_bytes: Estimated memory above which clean states are evicted.
    """

    def __init__(self, loader: StateLoader | None = None, budget_bytes: int | None = None):
        self.loader = loader
        self.budget_bytes = budget_bytes if loader is not None else None
        self._hot: OrderedDict[str, EntityState] = OrderedDict()
        self._weights: dict[str, int] = {}
        self._dirty: dict[str, int] = {}  # key -> generation of its newest change
        self._generation = 0
        self.weight = 0  # the estimated bytes of the states in memory
        self.loads = 0  # misses read from the store
        self.evictions = 0

    # -- mapping -----------------------------------------------------------------------------

    def __getitem__(self, key: str) -> EntityState:
        state = self.get(key)
        if state is None:
            raise KeyError(key)
        return state

    def get(self, key: str, default: EntityState | None = None) -> EntityState | None:  # type: ignore[override]
        state = self._hot.get(key)
        if state is not None:
            if self.budget_bytes is not None:
                self._hot.move_to_end(key)
            return state
        if self.loader is None:
            return default
        state = self.loader.load(key)
        if state is None:
            return default
        self.loads += 1
        self._put(key, state)
        self._evict()
        return state

    def __setitem__(self, key: str, state: EntityState) -> None:
        """A changed state: dirty until a checkpoint stores it."""
        self._put(key, state)
        self._generation += 1
        self._dirty[key] = self._generation
        self._evict()

    def __delitem__(self, key: str) -> None:
        del self._hot[key]
        self.weight -= self._weights.pop(key, 0)
        self._dirty.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._hot

    def __iter__(self) -> Iterator[str]:
        return iter(self._hot)

    def __len__(self) -> int:
        return len(self._hot)

    def clear(self) -> None:
        self._hot.clear()
        self._weights.clear()
        self._dirty.clear()
        self.weight = 0

    # -- dirty and clean ---------------------------------------------------------------------

    def changed(self, key: str) -> None:
        """``key``'s state changed in place (its bookkeeping, say): dirty again."""
        if key in self._hot:
            self._generation += 1
            self._dirty[key] = self._generation
            state = self._hot[key]
            old = self._weights.get(key, 0)
            new = self._weights[key] = _weight(state)
            self.weight += new - old

    def generation(self, key: str) -> int | None:
        """The generation of ``key``'s newest change (None: clean)."""
        return self._dirty.get(key)

    def stored(self, written: list[tuple[str, int | None]]) -> None:
        """A checkpoint wrote these states to the local store, each as of the
        generation given: those unchanged since are clean (evictable) again."""
        for key, generation in written:
            if generation is not None and self._dirty.get(key) == generation:
                del self._dirty[key]
        self._evict()

    @property
    def dirty(self) -> int:
        return len(self._dirty)

    # -- internals ---------------------------------------------------------------------------

    def _put(self, key: str, state: EntityState) -> None:
        old = self._weights.get(key, 0)
        self._hot[key] = state
        if self.budget_bytes is not None:
            self._hot.move_to_end(key)
        new = self._weights[key] = _weight(state)
        self.weight += new - old

    def _evict(self) -> None:
        if self.budget_bytes is None or self.weight <= self.budget_bytes:
            return
        # Least recently used first; a dirty state met on the way goes to the back
        # (it is in use). A pass looks at a bounded number of states, so that a
        # cache full of dirty ones (a checkpoint behind) costs no quadratic time:
        # it stays above its budget until the checkpoint makes them clean.
        for _ in range(min(len(self._hot), EVICT_SCAN)):
            if self.weight <= self.budget_bytes:
                return
            key, state = self._hot.popitem(last=False)
            if key in self._dirty:
                self._hot[key] = state
                continue
            self.weight -= self._weights.pop(key, 0)
            self.evictions += 1
