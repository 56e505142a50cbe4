"""benchmarks/scale.py's large sizes: a state built in bulk with the worker's own
code, then a worker measured over it (access patterns, kill -9, a lost disk)."""

from __future__ import annotations

import asyncio
import ctypes
import gc
import hashlib
import multiprocessing
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import orjson

from edge_cache import Upsert
from pipeline.features import EntityState, FeatureEngine
from pipeline.localstore import LocalStates
from pipeline.messages import RegionalChange
from pipeline.runtime import Delivery
from scalebench.load import (
    PARTITIONS,
    Load,
    event_row,
    numbered,
    pack_changes,
    partition_of,
)
from scalebench.modes import (
    open_states,
    rebuild_lost,
)
from scalebench.worker import (
    DIGEST_USERS,
    Clock,
    DiskChangelog,
    FileAcker,
    Run,
    apply_messages,
    entity_hash,
    folder_bytes,
    make_runtime,
    read_acks,
    read_frames,
    read_tail,
    rss_mb,
    settings,
    states_digest,
    store_digest,
    stored_states,
)

# -- a bulk-built state (large sizes) ----------------------------------------------------------

BULK_BATCH = 50_000  # records per checkpoint of the bulk build
SAMPLE = 200  # entities recomputed from their events, checked against the store
NEW_EVENTS = 50_000  # per access pattern over the big state (two changes each)
PATTERNS = ("round", "uniform", "hot")
HOT_SHARE, HOT_EVENTS = 0.1, 0.9  # "hot": 90% of events on 10% of the users and items
KILL_AT = 2  # the killed worker's checkpoint its kill -9 lands in (the first completes)
NEW_LSN = 10**11  # new changes: after every change of the load
KILL_LSN = 9 * NEW_LSN  # the killed worker's: after the patterns'


def raw_digest(local: LocalStates) -> str:
    """A digest of every key and value each partition's database holds, in key order:
    records, saved offsets and renewal index alike."""
    digest = hashlib.blake2b(digest_size=16)
    for partition in range(PARTITIONS):
        digest.update(b"\x00partition %d" % partition)
        for key, value in local.partition(partition).db.items():
            digest.update(b"%d:%d:" % (len(key), len(value)) + key + value)
    return digest.hexdigest()


def rebuild_bulk(folder: Path, engine: FeatureEngine) -> dict[str, Any]:
    """The bulk-built folder's disk lost, after every worker on it (load, patterns,
    kill -9, restart): rebuilt from the changelog file (``rebuild_lost``); exact if
    it holds byte for byte what the folder it replaces holds (every state, each
    partition's offset, the renewal index): a full digest of both, at every size."""
    local, found = rebuild_lost(folder, engine)
    rebuilt = raw_digest(local)
    local.close()
    kept = open_states(folder / "state", engine)
    before = raw_digest(kept)
    kept.close()
    return {**found, "rebuilt_digest": rebuilt, "rebuilt_equal": rebuilt == before}


def computed_state(engine: FeatureEngine, key: str, stream: Iterable[RegionalChange]) -> Any:
    """The entity's state from its changes, applied by the feature engine alone."""
    entity = engine.engine(key.split(":", 1)[0])
    state = None
    for change in stream:
        state, _changed = entity.apply(state, change)
    return state


async def bulk_build(
    folder: Path, load: Load, engine: FeatureEngine, partitions: Iterable[int] | None = None
) -> dict[str, Any]:
    """Write the load's final states straight to a worker's folder and changelog:
    each entity's changes applied by the worker's feature engine, its vector
    written as the worker writes it (``wrev``/``until`` in its record: the cache
    holds it), pruned and stored as a checkpoint stores it (``store_state`` through
    ``ChangelogWriter`` into DiskChangelog: the changelog file, then the partition's
    database with the offset of the last record). No batching, packs, cache or
    ledger: what makes it fast is that each state is built once, alone.
    ``partitions``: build only the entities of these (one of parallel builders)."""
    local = open_states(folder / "state", engine)
    changelog = DiskChangelog(local, folder / "changelog.log")
    now_ms = load.now_ms
    owned = frozenset(range(PARTITIONS) if partitions is None else partitions)
    started = time.perf_counter()
    pending: dict[int, Delivery] = {}
    for key in load.entity_keys():
        if partition_of(key) not in owned:
            continue
        entity = engine.engine(key.split(":", 1)[0])
        state = computed_state(engine, key, load.changes_of(key))
        if state is None:
            continue
        op = entity.write_op(int(key.split(":", 1)[1]), state, now_ms)
        schedule = op.schedule if isinstance(op, Upsert) else None
        state["wrev"] = op.position.seq  # as RegionRuntime._schedule_renewals
        state["until"] = schedule.until_us if schedule is not None else None
        entity.prune(state)
        delivery = Delivery(partition_of(key), 0)
        changelog.store(key, state, delivery)
        pending[delivery.partition] = delivery
        if sum(len(r) for r in changelog.pending.values()) >= BULK_BATCH:
            await changelog.close(pending)
            pending = {}
    if pending:
        await changelog.close(pending)
    changelog.finish()
    build_s = time.perf_counter() - started
    local.close()
    return {
        "build_s": round(build_s, 1),
        "build_changes_per_s": round(2 * load.users * load.events / build_s),
        "build_records_per_s": round(changelog.records / build_s),
        "changelog_records": changelog.records,
        "serialized_mb": round(changelog.bytes / 1e6, 1),
        "changelog_bytes": changelog.bytes,
    }


