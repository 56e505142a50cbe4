"""The regional worker's states on local disk (pipeline.localstore, a real RocksDB
in a temporary folder) and the bounded cache in front of them
(pipeline.runtime.states), alone and under the worker's runtime."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry
from test_runtime import (  # type: ignore[import-not-found]
    SETTINGS,
    T0,
    Clock,
    FakeAcker,
    FakeCache,
    FakeDeadLetters,
    Journal,
    acked,
    pack,
    view,
)

from pipeline.exceptions import StateStoreError
from pipeline.features import EntityState, FeatureEngine
from pipeline.localstore import ChangelogWriter, LocalStates, memtable_bytes
from pipeline.metrics import PipelineMetrics
from pipeline.runtime import BatchPolicy, Delivery, RegionRuntime
from pipeline.runtime.region import renewal_due
from pipeline.runtime.states import ENTITY_BYTES, ROW_BYTES, StateCache
from pipeline.statestore import checkpoint_key, store_state

VERSIONS = {e.name: e.version for e in SETTINGS.entities}


def until_of(key: str, record: Mapping[str, Any]) -> int | None:
    until = record.get("until")
    return until if isinstance(until, int) else None


def open_states(root: Path, renewal_of: Any = until_of) -> LocalStates:
    return LocalStates(root, renewal_of, VERSIONS, cache_mb=8)


def rec(value: Any) -> bytes:
    return orjson.dumps(value)


# -- the partition database ---------------------------------------------------------------


def test_records_and_the_offset_they_reach_are_written_together(tmp_path: Path) -> None:
    states = open_states(tmp_path)
    store = states.partition(0)
    assert store.offset() is None and store.created
    row = [10, 0, T0, None, {"kind": "view"}]
    store.apply(
        [
            (b"user:7", rec({"lsn": 10, "rev": 1, "ts": 0, "gone": None})),
            (f"user:7\x1fpublic.events\x1f{T0 // 3_600_000}".encode(), rec({"1": row})),
            (b"user:8", rec({"lsn": 11, "rev": 1, "ts": 0, "gone": None})),
        ],
        offset=41,
    )
    assert store.offset() == 41
    loaded = store.load("user:7")
    assert loaded is not None and loaded["lsn"] == 10
    assert loaded["rows"] == {"public.events": {"1": row}}
    assert store.load("user:9") is None
    assert sorted(store.entity_keys()) == ["user:7", "user:8"]
    states.close()
    again = open_states(tmp_path)  # the same folder again: nothing read, all there
    assert again.partition(0).offset() == 41
    assert again.partition(0).load("user:8") is not None
    assert not again.partition(0).created
    again.close()


def test_the_stores_memory_outside_its_cache_does_not_grow_with_its_size(
    tmp_path: Path,
) -> None:
    """The tables' indexes live in the block cache (bounded by ``cache_mb``): what
    an open store holds outside it is a few KB per table file, not a share of the
    data (RocksDB's default keeps every file's whole index in memory: ~2.5% of the
    store, 340 MB at 10M users)."""
    import os

    states = open_states(tmp_path)
    store = states.partition(0)
    for part in range(8):  # ~24 MB of barely compressible rows, in several files
        records = []
        for i in range(3_000):
            n = part * 3_000 + i
            records.append((f"user:{n:08d}".encode(), rec({"lsn": n, "rev": 1, "ts": 0})))
            records.append(
                (f"user:{n:08d}\x1fpublic.events\x1f1".encode(), rec({"1": os.urandom(500).hex()}))
            )
        store.apply(records, offset=part)
        store.db.flush()
    loaded = [store.load(f"user:{n:08d}") for n in range(0, 24_000, 97)]
    assert all(state is not None for state in loaded)
    sst = store.db.property_int_value("rocksdb.total-sst-files-size")
    outside = store.db.property_int_value("rocksdb.estimate-table-readers-mem")
    in_cache = store.db.property_int_value("rocksdb.block-cache-usage")
    assert sst > 20 << 20
    assert outside < sst / 2_000, (outside, sst)  # RocksDB's default: ~sst / 40
    assert 0 < in_cache <= 8 << 20  # the indexes and data blocks read, within cache_mb
    states.close()


def test_the_memtables_of_all_partitions_share_one_budget(tmp_path: Path) -> None:
    """Eight partitions each written ~5 MB in checkpoints' batches, none enough for a
    flush of its own (a partition's memtable takes 8 MB): their memtables together
    stay near the worker's budget (16 MB with ``cache_mb=8``), not 8 x 5 MB."""
    import os
    import time

    states = open_states(tmp_path)
    budget = memtable_bytes(8)
    for checkpoint in range(10):
        for partition in range(8):
            records = [
                (f"user:{n:06d}".encode(), rec({"pad": os.urandom(400).hex()}))
                for n in range(checkpoint * 500, (checkpoint + 1) * 500)
            ]
            states.partition(partition).apply(records, offset=checkpoint)

    def total() -> int:
        return sum(
            states.partition(p).db.property_int_value("rocksdb.cur-size-all-mem-tables")
            for p in range(8)
        )

    deadline = time.monotonic() + 30
    while total() > budget * 1.25:  # flushes run on RocksDB's threads
        assert time.monotonic() < deadline, (total(), budget)
        time.sleep(0.05)
    assert all(states.partition(p).load(f"user:{4_999:06d}") is not None for p in range(8))
    states.close()


def test_an_entity_reads_only_its_own_records_whatever_its_neighbours_ids(
    tmp_path: Path,
) -> None:
    """A load is one range read from the entity's key up to ``key\\x20``: the ids that
    sort inside it (``user:7\\n``, from hostile input) are other entities."""
    states = open_states(tmp_path)
    store = states.partition(0)
    mine, theirs = [10, 0, T0, None, {"kind": "view"}], [11, 0, T0, None, {"kind": "click"}]
    store.apply(
        [
            (b"user:7", rec({"lsn": 10, "rev": 1, "ts": 0, "gone": None})),
            (b"user:7\x1fpublic.events\x1f1", rec({"1": mine})),
            (b"user:7\n", rec({"lsn": 11, "rev": 1, "ts": 0, "gone": None})),
            (b"user:7\n\x1fpublic.events\x1f1", rec({"2": theirs})),
            (b"user:70", rec({"lsn": 12, "rev": 1, "ts": 0, "gone": None})),
        ],
        offset=1,
    )
    loaded, other = store.load("user:7"), store.load("user:7\n")
    assert loaded is not None and loaded["lsn"] == 10
    assert loaded["rows"] == {"public.events": {"1": mine}}
    assert other is not None and other["rows"] == {"public.events": {"2": theirs}}
    states.close()


def test_an_entity_with_many_chunks_in_several_tables_loads_them_all(tmp_path: Path) -> None:
    """A table's chunks are decoded together: every row of every chunk comes back,
    in its own table, and a row found in two chunks keeps the later chunk's entry
    (the key order the changelog's records are read in)."""
    states = open_states(tmp_path)
    events = {str(i): [10 + i, 0, T0 + i * 10_000, 0, {"kind": "view", "n": i}] for i in range(30)}
    items = {"a": [50, 0, T0, 0, {"price": 1.5}], "b": [51, 0, T0, 0, {"price": None}]}
    moved = [60, 0, T0 + 99_000, 0, {"kind": "click"}]
    records = [(b"user:7", rec({"lsn": 60, "rev": 3, "ts": 0, "gone": None}))]
    for pk, entry in events.items():  # one chunk per row, as 10 s of event time each
        records.append((f"user:7\x1fpublic.events\x1f{1000 + int(pk)}".encode(), rec({pk: entry})))
    records.append((b"user:7\x1fpublic.events\x1f1999", rec({"3": moved})))
    records.append((b"user:7\x1fpublic.items\x1f5", rec(items)))
    states.partition(0).apply(records, offset=len(records))
    loaded = states.partition(0).load("user:7")
    assert loaded is not None and loaded["lsn"] == 60
    assert loaded["rows"] == {"public.events": {**events, "3": moved}, "public.items": items}
    states.close()


def test_a_chunk_without_its_entity_record_still_loads(tmp_path: Path) -> None:
    """A cut-short checkpoint: rows without the entity record (as rebuild_states)."""
    states = open_states(tmp_path)
    row = [12, 0, T0, None, {}]
    states.partition(0).apply([(b"user:7\x1fpublic.events\x1f1", rec({"1": row}))], 3)
    loaded = states.partition(0).load("user:7")
    assert loaded is not None and loaded["lsn"] == 12 and loaded["rev"] == 0
    states.close()


def test_the_renewal_index_follows_each_entity_record(tmp_path: Path) -> None:
    states = open_states(tmp_path)
    store = states.partition(0)
    store.apply([(b"user:1", rec({"until": 500})), (b"user:2", rec({"until": 300}))], 1)
    store.apply([(b"user:3", rec({"until": None}))], 2)  # never runs out: not indexed
    assert [(u, k) for u, k, _ in store.due(None, 1_000, 10)] == [(300, "user:2"), (500, "user:1")]
    store.apply([(b"user:2", rec({"until": 900}))], 3)  # renewed: moved, not duplicated
    assert [(u, k) for u, k, _ in store.due(None, 1_000, 10)] == [(500, "user:1"), (900, "user:2")]
    store.apply([(b"user:1", None)], 4)  # deleted: gone from the index
    assert [k for _, k, _ in store.due(None, 1_000, 10)] == ["user:2"]
    # in one batch, the last record of a key decides
    store.apply([(b"user:4", rec({"until": 100})), (b"user:4", rec({"until": 200}))], 5)
    assert [(u, k) for u, k, _ in store.due(None, 250, 10)] == [(200, "user:4")]
    states.close()


def test_due_entries_are_read_after_a_cursor_up_to_now_and_a_limit(tmp_path: Path) -> None:
    states = open_states(tmp_path)
    store = states.partition(0)
    store.apply([(f"user:{i}".encode(), rec({"until": 100 + i})) for i in range(10)], 1)
    first = store.due(None, 105, 3)
    assert [k for _, k, _ in first] == ["user:0", "user:1", "user:2"]
    rest = store.due(first[-1][2], 105, 100)
    assert [k for _, k, _ in rest] == ["user:3", "user:4", "user:5"]  # none after now
    assert store.due(rest[-1][2], 105, 100) == []
    states.close()


def test_the_owner_fence_survives_a_restart(tmp_path: Path) -> None:
    """Only the changelog's tail is read after a restart: the highest epoch seen
    before it must still fence a late previous owner."""
    states = open_states(tmp_path)
    store = states.partition(0)
    assert store.admit(3) and store.admit(None)
    store.apply([], 10)
    states.close()
    again = open_states(tmp_path).partition(0)
    assert not again.admit(2)  # an earlier owner's late record
    assert again.admit(3)
    assert again.next_epoch() == 4


def test_changed_feature_versions_make_every_vector_due(tmp_path: Path) -> None:
    states = LocalStates(
        tmp_path, lambda k, r: renewal_due(FeatureEngine(SETTINGS.entities), k, r), VERSIONS
    )
    version = VERSIONS["user"]
    record = {"rev": 2, "wrev": 2, "v": version, "until": 10**15}
    states.partition(0).apply([(b"user:1", rec(record))], 1)
    assert states.partition(0).due(None, 10**12, 10) == []
    states.close()
    bumped = {**VERSIONS, "user": version + 1}
    engine = FeatureEngine(
        [
            e.model_copy(update={"version": version + 1}) if e.name == "user" else e
            for e in SETTINGS.entities
        ]
    )
    again = LocalStates(tmp_path, lambda k, r: renewal_due(engine, k, r), bumped)
    assert [(u, k) for u, k, _ in again.partition(0).due(None, 10**12, 10)] == [(0, "user:1")]
    again.close()


def test_workers_on_one_host_take_folders_of_their_own(tmp_path: Path) -> None:
    first, second = open_states(tmp_path), open_states(tmp_path)
    assert {first.folder.name, second.folder.name} == {"w0", "w1"}
    first.close()
    third = open_states(tmp_path)  # a restarted worker takes the free one
    assert third.folder.name == "w0"
    second.close()
    third.close()


def test_a_write_the_disk_refuses_is_a_clear_error(tmp_path: Path) -> None:
    states = open_states(tmp_path)
    store = states.partition(0)
    real = store._handle

    class Refusing:
        def write(self, batch: Any) -> None:
            raise OSError("IO error: No space left on device: While appending to file")

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

    store._handle = Refusing()
    with pytest.raises(StateStoreError, match="No space left") as caught:
        store.apply([(b"user:1", rec({}))], 1)
    assert str(tmp_path) in str(caught.value) and "pipeline.state_dir" in str(caught.value)
    store._handle = real
    store.apply([(b"user:1", rec({}))], 1)  # opened again: it writes once the disk does
    assert store.offset() == 1
    states.close()


# -- the bounded cache --------------------------------------------------------------------


class DictLoader:
    def __init__(self) -> None:
        self.stored: dict[str, EntityState] = {}
        self.loads: list[str] = []

    def load(self, key: str) -> EntityState | None:
        self.loads.append(key)
        found = self.stored.get(key)
        return EntityState(found) if found is not None else None


def entity(rows: int = 0) -> EntityState:
    return EntityState(rows={"t": {str(i): [i, 0, 0, None, {}] for i in range(rows)}}, rev=1)


def test_dirty_states_are_never_evicted_clean_ones_least_recent_first() -> None:
    loader = DictLoader()
    cache = StateCache(loader, budget_bytes=3 * ENTITY_BYTES)
    for i in range(5):
        cache[f"e:{i}"] = entity()  # all dirty: over budget, nothing dropped
    assert len(cache) == 5 and cache.dirty == 5
    for i in range(5):
        loader.stored[f"e:{i}"] = cache[f"e:{i}"]
    cache.get("e:0")  # used last: the most recent
    cache.stored([(f"e:{i}", cache.generation(f"e:{i}")) for i in range(5)])
    assert sorted(cache) == ["e:0", "e:3", "e:4"]  # e:1 and e:2 were the least recent
    assert cache.weight <= 3 * ENTITY_BYTES
    again = cache.get("e:1")  # read again from the store
    assert again is not None and loader.loads == ["e:1"]


def test_a_state_changed_after_its_checkpoint_took_it_stays_dirty() -> None:
    cache = StateCache(DictLoader(), budget_bytes=0)
    cache["e:1"] = entity()
    taken = cache.generation("e:1")
    cache["e:1"] = entity(2)  # changed while the checkpoint ran
    cache.stored([("e:1", taken)])
    assert "e:1" in cache and cache.generation("e:1") is not None
    cache.stored([("e:1", cache.generation("e:1"))])
    assert "e:1" not in cache  # budget 0: dropped once clean


def test_the_weight_counts_rows() -> None:
    cache = StateCache(DictLoader(), budget_bytes=10**9)
    cache["e:1"] = entity(3)
    assert cache.weight == ENTITY_BYTES + 3 * ROW_BYTES
    del cache["e:1"]
    assert cache.weight == 0


def test_an_eviction_passes_over_dirty_states_however_many() -> None:
    """Dirty states are kept apart from the clean ones: a cache far over its budget
    with dirty states drops the least recent clean ones, and only those."""
    loader = DictLoader()
    cache = StateCache(loader, budget_bytes=2 * ENTITY_BYTES)
    for i in range(3):
        loader.stored[f"c:{i}"] = entity()
        cache.get(f"c:{i}")  # clean, read from the store
    for i in range(1000):
        cache[f"d:{i}"] = entity()
    assert cache.dirty == 1000 and cache.evictions == 3
    assert "c:0" not in cache and all(f"d:{i}" in cache for i in range(1000))
    assert cache.peek("c:1") is None and loader.loads == ["c:0", "c:1", "c:2"]  # no read


def test_dirty_states_over_their_share_of_the_budget_make_the_cache_full() -> None:
    cache = StateCache(DictLoader(), budget_bytes=10 * ENTITY_BYTES)
    for i in range(5):
        cache[f"e:{i}"] = entity()
    assert cache.dirty_weight == 5 * ENTITY_BYTES and not cache.full
    cache["e:5"] = entity()
    assert cache.full
    cache.stored([(f"e:{i}", cache.generation(f"e:{i}")) for i in range(6)])
    assert cache.dirty_weight == 0 and not cache.full and cache.weight == 6 * ENTITY_BYTES
    cache["e:0"] = entity(2)  # dirty again, and heavier
    assert cache.dirty_weight == ENTITY_BYTES + 2 * ROW_BYTES
    assert not StateCache(None, budget_bytes=0).full  # without a store: never


def test_bookkeeping_changed_in_place_dirties_a_state_at_the_weight_it_had() -> None:
    """A vector written changes its state's bookkeeping, not its rows: the state is
    dirty again (clean ones move to the dirty), its weight counted as it was."""
    loader = DictLoader()
    loader.stored["e:1"] = entity(3)
    cache = StateCache(loader, budget_bytes=10**9)
    state = cache.get("e:1")
    assert state is not None and cache.generation("e:1") is None
    weight = ENTITY_BYTES + 3 * ROW_BYTES
    state["until"] = 5
    cache.changed("e:1")
    first = cache.generation("e:1")
    assert first is not None and cache.dirty == 1
    assert cache.weight == cache.dirty_weight == weight
    cache.changed("e:1")  # changed again: a newer generation, counted once
    again = cache.generation("e:1")
    assert again is not None and again > first and cache.dirty_weight == weight
    cache.stored([("e:1", first)])  # an older checkpoint: still dirty
    assert cache.dirty_weight == weight
    cache.stored([("e:1", again)])
    assert cache.dirty_weight == 0 and cache.weight == weight
    cache.changed("e:2")  # not in memory: nothing read, nothing counted
    assert "e:2" not in cache and loader.loads == ["e:1"] and cache.weight == weight


def test_dirty_states_over_the_whole_budget_make_the_cache_over() -> None:
    cache = StateCache(DictLoader(), budget_bytes=4 * ENTITY_BYTES)
    for i in range(4):
        cache[f"e:{i}"] = entity()
    assert cache.full and not cache.over  # a checkpoint is due; messages still taken
    cache["e:4"] = entity()
    assert cache.over
    cache.stored([(f"e:{i}", cache.generation(f"e:{i}")) for i in range(5)])
    assert not cache.over and cache.dirty_weight == 0 and cache.weight <= 4 * ENTITY_BYTES
    assert not StateCache(None, budget_bytes=0).over  # without a store: never


def test_a_state_read_back_keeps_no_index_after_its_first_vector_but_after_its_second() -> None:
    """A state the cache has just read from the store is mostly evicted before its
    next change (a region larger than the budget): the index built for its first
    vector is dropped, not moved back to the read time. Changed again while still in
    memory, it keeps the index it builds. The vectors are those of a state that was
    never read back."""
    user = FeatureEngine(SETTINGS.entities).engine("user")
    state: EntityState | None = None
    for i in range(30):  # rows across the windows, some of them ahead of the read time
        state, _ = user.apply(state, view(i, 7, 10 + i, at_ms=T0 - 90_000_000 + i * 3_600_000))
    assert state is not None

    def copy() -> EntityState:  # rows and all: the two states change apart
        return EntityState(orjson.loads(orjson.dumps(state)))

    loader = DictLoader()
    loader.stored["user:7"] = copy()
    cache = StateCache(loader, budget_bytes=10**9)
    read_back = cache.get("user:7")
    assert read_back is not None and read_back.loaded and read_back.index is None
    now_ms = T0 - 50_000_000
    first = user.write_op(7, read_back, now_ms)
    assert read_back.index is None and not read_back.loaded  # dropped once read
    kept = copy()  # never read back: its index is built and kept
    assert first == user.write_op(7, kept, now_ms) and kept.index is not None
    read_back, _ = user.apply(read_back, view(100, 7, 200, at_ms=now_ms))
    kept, _ = user.apply(kept, view(100, 7, 200, at_ms=now_ms))
    later = now_ms + 1_000
    second = user.write_op(7, read_back, later)
    assert read_back.index is not None  # changed in memory: the index stays
    assert second == user.write_op(7, kept, later)
    assert first.schedule is not None and first.schedule.patches  # windows that move


def test_without_a_store_nothing_is_evicted() -> None:
    cache = StateCache(None, budget_bytes=0)
    cache["e:1"] = entity()
    cache.stored([("e:1", cache.generation("e:1"))])
    assert "e:1" in cache and cache.get("e:2") is None


# -- the runtime on a local store --------------------------------------------------------


class StoreChangelog:
    """ChangelogSink as pipeline.faustlocal.LocalChangelog, with a broker that
    acknowledges at once: records reach the store at close, with offsets."""

    def __init__(self, local: LocalStates, journal: Journal) -> None:
        self.local, self.journal = local, journal
        self.pending: dict[int, list[tuple[bytes, bytes | None]]] = defaultdict(list)
        self.offsets: dict[int, int] = defaultdict(int)
        self.records = 0

    def send(self, partition: int, key: str, value: bytes | None) -> None:
        self.pending[partition].append((key.encode(), value))
        self.records += 1

    def store(self, key: str, state: EntityState, delivery: Delivery) -> None:
        store_state(ChangelogWriter(self, delivery.partition), key, state)
        self.journal.events.append(("store", key))

    async def relieve(self) -> None:
        await asyncio.sleep(0)

    async def close(self, partitions: Mapping[int, Delivery]) -> None:
        for partition in partitions:
            self.send(partition, checkpoint_key(partition), orjson.dumps({"at_ms": 1}))
        pending, self.pending = self.pending, defaultdict(list)
        for partition, records in pending.items():
            self.offsets[partition] += len(records)
            self.local.records_applied(partition, records, self.offsets[partition] - 1)
        self.journal.events.append(("close", sorted(partitions)))


def store_runtime(
    local: LocalStates,
    memory_bytes: int | None = None,
    clock: Clock | None = None,
    policy: BatchPolicy | None = None,
) -> tuple[RegionRuntime, Journal, FakeCache, StoreChangelog, Clock]:
    journal, clock = Journal(), clock or Clock()
    cache, changelog = FakeCache(journal), StoreChangelog(local, journal)
    runtime = RegionRuntime(
        region="eu-west",
        app_id="test-region-eu-west",
        engine=FeatureEngine(SETTINGS.entities),
        partition_of=lambda key: 0,
        cache=cache,
        changelog=changelog,
        dead_letters=FakeDeadLetters(),
        acker=FakeAcker(journal),
        metrics=PipelineMetrics.create(CollectorRegistry()),
        policy=policy or BatchPolicy(max_changes=1000, within_s=0.02, catch_up=2.0),
        checkpoint_interval_s=1.0,
        clock=clock,
        wall=lambda: (T0 + 1000) / 1000 + clock() - 1000.0,
        store=local,
        memory_bytes=memory_bytes,
    )
    runtime.retry_first_s = runtime.retry_max_s = 0.001
    runtime.resumed([0])
    return runtime, journal, cache, changelog, clock


def engine_for(tmp_path: Path) -> LocalStates:
    engine = FeatureEngine(SETTINGS.entities)
    return LocalStates(tmp_path, lambda k, r: renewal_due(engine, k, r), VERSIONS, cache_mb=8)


async def settle(runtime: RegionRuntime, clock: Clock) -> None:
    clock.now += 0.05
    await runtime.tick()  # the batch written
    clock.now += 1.5
    await runtime.tick()  # the checkpoint
    if runtime._checkpoint_task is not None:
        await asyncio.wait_for(runtime._checkpoint_task, 5)


async def test_states_read_back_from_disk_give_the_same_vectors(tmp_path: Path) -> None:
    """A worker whose memory holds almost nothing computes every vector as one that
    holds everything: evicted states are read again from the store."""
    local = engine_for(tmp_path)
    small, _j, cache_small, _c, clock = store_runtime(local, memory_bytes=2 * ENTITY_BYTES)
    views = [view(i, 1 + i % 20, 10 + i, at_ms=T0 - i * 1000) for i in range(200)]
    for start in range(0, 200, 50):
        await small.on_message(Delivery(0, start), pack(*views[start : start + 50]))
        await settle(small, clock)
    more = [view(300 + i, 1 + i % 20, 500 + i) for i in range(40)]
    await small.on_message(Delivery(0, 300), pack(*more))
    await settle(small, clock)
    assert len(small.live) < 20 and small.live.loads > 0  # bounded, and read back

    memory_local = LocalStates(tmp_path / "other", until_of, VERSIONS)
    whole, _j2, cache_whole, _c2, clock2 = store_runtime(memory_local)
    for start in range(0, 200, 50):
        await whole.on_message(Delivery(0, start), pack(*views[start : start + 50]))
        await settle(whole, clock2)
    await whole.on_message(Delivery(0, 300), pack(*more))
    await settle(whole, clock2)
    assert cache_small.vectors == cache_whole.vectors
    local.close()
    memory_local.close()


async def test_dirty_states_over_the_budget_are_checkpointed_before_the_interval(
    tmp_path: Path,
) -> None:
    """A worker's memory stays near its budget between checkpoints: once changed
    states take their share of it, a checkpoint stores them (evictable then)."""
    local = engine_for(tmp_path)
    budget = 40 * (ENTITY_BYTES + ROW_BYTES)
    # No catch-up: a batch closes 20 ms after it opened on the test's clock, however
    # long the last flush took in real time (on a busy machine, 2x a slow flush kept
    # the batch open across packs, and nothing was in the ledger to checkpoint).
    policy = BatchPolicy(max_changes=1000, within_s=0.02, catch_up=0.0)
    runtime, journal, _cache, _c, clock = store_runtime(local, memory_bytes=budget, policy=policy)
    for start in range(0, 200, 20):  # 200 users, well within one interval
        views = [view(start + i, start + i, 10 + start + i) for i in range(20)]
        await runtime.on_message(Delivery(0, start), pack(*views))
        clock.now += 0.05
        await runtime.tick()
        # A checkpoint already running when the pack came (its store writes run in a
        # thread: slow on a busy machine) did not take the pack's states: the next
        # tick starts another. Bounded: each round stores what was dirty.
        for _ in range(4):
            task = runtime._checkpoint_task
            if task is None or task.done():
                break
            await asyncio.wait_for(task, 5)
            await runtime.tick()
        assert runtime.live.dirty_weight <= budget
    assert clock.now - 1000.0 < runtime.ledger.interval_s  # no interval has passed
    assert ("close", [0]) in journal.events and acked(journal)  # checkpointed, acked
    assert runtime.live.weight <= 2 * budget
    local.close()


class SlowBrokerChangelog(StoreChangelog):
    """A broker that acknowledges a checkpoint's records only once the test opens
    ``gate``: the checkpoint runs beside the stream, as on a busy broker."""

    def __init__(self, local: LocalStates, journal: Journal) -> None:
        super().__init__(local, journal)
        self.gate = asyncio.Event()
        self.gate.set()

    async def close(self, partitions: Mapping[int, Delivery]) -> None:
        await self.gate.wait()
        await super().close(partitions)


async def drive(
    runtime: RegionRuntime, changelog: SlowBrokerChangelog, clock: Clock, bodies: list[bytes]
) -> tuple[int, int, int]:
    """Apply ``bodies`` as messages 0..n-1, a batch closing after each, with the
    broker holding every checkpoint's acknowledgement until a message is held up
    waiting for it; (messages held, the highest estimate above the budget, the
    checkpoints before the first interval ended)."""
    budget = runtime.live.budget_bytes or 0
    held, above, early = 0, 0, 0
    interval_ends = clock.now + runtime.ledger.interval_s
    for offset, body in enumerate(bodies):
        changelog.gate.clear()
        task = asyncio.ensure_future(runtime.on_message(Delivery(0, offset), body))
        for _ in range(100):  # all that can run without the broker's acks
            await asyncio.sleep(0)
        above = max(above, runtime.live.weight - budget)
        if not task.done():  # backpressure: waits for a checkpoint to store them
            held += 1
            assert runtime.live.over
            changelog.gate.set()
        await asyncio.wait_for(task, 5)
        above = max(above, runtime.live.weight - budget)
        clock.now += 0.021  # the batch closes; an early checkpoint starts if due
        if clock.now < interval_ends:
            early = sum(1 for kind, _ in changelog.journal.events if kind == "close")
        await runtime.tick()
        above = max(above, runtime.live.weight - budget)
    changelog.gate.set()
    await settle(runtime, clock)
    return held, above, early


async def test_a_stream_faster_than_checkpoints_is_held_within_the_budget(
    tmp_path: Path,
) -> None:
    """Changes that dirty ten times the memory budget before a checkpoint's interval,
    with a broker slow to acknowledge: checkpoints start early, the stream is held
    once changed states fill the budget (never more than one message's changes
    above it) and released once a checkpoint stored them; nothing is lost: every
    vector equals that of a worker that keeps every state in memory."""
    local = engine_for(tmp_path / "small")
    budget = 40 * (ENTITY_BYTES + ROW_BYTES)
    # Each message: 10 users (a row each; their second row in the second round).
    pack_weight = 10 * (ENTITY_BYTES + 2 * ROW_BYTES)
    policy = BatchPolicy(max_changes=1000, within_s=0.02, catch_up=0.0)
    runtime, journal, cache, _c, clock = store_runtime(local, memory_bytes=budget, policy=policy)
    slow = SlowBrokerChangelog(local, journal)
    runtime.changelog = slow
    bodies = [
        pack(*(view(n * 400 + u, u, 10 + n * 400 + u) for u in range(start, start + 10)))
        for n in range(2)
        for start in range(0, 400, 10)
    ]
    held, above, early = await drive(runtime, slow, clock, bodies)
    assert held > 0  # the broker's slowness held the stream
    assert above <= pack_weight  # never more than one message's changes above
    assert early >= 2  # checkpoints before the first interval ended
    assert sorted(set(acked(journal))) == list(range(len(bodies)))  # every message acked
    assert runtime.live.dirty == 0 and runtime.live.loads > 0  # stored; read back

    whole_local = engine_for(tmp_path / "whole")
    whole, j2, cache_whole, _c2, clock2 = store_runtime(whole_local, policy=policy)
    whole_slow = SlowBrokerChangelog(whole_local, j2)
    whole.changelog = whole_slow
    held_whole, _, _ = await drive(whole, whole_slow, clock2, bodies)
    assert held_whole == 0 and len(cache.vectors) == 400
    assert cache.vectors == cache_whole.vectors
    local.close()
    whole_local.close()


class FailingChangelog(StoreChangelog):
    async def close(self, partitions: Mapping[int, Delivery]) -> None:
        raise RuntimeError("the broker refused the checkpoint")


async def test_a_held_stream_whose_checkpoint_fails_is_not_held_forever(tmp_path: Path) -> None:
    """A checkpoint that fails for good (the worker stops: on_fatal) ends the wait of a
    held message rather than leaving the worker hung; nothing is acked."""
    local = engine_for(tmp_path)
    policy = BatchPolicy(max_changes=1000, within_s=0.02, catch_up=0.0)
    runtime, journal, _cache, _c, _clock = store_runtime(
        local, memory_bytes=2 * (ENTITY_BYTES + ROW_BYTES), policy=policy
    )
    runtime.changelog = FailingChangelog(local, journal)
    fatal: list[BaseException] = []

    async def on_fatal(exc: BaseException) -> None:
        fatal.append(exc)

    runtime.on_fatal = on_fatal
    await runtime.on_message(Delivery(0, 0), pack(*(view(u, u, 10 + u) for u in range(5))))
    assert runtime.live.over
    await asyncio.wait_for(runtime.on_message(Delivery(0, 1), pack(view(9, 9, 20))), 5)
    assert [str(e) for e in fatal][:1] == ["the broker refused the checkpoint"]
    assert acked(journal) == [] and runtime.live.dirty == 6  # nothing dropped
    local.close()


async def test_a_restarted_worker_reads_nothing_and_renews_from_the_index(tmp_path: Path) -> None:
    """Resumed on its folder: no state is read until needed, nothing is rewritten
    at once, and a vector whose schedule runs out is renewed from the index."""
    local = engine_for(tmp_path)
    runtime, _j, _cache, _c, clock = store_runtime(local)
    views = [view(i, 7, 10 + i, at_ms=T0 - i * 60_000) for i in range(8)]
    await runtime.on_message(Delivery(0, 1), pack(*views, view(9, 8, 30)))
    await settle(runtime, clock)
    until = runtime.live["user:7"]["until"]
    assert isinstance(until, int)
    await settle(runtime, clock)  # the bookkeeping's own checkpoint
    local.close()

    again = engine_for(tmp_path)
    restarted, _j2, cache2, _c2, clock2 = store_runtime(again, clock=Clock())
    clock2.now = clock.now
    await restarted.tick()
    assert cache2.writes == [] and len(restarted.live) == 0
    clock2.now += (until - restarted._now_us()) / 1e6 + 0.001  # its schedule ran out
    await restarted.tick()
    assert ["user:7"] in [keys for keys, _ in cache2.writes]
    again.close()


async def test_a_state_ahead_of_the_cache_is_written_after_a_restart(tmp_path: Path) -> None:
    local = engine_for(tmp_path)
    runtime, _j, _cache, changelog, clock = store_runtime(local)
    await runtime.on_message(Delivery(0, 1), pack(view(1, 7, 10)))
    clock.now += 0.05
    await runtime.tick()  # user 7 written
    await runtime.on_message(Delivery(0, 2), pack(view(2, 7, 11)))  # applied, not written
    changelog.store("user:7", runtime.live["user:7"], Delivery(0, 2))  # as a checkpoint may
    await changelog.close({0: Delivery(0, 2)})
    local.close()
    again = engine_for(tmp_path)
    restarted, _j2, cache2, _c2, clock2 = store_runtime(again)
    clock2.now = clock.now
    await restarted.tick()
    assert cache2.vectors["user:7"]["views_30m"] == 2
    again.close()


async def test_a_full_disk_stops_consumption_and_acks_nothing_until_it_clears(
    tmp_path: Path,
) -> None:
    local = engine_for(tmp_path)
    runtime, journal, _cache, _c, clock = store_runtime(local)
    failing = {"on": True}
    real = local.records_applied

    def refuse(*args: Any) -> None:
        if failing["on"]:
            raise StateStoreError("cannot write the local state store: No space left on device")
        real(*args)

    local.records_applied = refuse  # type: ignore[method-assign]
    await runtime.on_message(Delivery(0, 1), pack(view(1, 7, 10)))
    await settle(runtime, clock)
    assert runtime.store_error is not None and acked(journal) == []
    blocked = asyncio.ensure_future(runtime.on_message(Delivery(0, 2), pack(view(2, 7, 11))))
    await asyncio.sleep(0.05)
    assert not blocked.done()  # consumes nothing while the disk refuses
    failing["on"] = False
    await asyncio.wait_for(blocked, 5)
    assert runtime.store_error is None and acked(journal) == [1]
    await settle(runtime, clock)
    assert acked(journal) == [1, 2]
    local.close()


@pytest.fixture
def small_disk(tmp_path: Path) -> Any:
    """A 4 MB filesystem of its own (tmpfs), to fill for real."""
    import os
    import subprocess

    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:  # never skipped: a full disk must be tested for real
        pytest.fail(
            f"cannot mount a 4 MB tmpfs (uid {os.geteuid()}): {done.stderr.strip()}; "
            "run the unit tests as root, as CI does"
        )
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


async def test_a_really_full_disk_stops_the_worker_and_loses_nothing(small_disk: Path) -> None:
    """RocksDB on a full filesystem: the checkpoint fails with a clear error, the
    worker consumes nothing more, and once space is freed it goes on, every change
    applied once (its vectors equal a worker's that never met a full disk)."""
    import os

    local = engine_for(small_disk / "state")
    runtime, journal, cache, _c, clock = store_runtime(local)
    filler = small_disk / "filler"
    free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
    filler.write_bytes(b"\0" * max(0, free - 64 * 1024))  # leaves 64 KB
    views = [view(i, 1 + i % 50, 10 + i, at_ms=T0 - i * 1000) for i in range(2_000)]
    offset = 0
    blocked = None
    for start in range(0, len(views), 100):
        offset += 1
        task = asyncio.ensure_future(
            runtime.on_message(Delivery(0, offset), pack(*views[start : start + 100]))
        )
        await asyncio.wait([task], timeout=0.5)
        if not task.done():
            blocked = task
            break
        await settle(runtime, clock)
    assert blocked is not None, "the disk never filled"
    assert runtime.store_error is not None
    assert "No space left on device" in str(runtime.store_error)
    assert "pipeline.state_dir" in str(runtime.store_error)
    waiting = acked(journal)
    await asyncio.sleep(0.3)
    assert not blocked.done() and acked(journal) == waiting  # stopped, nothing acked
    filler.unlink()
    await asyncio.wait_for(blocked, 10)
    for start in range(offset * 100, len(views), 100):
        offset += 1
        await runtime.on_message(Delivery(0, offset), pack(*views[start : start + 100]))
    await settle(runtime, clock)
    await settle(runtime, clock)
    assert runtime.store_error is None
    assert acked(journal) == list(range(1, offset + 1))

    reference_local = LocalStates(small_disk.parent / "reference", until_of, VERSIONS)
    reference, _j2, reference_cache, _c2, clock2 = store_runtime(reference_local)
    for number, start in enumerate(range(0, len(views), 100), 1):
        await reference.on_message(Delivery(0, number), pack(*views[start : start + 100]))
        await settle(reference, clock2)
    # The same states: the same vectors read at one time (each worker wrote its
    # own as of its own clock).
    assert set(cache.vectors) == set(reference_cache.vectors)
    for key in cache.vectors:
        engine = runtime.engine.engine(key.split(":", 1)[0])
        state, expected = runtime.live.get(key), reference.live.get(key)
        assert state is not None and expected is not None
        assert engine.vector(state, T0) == engine.vector(expected, T0), key
    local.close()
    reference_local.close()


# -- Faust's recovery into the store -------------------------------------------------------


class _Message:
    def __init__(self, partition: int, offset: int, key: bytes, value: bytes | None, epoch: int):
        self.partition, self.offset, self.key, self.value = partition, offset, key, value
        self.headers = [("edgefeed-epoch", str(epoch).encode())]


class _Event:
    def __init__(self, message: _Message, key: Any) -> None:
        self.message, self.key, self.headers = message, key, message.headers


def test_a_recovery_stores_the_keys_a_checkpoint_writes(tmp_path: Path) -> None:
    """The changelog's keys are JSON on the wire (the table's key serializer): the
    store keeps them as the worker reads them, and fences a late older owner."""
    from pipeline.faustlocal import LocalTableStore

    local = engine_for(tmp_path)
    store = LocalTableStore.__new__(LocalTableStore)  # Faust's Service plumbing aside
    store.local, store.read = local, defaultdict(int)
    record = rec({"lsn": 5, "rev": 1, "ts": 0, "gone": None})
    older = rec({"lsn": 1, "rev": 1, "ts": 0, "gone": None})
    events = [
        _Event(_Message(0, 0, b'"\\u001ffence\\u001f0"', rec({"epoch": 2}), 2), "\x1ffence\x1f0"),
        _Event(_Message(0, 1, b'"user:7"', record, 2), "user:7"),
        _Event(_Message(0, 2, b'"user:7"', older, 1), "user:7"),  # a late owner of epoch 1
    ]
    store.apply_changelog_batch(events, None, None)
    loaded = local.load("user:7", 0)
    assert loaded is not None and loaded["lsn"] == 5
    assert local.partition(0).offset() == 2 and local.partition(0).top == 2
    assert store.read[0] == 2
    local.close()


async def test_a_changelog_that_is_no_longer_the_one_a_folder_reflects_discards_it(
    tmp_path: Path,
) -> None:
    """A broker that lost its topics: the saved offset would skip the new changelog's
    records (or lie beyond its end, which Faust refuses): the partition's database is
    discarded and read whole from the changelog instead."""
    from pipeline.localstore import record_mark

    local = engine_for(tmp_path)
    kept, gone, other = (b'"user:1"', rec({"rev": 1})), (b'"user:2"', rec({})), (b'"x"', b"{}")
    for partition, (key, value) in enumerate([kept, gone, other]):
        local.records_applied(partition, [(key[1:-1], value)], 10, record_mark(key, value))
    changelog = {0: kept, 2: (b'"user:9"', rec({"rev": 7}))}  # partition 1: ends before 10

    async def fetch(partition: int, offset: int) -> tuple[bytes | None, bytes | None] | None:
        assert offset == 10
        return changelog.get(partition)

    assert await local.check_lineage(fetch) == [1, 2]
    assert local.partition(0).offset() == 10 and local.partition(0).load("user:1") is not None
    assert local.partition(1).offset() is None and local.partition(1).load("user:2") is None
    assert local.partition(2).offset() is None
    local.close()


def test_the_mark_of_a_checkpoint_record_is_the_mark_of_the_record_on_the_wire() -> None:
    """A checkpoint marks its last record as the broker holds it: the table's key
    serializer (JSON) applied, so that the lineage check finds it equal."""
    from pipeline.faustlocal import LocalChangelog
    from pipeline.localstore import record_mark

    class Table:
        key_serializer = "json"

    sink = LocalChangelog.__new__(LocalChangelog)
    sink.table = Table()
    key = "user:7\x1fpublic.events\x1f3"
    wire = sink._wire_key(key.encode())
    assert orjson.loads(wire) == key
    assert record_mark(wire, b"{}") != record_mark(key.encode(), b"{}")


class _Producer:
    async def flush(self) -> None:
        return None


class _App:
    producer = _Producer()


class _Metadata:
    def __init__(self, offset: int) -> None:
        self.offset = offset


def _acked(offset: int) -> asyncio.Future[_Metadata]:
    future: asyncio.Future[_Metadata] = asyncio.get_running_loop().create_future()
    future.set_result(_Metadata(offset))
    return future


def _sink(local: LocalStates, log: list[tuple[int, bytes, bytes | None, int | None]]) -> Any:
    from pipeline.faustlocal import LocalChangelog

    class Table:
        key_serializer = "json"

    sink = LocalChangelog(_App(), Table(), local)  # type: ignore[arg-type]

    async def read_range(partition: int, first: int, last: int) -> Any:
        return [r for r in log if first <= r[0] <= last]

    sink.read_range = read_range  # type: ignore[method-assign]
    return sink


async def test_a_late_checkpoint_of_a_fenced_owner_does_not_enter_its_store(
    tmp_path: Path,
) -> None:
    """Paused past its session, a worker's late checkpoint lands after a newer
    owner's records: its database must not skip those (its saved offset would
    pass them) nor take its own late records over them (the fence)."""
    local = engine_for(tmp_path)
    store = local.partition(0)
    store.admit(3)
    local.records_applied(0, [(b"user:7", rec({"lsn": 1, "rev": 1}))], 10)
    newer = rec({"lsn": 9, "rev": 5})
    late = rec({"lsn": 2, "rev": 2})
    changelog = [
        (11, b"\x1ffence\x1f0", rec({"epoch": 4}), 4),  # the new owner's
        (12, b"user:7", newer, 4),
        (13, b"user:8", rec({"lsn": 3, "rev": 1}), 4),
        (14, b"user:7", late, 3),  # this worker's late checkpoint
    ]
    sink = _sink(local, changelog)
    sink.epochs[0] = 3
    sink._sent = [(0, b"user:7", late, _acked(14))]
    await sink._deliver()
    assert store.offset() == 14 and store.top == 4
    loaded = store.load("user:7")
    assert loaded is not None and loaded["lsn"] == 9  # the newer owner's state
    assert store.load("user:8") is not None
    local.close()


async def test_records_right_after_the_saved_offset_are_applied_without_reading_back(
    tmp_path: Path,
) -> None:
    local = engine_for(tmp_path)
    local.records_applied(0, [(b"user:7", rec({"lsn": 1}))], 10)
    sink = _sink(local, [])

    async def never(*args: Any) -> Any:
        raise AssertionError("read back although nobody else wrote")

    sink.read_range = never
    sink._sent = [
        (0, b"user:7", rec({"lsn": 2}), _acked(11)),
        (0, b"user:8", rec({"lsn": 3}), _acked(12)),
    ]
    await sink._deliver()
    assert local.partition(0).offset() == 12
    loaded = local.partition(0).load("user:7")
    assert loaded is not None and loaded["lsn"] == 2
    local.close()
