"""benchmarks/scale.py's two modes of the worker over a load applied change by
change: every state in memory, or on local disk behind a bounded cache."""

from __future__ import annotations

import cProfile
import gc
import os
import random
import shutil
import struct
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from pipeline.features import FeatureEngine
from pipeline.localstore import LocalStates
from pipeline.messages import RegionalChange, encode_packs
from pipeline.runtime import Delivery
from pipeline.runtime.region import renewal_due
from pipeline.statestore import rebuild_states
from scalebench.load import (
    PARTITIONS,
    event_row,
    partition_of,
)
from scalebench.worker import (
    DIGEST_USERS,
    FRESH_LSN,
    FRESH_USER,
    Changelog,
    Clock,
    DiskChangelog,
    Run,
    _figures,
    apply_frames,
    apply_load,
    folder_bytes,
    make_runtime,
    read_frames,
    rss_mb,
    settings,
    states_digest,
    store_digest,
    store_record_bytes,
    stored_states,
    vectors_digest,
)

# -- memory mode ------------------------------------------------------------------------------

MODES = ("memory", "disk")  # a worker's states: all in memory, or on disk behind a cache


async def load_memory(run: Run) -> dict[str, Any]:
    """Apply the load, then recover from the changelog; the figures."""
    users, events, seed, now_s, checkpoint_s = (
        run.users,
        run.events,
        run.seed,
        run.now_s,
        run.checkpoint_s,
    )
    clock = Clock()
    changelog = Changelog()
    runtime, cache = make_runtime(
        clock, now_s, changelog, FeatureEngine(settings().entities), checkpoint_s
    )
    gc.collect()
    base = rss_mb()  # the interpreter, the libraries, an empty worker
    applied_s, _peak = await apply_load(runtime, clock, users, events, seed, now_s)
    at_ms = int(now_s * 1000)
    digest = vectors_digest(runtime, at_ms)
    dead = runtime.dead_letters.sent  # type: ignore[attr-defined]
    gc.collect()
    rss = rss_mb()
    rows = sum(len(r) for s in runtime.live.values() for r in s["rows"].values())
    entities = len(runtime.live)
    # The changelog as the broker holds it: one serialized record per key. To disk,
    # so that the recovery below starts from bytes, in a process holding no state.
    serialized = 0
    with tempfile.NamedTemporaryFile(prefix="scale-", suffix=".log", delete=False) as out:
        path = out.name
        for key, value in changelog.table.items():
            raw_key, raw = key.encode(), orjson.dumps(value)
            serialized += len(raw_key) + len(raw)
            out.write(struct.pack("<II", len(raw_key), len(raw)) + raw_key + raw)
    checkpoint_s, records = changelog.seconds, changelog.records
    del runtime, cache, changelog
    gc.collect()
    try:
        recovery = await recover_memory(path, now_s, at_ms, digest)
    finally:
        os.unlink(path)
    return {
        "mode": "memory",
        **_figures(users, events, dead, entities, rows, digest, applied_s, rss, base),
        "bytes_per_row": round((rss - base) * 1024 * 1024 / max(rows, 1)),
        "checkpoint_s": round(checkpoint_s, 2),
        "changelog_records": records,
        "serialized_mb": round(serialized / 1e6, 1),
        **recovery,
    }


def read_log(path: str) -> Iterator[tuple[str, Any]]:
    """The changelog's records from the file ``load_memory`` wrote, decoded."""
    with open(path, "rb") as log:
        while header := log.read(8):
            key_len, value_len = struct.unpack("<II", header)
            key = log.read(key_len).decode()
            yield key, orjson.loads(log.read(value_len))