def build_part(
    folder: str, load_args: tuple[int, int, int, int], partitions: list[int], out: Any
) -> None:
    """One of parallel builders (a process of its own): ``partitions``' entities into
    a folder and changelog of its own, joined afterwards (:func:`join_parts`)."""
    engine = FeatureEngine(settings().entities)
    out.send(asyncio.run(bulk_build(Path(folder), Load(*load_args), engine, partitions)))


_PUNCH_HOLE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE (linux/falloc.h)
_CHUNK = 64 << 20


def append_freeing(source: Path, target: Any) -> None:
    """``source`` appended to the open file ``target``, each chunk's blocks freed in
    ``source`` once written (fallocate's punch hole, where the file system has it):
    at 10M users a builder's file is ~18 GB, and holding it twice does not fit the
    disk beside the rest. Elsewhere a plain copy."""
    libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
    punch = libc is not None
    with open(source, "r+b") as src:  # writable: punching a hole needs it
        at = 0
        while chunk := src.read(_CHUNK):
            target.write(chunk)
            if punch:
                target.flush()
                os.fsync(target.fileno())  # freed only what is safely elsewhere
                done = libc.fallocate(  # type: ignore[union-attr]
                    src.fileno(), _PUNCH_HOLE, ctypes.c_int64(at), ctypes.c_int64(len(chunk))
                )
                punch = done == 0
            at += len(chunk)


def join_parts(folder: Path, parts: Sequence[tuple[Path, Sequence[int]]]) -> None:
    """The builders' folders as one worker's: each partition's database moved into
    ``folder``'s, and their changelog files one after the other into one (each
    partition's records stay in order: a partition is one builder's), with the
    offset index's marks moved by the bytes before them and holding the finished
    builders' partitions at their last offsets."""
    target = folder / "state" / "w0"
    target.mkdir(parents=True, exist_ok=True)
    last = dict.fromkeys(range(PARTITIONS), -1)
    base = 0
    # The first builder's file is taken as it is, the others appended to it: at 10M
    # users each is tens of GB, so no copy of all of them.
    (parts[0][0] / "changelog.log").rename(folder / "changelog.log")
    with open(folder / "changelog.log", "ab") as log, open(folder / "changelog.idx", "wb") as idx:
        for n, (part, partitions) in enumerate(parts):
            for partition in partitions:
                (part / "state" / "w0" / f"p{partition}").rename(target / f"p{partition}")
            for line in (part / "changelog.idx").read_bytes().splitlines():
                mark = orjson.loads(line)
                for raw, offset in mark["offsets"].items():
                    if int(raw) in partitions:
                        last[int(raw)] = offset
                joined = {"pos": base + mark["pos"], "offsets": last}
                idx.write(orjson.dumps(joined, option=orjson.OPT_NON_STR_KEYS) + b"\n")
            if n > 0:
                append_freeing(part / "changelog.log", log)
            base = log.tell()
            shutil.rmtree(part)