async def recover_memory(path: str, now_s: float, at_ms: int, digest: int) -> dict[str, Any]:
    """A restarted worker's recovery from the changelog's bytes: decode, rebuild the
    working states, then write what is due at once (renewals)."""
    started = time.perf_counter()
    states = rebuild_states(read_log(path), lambda key: True)
    decoded_s = time.perf_counter() - started
    clock = Clock()
    runtime, cache = make_runtime(
        clock, now_s, Changelog(), FeatureEngine(settings().entities), 1.0
    )
    runtime.recovered(states)
    del states
    started = time.perf_counter()
    while await runtime.renew():
        pass
    rewrite_s = time.perf_counter() - started
    gc.collect()
    return {
        "recovery_s": round(decoded_s, 2),
        "rewrite_s": round(rewrite_s, 2),
        "rewritten": cache.ops,
        "recovered_entities": len(runtime.live),
        "recovered_equal": vectors_digest(runtime, at_ms) == digest,
    }


# -- disk mode --------------------------------------------------------------------------------


def open_states(root: Path, engine: FeatureEngine) -> LocalStates:
    versions = {e.name: e.version for e in settings().entities}
    return LocalStates(root, lambda key, record: renewal_due(engine, key, record), versions)


async def load_disk(run: Run) -> dict[str, Any]:
    """Apply the load with the states on disk, restart on the folder, rebuild a lost
    one from the changelog; the figures."""
    folder = Path(tempfile.mkdtemp(prefix="scale-disk-"))
    try:
        return await _load_disk(folder, run)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


async def _load_disk(folder: Path, run: Run) -> dict[str, Any]:
    users, events, seed, now_s = run.users, run.events, run.seed, run.now_s
    checkpoint_s, memory_mb, profile = run.checkpoint_s, run.memory_mb, run.profile
    clock = Clock()
    engine = FeatureEngine(settings().entities)
    budget = int(memory_mb * 2**20)
    local = open_states(folder / "state", engine)
    changelog = DiskChangelog(local, folder / "changelog.log")
    runtime, cache = make_runtime(
        clock, now_s, changelog, engine, checkpoint_s, store=local, memory_bytes=budget
    )
    runtime.resumed(list(range(PARTITIONS)))  # a first start: an empty folder
    gc.collect()
    base = rss_mb()  # the interpreter, the libraries, an empty worker (no database open)
    profiler = cProfile.Profile() if profile else None
    if profiler is not None:  # --profile: the apply path alone
        profiler.enable()
    applied_s, peak_cache_mb = await apply_load(runtime, clock, users, events, seed, now_s)
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(str(profile))
    changelog.finish()
    dead = runtime.dead_letters.sent  # type: ignore[attr-defined]
    gc.collect()
    rss = rss_mb()
    live = runtime.live
    loads, evictions, hot, dirty = live.loads, live.evictions, len(live), live.dirty
    cache_mb = live.weight / 1e6
    open_bytes = folder_bytes(folder / "state")  # while open: its write-ahead logs too
    at_ms = int(now_s * 1000)
    fresh = f"user:{FRESH_USER}"
    digest, digest_without, entities, rows = store_digest(
        engine, stored_states(local, live.get), at_ms, frozenset({fresh})
    )
    serialized = store_record_bytes(local)
    # What the store holds (the bulk build's is compared with it: the same states).
    states = states_digest(engine, stored_states(local)) if users <= DIGEST_USERS else None
    checkpoint_secs, records, log_bytes = changelog.seconds, changelog.records, changelog.bytes
    local.close()  # the folder's lock: the restarted worker takes the same folder
    store_bytes = folder_bytes(folder / "state")
    del runtime, cache, changelog, live
    gc.collect()
    recovery = await recover_disk(folder, now_s, at_ms, budget, digest_without)
    rebuild = rebuild_disk(folder, engine, at_ms, digest)
    return {
        "mode": "disk",
        "memory_mb": memory_mb,
        "budget_bytes": budget,
        **_figures(users, events, dead, entities, rows, digest, applied_s, rss, base),
        "cache_mb": round(cache_mb, 1),
        "peak_cache_mb": round(peak_cache_mb, 1),
        "hot_entities": hot,
        "dirty_after": dirty,
        "loads": loads,
        "evictions": evictions,
        "checkpoint_s": round(checkpoint_secs, 2),
        "changelog_records": records,
        "serialized_mb": round(serialized / 1e6, 1),
        "log_mb": round(log_bytes / 1e6, 1),
        "store_open_mb": round(open_bytes / 1e6, 1),
        "store_mb": round(store_bytes / 1e6, 1),
        "store_ratio": round(store_bytes / max(serialized, 1), 2),
        "state_digest": states,
        **recovery,
        **rebuild,
    }