async def bulk_build_parallel(
    folder: Path, load: Load, engine: FeatureEngine, jobs: int
) -> dict[str, Any]:
    """:func:`bulk_build` by ``jobs`` processes, each the entities of some partitions,
    then joined into one folder and changelog (the same states and offsets as one
    builder's; the records in another order across partitions)."""
    if jobs <= 1:
        return {**await bulk_build(folder, load, engine), "build_jobs": 1}
    context = multiprocessing.get_context("spawn")
    load_args = (load.users, load.events, load.now_ms, load.seed)
    started = time.perf_counter()
    running = []
    for job in range(jobs):
        partitions = [p for p in range(PARTITIONS) if p % jobs == job]
        part = folder / f"part{job}"
        receive, send = context.Pipe(duplex=False)
        process = context.Process(target=build_part, args=(str(part), load_args, partitions, send))
        process.start()
        send.close()
        running.append((process, receive, part, partitions))
    found = []
    try:
        for process, receive, _part, _partitions in running:
            try:
                found.append(receive.recv())
            except EOFError:
                process.join()
                raise RuntimeError(f"a bulk builder died (exit {process.exitcode})") from None
            process.join()
    finally:
        for process, *_rest in running:
            if process.is_alive():
                process.kill()
                process.join()
    join_parts(folder, [(part, partitions) for _p, _r, part, partitions in running])
    build_s = time.perf_counter() - started
    records = sum(f["changelog_records"] for f in found)
    serialized = sum(f["changelog_bytes"] for f in found)
    return {
        "build_s": round(build_s, 1),
        "build_jobs": jobs,
        "build_changes_per_s": round(2 * load.users * load.events / build_s),
        "build_records_per_s": round(records / build_s),
        "changelog_records": records,
        "serialized_mb": round(serialized / 1e6, 1),
        "changelog_bytes": serialized,
    }


def new_changes(load: Load, pattern: str, count: int, lsn: int) -> list[RegionalChange]:
    """``count`` new events over the built state, two changes each, at times in the
    last minute: ``round``: users in order (every access a new user: the load's
    order, hostile to a cache), ``uniform``: users and items at random, ``hot``:
    HOT_EVENTS of them on the first HOT_SHARE of users and items."""
    rng = random.Random(f"{load.seed}-{pattern}-{lsn}")
    found: list[RegionalChange] = []

    def pick(n: int) -> int:
        if pattern == "hot":
            hot = max(1, int(n * HOT_SHARE))
            return rng.randrange(1, hot + 1) if rng.random() < HOT_EVENTS else rng.randint(1, n)
        return rng.randint(1, n)

    for i in range(count):
        user = 1 + i % load.users if pattern == "round" else pick(load.users)
        item = pick(load.items)
        at = load.now_ms - rng.randrange(60_000)
        event_id = 10**10 + lsn + i
        row = event_row(event_id, user, item, at, rng)
        pk = str(event_id)
        found.append(RegionalChange("public.events", "c", lsn + i, 0, at, "user", user, pk, row))
        found.append(RegionalChange("public.events", "c", lsn + i, 1, at, "item", item, pk, row))
    return found


def pattern_count(users: int) -> int:
    return NEW_EVENTS if users > 1_000 else 1_000


def pattern_changes(load: Load, n: int) -> list[RegionalChange]:
    return new_changes(load, PATTERNS[n], pattern_count(load.users), NEW_LSN * (n + 2))


def everything_of(
    load: Load, keys: Sequence[str], stream: Sequence[tuple[int, list[bytes]]]
) -> dict[str, list[RegionalChange]]:
    """Every change of each of ``keys`` in the run: the load's, the patterns', and the
    killed worker's ``stream``, in order (for their recomputation)."""
    found = {key: load.changes_of(key) for key in keys}
    later = [c for n in range(len(PATTERNS)) for c in pattern_changes(load, n)]
    later += [
        RegionalChange.from_wire(c)
        for _p, packs in stream
        for body in packs
        for c in orjson.loads(body)
    ]
    for change in later:
        if change.key in found:
            found[change.key].append(change)
    return found


def store_offsets(local: LocalStates) -> dict[int, int]:
    found = {p: local.partition(p).offset() for p in range(PARTITIONS)}
    return {p: -1 if o is None else o for p, o in found.items()}


async def measure_patterns(
    folder: Path, load: Load, engine: FeatureEngine, budget: int, checkpoint_s: float, count: int
) -> dict[str, Any]:
    """A worker on the built folder applies ``count`` new events of each pattern
    (the worker's whole apply path: packs, batches, vectors, checkpoints, the
    states' cache): changes/s of each, and the vectors it wrote for them (a batch
    writes an entity's vector once, whatever number of its changes it holds: over
    few entities several changes fold into one write, over millions almost none
    do); its RSS after them."""
    clock = Clock()
    now_s = load.now_ms / 1000
    gc.collect()
    base = rss_mb()
    local = open_states(folder / "state", engine)
    changelog = DiskChangelog(local, folder / "changelog.log", store_offsets(local))
    runtime, cache = make_runtime(
        clock, now_s, changelog, engine, checkpoint_s, store=local, memory_bytes=budget
    )
    runtime.resumed(list(range(PARTITIONS)))
    offsets = dict.fromkeys(range(PARTITIONS), 0)
    found: dict[str, Any] = {}
    peak_cache = 0.0
    for n, pattern in enumerate(PATTERNS):
        stream = list(pack_changes(pattern_changes(load, n)))
        loads, written = runtime.live.loads, cache.ops
        seconds, peak = await apply_messages(runtime, clock, stream, offsets)
        found[f"{pattern}_changes_per_s"] = round(2 * count / seconds)
        found[f"{pattern}_loads"] = runtime.live.loads - loads
        vectors = found[f"{pattern}_vectors"] = cache.ops - written
        found[f"{pattern}_vectors_per_s"] = round(vectors / seconds)
        peak_cache = max(peak_cache, peak)
    gc.collect()
    found.update(
        rss_mb=round(rss_mb()),
        state_mb=round(rss_mb() - base),
        peak_cache_mb=round(peak_cache, 1),
        dead_lettered=runtime.dead_letters.sent,  # type: ignore[attr-defined]
    )
    changelog.finish()
    local.close()
    return found


def killed_worker(
    folder: str, load_args: tuple[int, int, int, int], budget: int, checkpoint_s: float, out: Any
) -> None:
    """The worker killed with kill -9 during load (a process of its own): it says so
    from inside its KILL_AT-th checkpoint, between the broker's acknowledgement
    and the store's write (records past the saved offsets: a tail), and waits."""
    asyncio.run(_killed_worker(Path(folder), Load(*load_args), budget, checkpoint_s, out))


def kill_stream(load: Load) -> list[tuple[int, list[bytes]]]:
    count = max(NEW_EVENTS // 2, 1_000) if load.users > 1_000 else 3_000
    return list(pack_changes(new_changes(load, "uniform", count, KILL_LSN)))


async def _killed_worker(
    folder: Path, load: Load, budget: int, checkpoint_s: float, out: Any
) -> None:
    clock = Clock()
    engine = FeatureEngine(settings().entities)
    local = open_states(folder / "state", engine)
    changelog = DiskChangelog(local, folder / "changelog.log", store_offsets(local))
    runtime, _cache = make_runtime(
        clock,
        load.now_ms / 1000,
        changelog,
        engine,
        checkpoint_s,
        store=local,
        memory_bytes=budget,
        acker=FileAcker(folder / "acked"),
    )
    runtime.resumed(list(range(PARTITIONS)))

    def kill_me(unstored: int) -> None:
        if changelog.closes + 1 < KILL_AT:
            return
        gc.collect()
        # Kill me now, in the middle of the load, with ``unstored`` records in the
        # changelog past the store's saved offsets (the tail a restart replays);
        # a worker alone in its process over the built state: its resident memory.
        out.send(("loading", rss_mb(), unstored))
        signal.pause()  # until the kill -9

    changelog.acknowledged = kill_me
    await apply_messages(runtime, clock, kill_stream(load), dict.fromkeys(range(PARTITIONS), 0))
    out.send(("done", rss_mb(), 0))
    signal.pause()  # until the kill -9


async def restart_after_kill(
    folder: Path, load: Load, engine: FeatureEngine, budget: int, checkpoint_s: float
) -> dict[str, Any]:
    """A worker killed (kill -9) during load, inside its KILL_AT-th checkpoint once
    the changelog holds the checkpoint's records and before its store does, then
    restarted on its folder: from opening it (that tail after the saved offsets
    applied) to the first message after the committed offsets that writes a vector
    (fresh writes served; the messages before it are the tail's, delivered again);
    then the rest of the stream, and the touched entities checked against their
    recomputation (0 lost, 0 counted twice)."""
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    load_args = (load.users, load.events, load.now_ms, load.seed)
    process = context.Process(
        target=killed_worker, args=(str(folder), load_args, budget, checkpoint_s, send)
    )
    process.start()
    send.close()
    try:
        said, worker_rss, unstored = receive.recv()
        during = said == "loading"
    except EOFError:
        process.join()
        raise RuntimeError(f"the killed worker died first (exit {process.exitcode})") from None
    os.kill(process.pid or 0, signal.SIGKILL)
    process.join()
    stream = kill_stream(load)
    clock = Clock()
    gc.collect()
    started = time.perf_counter()
    local = open_states(folder / "state", engine)
    tail, ends = read_tail(folder / "changelog.log", local)
    tail_s = time.perf_counter() - started
    changelog = DiskChangelog(local, folder / "changelog.log", ends)
    runtime, cache = make_runtime(
        clock, load.now_ms / 1000, changelog, engine, checkpoint_s, store=local, memory_bytes=budget
    )
    runtime.resumed(list(range(PARTITIONS)))
    acked = read_acks(folder / "acked")
    skip, held = dict(acked), 0
    # From the committed offsets on, until a message writes a vector: the first
    # ones the tail already holds (unacknowledged: delivered again) write nothing.
    for partition, offset, body in numbered(stream):
        if offset > acked.get(partition, 0):
            await runtime.on_message(Delivery(partition, offset), body)
            await runtime.flush()
            skip[partition] = offset
            if cache.ops:
                break
            held += 1
    recovery_s = time.perf_counter() - started
    served = cache.ops > 0
    await apply_messages(runtime, clock, stream, dict.fromkeys(range(PARTITIONS), 0), skip)
    keys = sorted(
        {
            f"{c['e']}:{c['id']}"
            for _p, packs in stream[:: max(1, len(stream) // 20)]
            for body in packs
            for c in orjson.loads(body)
        }
    )[:SAMPLE]
    equal = all(
        entity_hash(engine, key, runtime.live.get(key) or EntityState(), load.now_ms)
        == entity_hash(engine, key, computed_state(engine, key, stream_of), load.now_ms)
        for key, stream_of in everything_of(load, keys, stream).items()
    )
    changelog.finish()
    local.close()
    return {
        "killed_during_load": during,
        "worker_rss_mb": round(worker_rss),
        "kill_acked_messages": sum(acked.values()),
        "kill_unstored_records": unstored,
        "kill_tail_records": tail,
        "kill_tail_s": round(tail_s, 3),
        "kill_held_messages": held,
        "kill_recovery_s": round(recovery_s, 3),
        "kill_fresh_served": served,
        "kill_checked": len(keys),
        "kill_equal": equal,
    }


async def load_bulk(run: Run) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="scale-bulk-", dir=os.environ.get("SCALE_DIR")))
    try:
        return await _load_bulk(folder, run)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


async def _load_bulk(folder: Path, run: Run) -> dict[str, Any]:
    """Build the state in bulk (by ``run.jobs`` processes), check it, then measure a
    worker over it: the access patterns' changes/s and its RSS, a kill -9 during load
    and its restart, and the folder's disk lost and rebuilt from the changelog."""
    users, events, seed, now_s = run.users, run.events, run.seed, run.now_s
    checkpoint_s, memory_mb, jobs = run.checkpoint_s, run.memory_mb, run.jobs
    load = Load(users, events, int(now_s * 1000), seed)
    engine = FeatureEngine(settings().entities)
    budget = int(memory_mb * 2**20)
    built = await bulk_build_parallel(folder, load, engine, jobs)
    store_bytes = folder_bytes(folder / "state")
    # A restart on the built folder: its states are the engine's for the load's
    # changes (the full digest where cheap, else a sample recomputed).
    local = open_states(folder / "state", engine)
    result: dict[str, Any] = {"mode": "bulk", "users": users, "events_per_user": events}
    if users <= DIGEST_USERS:
        stored = list(stored_states(local))
        result["digest"], _w, result["entities"], result["rows"] = store_digest(
            engine, stored, load.now_ms
        )
        result["state_digest"] = states_digest(engine, stored)
        del stored
    if users <= DIGEST_USERS:
        # The saved offsets are the changelog's real positions (counted afresh).
        last = dict.fromkeys(range(PARTITIONS), -1)
        for partition, _key, _value in read_frames(folder / "changelog.log"):
            last[partition] += 1
        result["offsets_match"] = last == store_offsets(local)
    step = max(1, (users + load.items) // SAMPLE)
    sample = [k for n, k in enumerate(load.entity_keys()) if n % step == 0]
    result["sample_equal"] = all(
        entity_hash(engine, key, local.load(key, partition_of(key)) or EntityState(), load.now_ms)
        == entity_hash(engine, key, computed_state(engine, key, load.changes_of(key)), load.now_ms)
        for key in sample
    )
    result["sample"] = len(sample)
    local.close()
    serialized = built["serialized_mb"] * 1e6
    result.update(
        built,
        memory_mb=memory_mb,
        budget_bytes=budget,
        changes=2 * users * events,
        store_mb=round(store_bytes / 1e6, 1),
        store_ratio=round(store_bytes / max(serialized, 1), 2),
    )
    count = pattern_count(users)
    result["new_changes"] = 2 * count
    result.update(await measure_patterns(folder, load, engine, budget, checkpoint_s, count))
    result.update(await restart_after_kill(folder, load, engine, budget, checkpoint_s))
    if not os.environ.get("SCALE_NO_LOST_DISK"):
        # SCALE_NO_LOST_DISK=1: not at sizes where the whole changelog takes too long
        # to read again (it grows with the history: ~100 s per 1M users here).
        result.update(rebuild_bulk(folder, engine))
    return result