async def recover_disk(
    folder: Path, now_s: float, at_ms: int, budget: int, digest_without: int
) -> dict[str, Any]:
    """A restarted worker on the same folder: from opening it to a new change of an
    existing user applied and its vector in the cache (fresh writes served), then
    the renewals due at once; then every entity's vector, read through the store."""
    clock = Clock()
    engine = FeatureEngine(settings().entities)  # the worker's, built before it starts
    fresh = f"user:{FRESH_USER}"
    at = int(now_s * 1000)
    change = RegionalChange(
        "public.events",
        "c",
        FRESH_LSN,
        0,
        at,
        "user",
        FRESH_USER,
        "fresh",
        event_row(10**9, FRESH_USER, 1, at, random.Random(0)),
    )
    (body,) = encode_packs([change.encode()])
    gc.collect()
    started = time.perf_counter()
    local = open_states(folder / "state", engine)
    changelog = DiskChangelog(local, folder / "after.log")
    runtime, cache = make_runtime(
        clock, now_s, changelog, engine, 1.0, store=local, memory_bytes=budget
    )
    runtime.resumed(list(range(PARTITIONS)))
    cache.keys = []
    await runtime.on_message(Delivery(partition_of(fresh), 10**9), body)
    await runtime.flush()
    recovery_s = time.perf_counter() - started
    served = fresh in cache.keys
    written = cache.ops
    started = time.perf_counter()
    await runtime.tick()  # the renewal index read: what is due at once
    while await runtime.renew():
        pass
    renew_s = time.perf_counter() - started
    rewritten = cache.ops - written
    state = runtime.live.get(fresh)
    applied = state is not None and int(state["lsn"]) == FRESH_LSN
    _total, without, entities, _rows = store_digest(
        engine, stored_states(local, runtime.live.get), at_ms, frozenset({fresh})
    )
    recovered_cache_bytes = runtime.live.weight
    changelog.finish()
    local.close()
    return {
        "recovery_s": round(recovery_s, 3),
        "renew_s": round(renew_s, 3),
        "rewritten": rewritten,
        "fresh_served": served and applied,
        "recovered_entities": entities,
        "recovered_equal": without == digest_without,
        "recovered_cache_bytes": recovered_cache_bytes,
        "recovered_hot": len(runtime.live),
    }


def rebuild_lost(folder: Path, engine: FeatureEngine) -> tuple[LocalStates, dict[str, Any]]:
    """A lost disk: an empty folder rebuilt from the changelog file (as a worker reads
    a partition its folder lacks: whole), by batches of REBUILD_BATCH records; the
    rebuilt store (open) and the rebuild's figures."""
    gc.collect()
    started = time.perf_counter()
    local = open_states(folder / "rebuilt", engine)
    offsets = dict.fromkeys(range(PARTITIONS), -1)
    records, _ = apply_frames(local, read_frames(folder / "changelog.log"), offsets)
    rebuild_s = time.perf_counter() - started
    return local, {
        "rebuild_s": round(rebuild_s, 2),
        "rebuild_records": records,
        "rebuild_records_per_s": round(records / rebuild_s),
    }


def rebuild_disk(folder: Path, engine: FeatureEngine, at_ms: int, digest: int) -> dict[str, Any]:
    """A lost disk rebuilt (``rebuild_lost``); exact if every vector is the one before."""
    local, found = rebuild_lost(folder, engine)
    total, _without, _entities, _rows = store_digest(engine, stored_states(local), at_ms)
    local.close()
    return {**found, "rebuilt_equal": total == digest}
