"""Benchmark of a regional worker's state against the number of entities (issue 36).

Two modes of the worker, measured in the same run for every size (so that the
figures are ratios within one run), each size and mode in a process of its own
(so that its resident memory is its own) and with the worker's garbage-collector
tuning (pipeline.gctune, once a second):

- ``memory``: every entity state a Python object (``RegionRuntime`` without a
  store), recovered whole from the changelog;
- ``disk``: the states on local disk (``store=`` pipeline.localstore.LocalStates,
  one RocksDB per changelog partition) behind a bounded cache of the hot ones
  (``memory_bytes=``, ``--memory-mb``: pipeline.runtime.states.StateCache), read
  back on a miss; a restart reads nothing up front (``runtime.resumed``).

The load: users with ``--events`` events each over the last day (every event two
regional changes: its user's and its item's; one item per 10 users), interleaved
in time as a stream is, applied through the regional worker's runtime
(pipeline.runtime.RegionRuntime: packs decoded, changes applied, vectors and
schedules computed per batch, states to the changelog per checkpoint) with
in-memory ports for the cache. The changelog: in memory mode a dict (Faust's
memory table: no I/O); in disk mode a sink like pipeline.faustlocal.LocalChangelog
whose broker is a file: each record encoded once (orjson) and appended to the
file, and, at the checkpoint's close, written to the partition's database with
the offset of the last (``records_applied``).

Recovery. Memory mode: the changelog's records, serialized as on the broker,
decoded and rebuilt into working states (``pipeline.statestore.rebuild_states``),
and the vectors written at once after it. Disk mode: a fresh worker on the same
folder, from opening it to the first new change of an existing user applied and
its vector written to the cache (the time to serve fresh writes), then the
renewals due at once (one tick: the renewal index's range reads); and a lost
disk: an empty folder rebuilt from the changelog file (``records_applied`` by
batches of 10,000 records). Both check that every entity's vector afterwards is
the one before (read through the store, in disk mode).

Reported per size and mode: changes/s of the apply path, resident memory (RSS)
after the load, the state's part of it (RSS less that of the empty worker) per
user, checkpoint seconds, the changelog's serialized size (one record per key, as
compaction keeps it), recovery seconds and the vectors rewritten at once after it;
memory mode: bytes per stored row; disk mode: the store's size on disk (against
the serialized changelog's: the target is within 2x), the cache's reads from the
store (misses) and evictions, the time to serve fresh writes after a restart, to
renew what is due at once, and to rebuild a lost disk.

    .venv/bin/python benchmarks/scale.py                       # 10k and 100k users
    .venv/bin/python benchmarks/scale.py --users 1000000       # one size
    .venv/bin/python benchmarks/scale.py --mode disk --memory-mb 512
    .venv/bin/python benchmarks/scale.py --smoke               # 500 users (the test suite)
    .venv/bin/python benchmarks/scale.py --plot docs/img/scale.png
    .venv/bin/python benchmarks/scale.py --users 10000 --mode disk --memory-mb 64 \\
        --profile /tmp/scale.prof                              # where the time goes
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import functools
import gc
import hashlib
import json
import math
import multiprocessing
import os
import platform
import random
import resource
import shutil
import signal
import struct
import sys
import tempfile
import time
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

# This folder holds files named like the packages they measure: not on the path.
_HERE = str(Path(__file__).resolve().parent)
sys.path[:] = [p for p in sys.path if p not in ("", _HERE)]

import orjson  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

from edge_cache import Delete, Upsert  # noqa: E402
from edgefeed.settings import EdgefeedSettings, load_settings  # noqa: E402
from pipeline.features import EntityState, FeatureEngine  # noqa: E402
from pipeline.gctune import GcTuner  # noqa: E402
from pipeline.localstore import ChangelogWriter, LocalStates  # noqa: E402
from pipeline.messages import RegionalChange, encode_packs  # noqa: E402
from pipeline.metrics import PipelineMetrics  # noqa: E402
from pipeline.runtime import BatchPolicy, Delivery, RegionRuntime  # noqa: E402
from pipeline.runtime.region import ChangelogSink, renewal_due  # noqa: E402
from pipeline.statestore import checkpoint_key, rebuild_states, store_state  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DAY_MS = 86_400_000
PARTITIONS = 4
CHANGES_PER_MESSAGE = 100  # the router's packs under load
MESSAGE_S = 0.005  # the fake clock's step per message: 20 ms batches hold ~4 messages
KINDS = ("view",) * 6 + ("click",) * 2 + ("add_to_cart", "purchase")
MODES = ("memory", "disk")
MEMORY_MB = 256.0  # disk mode's default budget for the states in memory
SMOKE_MEMORY_MB = 2.0  # --smoke: small, so that states are evicted and read back
REBUILD_BATCH = 10_000  # records per records_applied when rebuilding a lost disk
# A changelog file's record: partition, key length, value length (NONE: a deletion).
FRAME = struct.Struct("<BII")
NONE = 0xFFFFFFFF
FRESH_USER = 1  # the existing user whose new change a restarted disk worker serves
FRESH_LSN = 10**12  # after every change of the load


def _page_kb() -> int:
    return os.sysconf("SC_PAGE_SIZE") // 1024


def rss_mb() -> float:
    """This process's resident memory now (not its peak)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * _page_kb() / 1024


def folder_bytes(path: Path) -> int:
    """The size of the files under ``path`` (all folders down)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@functools.cache
def settings() -> EdgefeedSettings:
    return load_settings(ROOT / "examples" / "edgefeed.yaml", env={})


class Cache:
    """CacheSink that keeps nothing: the vectors are computed, not stored (``keys``,
    when a list, gets the entity key of every vector written)."""

    def __init__(self) -> None:
        self.ops = 0
        self.keys: list[str] | None = None

    async def write(
        self, ops: Sequence[Upsert | Delete], now_us: int, *, freshness: bool = True
    ) -> Sequence[bool]:
        self.ops += len(ops)
        if self.keys is not None:
            self.keys.extend(f"{op.entity}:{op.id}" for op in ops)
        return [True] * len(ops)

    async def quarantine(self, quarantined: Mapping[str, str], released: Sequence[str]) -> None:
        return None

    async def rebuilding(self, marks: Mapping[str, str | None]) -> None:
        return None

    async def intact(self) -> bool:
        return True


class Changelog:
    """ChangelogSink into a dict, as Faust's memory store holds the table (the records'
    values are the states' own objects, as the worker's table holds them)."""

    def __init__(self) -> None:
        self.table: dict[str, Any] = {}
        self.seconds = 0.0
        self.records = 0

    def store(self, key: str, state: EntityState, delivery: Delivery) -> None:
        started = time.perf_counter()
        self.records += store_state(self.table, key, state)
        self.seconds += time.perf_counter() - started

    async def relieve(self) -> None:
        return None

    async def close(self, partitions: Mapping[int, Delivery]) -> None:
        return None


class DiskChangelog:
    """ChangelogSink as pipeline.faustlocal.LocalChangelog, with a file for a broker
    that acknowledges at once: each record appended to the file when sent; at the
    checkpoint's close, the partition's records to its database with the offset of
    the last (offsets counted per partition, from 0)."""

    def __init__(
        self, local: LocalStates, path: Path, offsets: Mapping[int, int] | None = None
    ) -> None:
        self.local, self.path = local, path
        self.log = open(path, "ab")  # noqa: SIM115 - open as long as the sink
        # Where each checkpoint's records begin (the broker's offset index): a
        # restart reads a partition's tail from there, not the file from its start.
        self.index = open(path.with_suffix(".idx"), "ab")  # noqa: SIM115
        self.pending: dict[int, list[tuple[bytes, bytes | None]]] = defaultdict(list)
        self.offsets: dict[int, int] = dict(offsets or dict.fromkeys(range(PARTITIONS), -1))
        self.seconds = 0.0
        self.records = 0
        self.bytes = 0
        self.closes = 0
        # Called with the records of a checkpoint once the broker has them, before
        # the store does: where the killed worker takes its kill -9.
        self.acknowledged: Callable[[int], None] | None = None
        self._mark()

    def _mark(self) -> None:
        mark = {"pos": self.log.tell(), "offsets": self.offsets}
        self.index.write(orjson.dumps(mark, option=orjson.OPT_NON_STR_KEYS) + b"\n")
        self.index.flush()

    def send(self, partition: int, key: str, value: bytes | None) -> None:
        raw_key = key.encode()
        size = NONE if value is None else len(value)
        self.log.write(FRAME.pack(partition, len(raw_key), size) + raw_key + (value or b""))
        self.bytes += len(raw_key) + (len(value) if value is not None else 0)
        self.pending[partition].append((raw_key, value))

    def store(self, key: str, state: EntityState, delivery: Delivery) -> None:
        started = time.perf_counter()
        self.records += store_state(ChangelogWriter(self, delivery.partition), key, state)
        self.seconds += time.perf_counter() - started

    async def relieve(self) -> None:
        return None

    async def close(self, partitions: Mapping[int, Delivery]) -> None:
        started = time.perf_counter()
        at_ms = int(time.time() * 1000)
        for partition in partitions:
            self.send(partition, checkpoint_key(partition), orjson.dumps({"at_ms": at_ms}))
        self.log.flush()  # what the broker acknowledged
        pending, self.pending = self.pending, defaultdict(list)
        if self.acknowledged is not None:
            self.acknowledged(sum(len(records) for records in pending.values()))
        for partition, records in pending.items():
            self.offsets[partition] += len(records)
            self.local.records_applied(partition, records, self.offsets[partition])
        self._mark()
        self.closes += 1
        self.seconds += time.perf_counter() - started

    def finish(self) -> None:
        self.log.close()
        self.index.close()


def read_frames(path: Path, start: int = 0) -> Iterator[tuple[int, bytes, bytes | None]]:
    """The records of a DiskChangelog's file from byte ``start``: (partition, key, value
    or None); a record cut short at the end (a writer killed) ends it."""
    with open(path, "rb") as log:
        log.seek(start)
        while len(header := log.read(FRAME.size)) == FRAME.size:
            partition, key_len, value_len = FRAME.unpack(header)
            key = log.read(key_len)
            value = None if value_len == NONE else log.read(value_len)
            if len(key) < key_len or (value is not None and len(value) < value_len):
                return
            yield partition, key, value


def read_tail(path: Path, local: LocalStates) -> tuple[int, dict[int, int]]:
    """Bring each partition's database up to the changelog's end, as a restarted
    worker does: the records after its saved offset, read from the last checkpoint
    mark (the file's offset index) at or before it; a record cut short at the end
    (never acknowledged) is cut off. Returns (records applied, each partition's
    last offset)."""
    saved = {p: local.partition(p).offset() for p in range(PARTITIONS)}
    floor = {p: -1 if o is None else o for p, o in saved.items()}
    start, offsets = 0, dict.fromkeys(range(PARTITIONS), -1)
    with open(path.with_suffix(".idx"), "rb") as index:
        for line in index:
            if not line.endswith(b"\n"):
                break
            mark = orjson.loads(line)
            found = {int(p): o for p, o in mark["offsets"].items()}
            if all(found[p] <= floor[p] for p in range(PARTITIONS)):
                start, offsets = mark["pos"], found
    applied, read = apply_frames(local, read_frames(path, start), offsets, floor)
    with open(path, "r+b") as log:
        log.truncate(start + read)
    return applied, offsets


def apply_frames(
    local: LocalStates,
    frames: Iterator[tuple[int, bytes, bytes | None]],
    offsets: dict[int, int],
    floor: dict[int, int] | None = None,
) -> tuple[int, int]:
    """Apply changelog records to each partition's database by batches of
    REBUILD_BATCH, as a worker's recovery does; ``offsets`` (each partition's last
    offset) move with them, and records at or below ``floor`` (what a database
    already holds) are skipped. Returns (records applied, bytes of frames read)."""
    batches: dict[int, list[tuple[bytes, bytes | None]]] = defaultdict(list)
    applied = read = 0
    for partition, key, value in frames:
        read += FRAME.size + len(key) + (len(value) if value is not None else 0)
        offsets[partition] += 1
        if floor is not None and offsets[partition] <= floor[partition]:
            continue
        applied += 1
        batch = batches[partition]
        batch.append((key, value))
        if len(batch) >= REBUILD_BATCH:
            local.records_applied(partition, batch, offsets[partition])
            batches[partition] = []
    for partition, batch in batches.items():
        if batch:
            local.records_applied(partition, batch, offsets[partition])
    return applied, read


class FileAcker:
    """Acker that commits each message's offset to a file (the consumer group's
    committed offsets, read by the worker restarted after a kill)."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "a")  # noqa: SIM115 - open as long as the acker

    async def ack(self, delivery: Delivery) -> None:
        self.file.write(f"{delivery.partition} {delivery.offset}\n")
        self.file.flush()


def read_acks(path: Path) -> dict[int, int]:
    acked: dict[int, int] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2:
                partition, offset = int(parts[0]), int(parts[1])
                acked[partition] = max(offset, acked.get(partition, -1))
    return acked


class Acker:
    async def ack(self, delivery: Delivery) -> None:
        return None


class DeadLetters:
    def __init__(self) -> None:
        self.sent = 0

    async def send(
        self, delivery: Delivery, value: bytes, reason: str, error: str, index: int | None
    ) -> None:
        self.sent += 1


def event_row(event_id: int, user: int, item: int, at: int, rng: random.Random) -> dict[str, Any]:
    return {
        "event_id": event_id,
        "user_id": user,
        "item_id": item,
        "category_id": item % 20,
        "price": round(rng.uniform(1, 200), 2),
        "home_region": "eu-west",
        "kind": rng.choice(KINDS),
        "occurred_at": at * 1000,
    }


_M64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finalizer: a well-spread 64-bit hash of ``x`` (the load's
    draws, so that any event is computed alone: the bulk build needs each
    entity's events without generating everyone's)."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


class Load:
    """The load: ``users`` users with ``events`` events each over the day before
    ``now_ms``; the r-th event of every user falls in the r-th slice of the day, and
    round r gives every user its r-th event (a stream interleaves its entities).
    Every event two regional changes: its user's and its item's (one item per 10
    users). Each event is a function of (user, round), and each item's events are
    found without the others' (its users in a round are a residue class of a
    permutation of the users), so that the bulk build computes an entity's events
    alone, the very ones the stream carries."""

    def __init__(self, users: int, events: int, now_ms: int, seed: int) -> None:
        self.users, self.events, self.now_ms, self.seed = users, events, now_ms, seed
        self.items = max(1, users // 10)
        self.slice_ms = DAY_MS // events
        step = 0x9E3779B1
        while math.gcd(step, users) != 1:
            step += 2
        self.step, self.inverse = step, pow(step, -1, users) if users > 1 else 0

    def item_of(self, user: int, r: int) -> int:
        return 1 + (((user - 1) * self.step) % self.users + r) % self.items

    def users_of(self, item: int, r: int) -> list[int]:
        """The users whose r-th event is on ``item``, in order."""
        first = (item - 1 - r) % self.items
        found = [1 + (w * self.inverse) % self.users for w in range(first, self.users, self.items)]
        found.sort()
        return found

    def event(self, user: int, r: int) -> tuple[RegionalChange, RegionalChange]:
        """The user's r-th event: its user's change and its item's."""
        event_id = r * self.users + user
        draw = _mix((self.seed << 48) ^ event_id)
        at = self.now_ms - DAY_MS + r * self.slice_ms + draw % self.slice_ms
        item = self.item_of(user, r)
        row = {
            "event_id": event_id,
            "user_id": user,
            "item_id": item,
            "category_id": item % 20,
            "price": round(1 + (draw >> 24) % 19_901 / 100, 2),
            "home_region": "eu-west",
            "kind": KINDS[(draw >> 48) % len(KINDS)],
            "occurred_at": at * 1000,
        }
        lsn, pk = 1_000 + event_id, str(event_id)
        return (
            RegionalChange("public.events", "c", lsn, 0, at, "user", user, pk, row),
            RegionalChange("public.events", "c", lsn, 1, at, "item", item, pk, row),
        )

    def stream(self) -> Iterator[RegionalChange]:
        for r in range(self.events):
            for user in range(1, self.users + 1):
                yield from self.event(user, r)

    def entity_keys(self) -> Iterator[str]:
        """Every entity's key: the users, then the items."""
        for user in range(1, self.users + 1):
            yield f"user:{user}"
        for item in range(1, self.items + 1):
            yield f"item:{item}"

    def changes_of(self, key: str) -> list[RegionalChange]:
        """The entity's changes in the stream, in stream order."""
        entity, _, raw = key.partition(":")
        number = int(raw)
        if entity == "user":
            return [self.event(number, r)[0] for r in range(self.events)]
        return [
            self.event(user, r)[1] for r in range(self.events) for user in self.users_of(number, r)
        ]


def changes(users: int, events: int, now_ms: int, seed: int) -> Iterator[RegionalChange]:
    """The load's changes in stream order (see :class:`Load`)."""
    return Load(users, events, now_ms, seed).stream()


def partition_of(key: str) -> int:
    """The router's key partitioning (a stable hash: the bulk build, the worker it
    kills and the one restarted after it are other processes)."""
    return zlib.crc32(key.encode()) % PARTITIONS


def messages(users: int, events: int, now_ms: int, seed: int) -> Iterator[tuple[int, list[bytes]]]:
    """The load's (partition, packs), see :func:`pack_changes`."""
    return pack_changes(changes(users, events, now_ms, seed))


def numbered(stream: Iterable[tuple[int, list[bytes]]]) -> Iterator[tuple[int, int, bytes]]:
    """Each message of ``stream`` as (partition, offset, body), offsets from 1."""
    offsets: dict[int, int] = defaultdict(int)
    for partition, packs in stream:
        for body in packs:
            offsets[partition] += 1
            yield partition, offsets[partition], body


def pack_changes(stream: Iterable[RegionalChange]) -> Iterator[tuple[int, list[bytes]]]:
    """(partition, packs) by CHANGES_PER_MESSAGE changes, per partition as the router's
    key partitioning sends them."""
    pending: dict[int, list[bytes]] = {p: [] for p in range(PARTITIONS)}
    for change in stream:
        partition = partition_of(change.key or "")
        bodies = pending[partition]
        bodies.append(change.encode())
        if len(bodies) >= CHANGES_PER_MESSAGE:
            yield partition, encode_packs(bodies)
            pending[partition] = []
    for partition, bodies in pending.items():
        if bodies:
            yield partition, encode_packs(bodies)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def make_runtime(
    clock: Clock,
    now_s: float,
    changelog: ChangelogSink,
    engine: FeatureEngine,
    checkpoint_s: float,
    store: LocalStates | None = None,
    memory_bytes: int | None = None,
    acker: Acker | FileAcker | None = None,
) -> tuple[RegionRuntime, Cache]:
    cache = Cache()
    runtime = RegionRuntime(
        region="eu-west",
        app_id="scale",
        engine=engine,
        partition_of=partition_of,
        cache=cache,
        changelog=changelog,
        dead_letters=DeadLetters(),
        acker=acker or Acker(),
        metrics=PipelineMetrics.create(CollectorRegistry()),
        policy=BatchPolicy(5000, 0.02, 2.0),
        checkpoint_interval_s=checkpoint_s,
        clock=clock,
        wall=lambda: now_s + (clock.now - 1_000.0),
        store=store,
        memory_bytes=memory_bytes,
    )
    return runtime, cache


async def apply_load(
    runtime: RegionRuntime, clock: Clock, users: int, events: int, seed: int, now_s: float
) -> tuple[float, float]:
    """Apply the load through ``runtime``, then write and checkpoint what is left:
    (seconds, the peak estimated memory of the states in memory, MB)."""
    stream = messages(users, events, int(now_s * 1000), seed)
    return await apply_messages(runtime, clock, stream, dict.fromkeys(range(PARTITIONS), 0))


async def apply_messages(
    runtime: RegionRuntime,
    clock: Clock,
    stream: Iterable[tuple[int, list[bytes]]],
    offsets: dict[int, int],
    skip: Mapping[int, int] | None = None,
) -> tuple[float, float]:
    """Apply ``stream`` through ``runtime`` (message offsets per partition counted on
    from ``offsets``, which is updated; those up to ``skip``'s are not applied: a
    restarted worker's committed offsets), then write and checkpoint what is left:
    (seconds, the peak estimated memory of the states in memory, MB)."""
    applied_s = 0.0
    peak = 0
    # The worker's collector tuning (pipeline.gctune), once per second of its clock,
    # as the region app's housekeeping task runs it.
    tuner = GcTuner()
    next_tune = clock.now + 1.0
    # SCALE_BESIDE=1: checkpoints run beside the stream, as in the worker (one turn
    # of the event loop per message), instead of being awaited after each message:
    # what issue 36's backpressure bounds (docs/benchmarks.md, "State at scale").
    beside = bool(os.environ.get("SCALE_BESIDE"))
    for partition, packs in stream:
        for body in packs:
            offsets[partition] += 1
            if skip is not None and offsets[partition] <= skip.get(partition, -1):
                continue
            delivery = Delivery(partition, offsets[partition])
            started = time.perf_counter()
            await runtime.on_message(delivery, body)
            clock.now += MESSAGE_S
            await runtime.tick()
            if clock.now >= next_tune:
                tuner.tick()
                next_tune = clock.now + 1.0
            task = runtime._checkpoint_task
            if beside:
                await asyncio.sleep(0)  # a turn of the agent's loop: the checkpoint's too
            elif task is not None and not task.done():
                await task
            applied_s += time.perf_counter() - started
            peak = max(peak, runtime.live.weight)
    started = time.perf_counter()
    await settle(runtime, clock)
    applied_s += time.perf_counter() - started
    return applied_s, max(peak, runtime.live.weight) / 1e6


async def settle(runtime: RegionRuntime, clock: Clock) -> None:
    """Write the open batch and checkpoint until every state is in the changelog."""
    await runtime.flush(lane=True)
    # Until every state is in the changelog (on disk, the bookkeeping of the vectors
    # just written takes a checkpoint of its own).
    for _ in range(10):
        clock.now += 2.0
        await runtime.tick()
        if runtime._checkpoint_task is not None:
            await runtime._checkpoint_task
        if not runtime.ledger.dirty and not runtime.ledger.ready:
            break


def entity_hash(engine: FeatureEngine, key: str, state: EntityState, at_ms: int) -> int:
    vector = engine.engine(key.split(":", 1)[0]).vector(state, at_ms)
    raw = key.encode() + orjson.dumps(vector, option=orjson.OPT_SORT_KEYS)
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest())


def _figures(
    users: int,
    events: int,
    dead: int,
    entities: int,
    rows: int,
    digest: int,
    applied_s: float,
    rss: float,
    base: float,
) -> dict[str, Any]:
    """The figures both modes report alike."""
    changes_n = 2 * users * events
    return {
        "users": users,
        "events_per_user": events,
        "changes": changes_n,
        "dead_lettered": dead,
        "entities": entities,
        "rows": rows,
        "digest": digest,
        "apply_s": round(applied_s, 2),
        "changes_per_s": round(changes_n / applied_s),
        "rss_mb": round(rss),
        "state_mb": round(rss - base),
        "kb_per_user": round((rss - base) * 1024 / users, 1),
    }


def vectors_digest(runtime: RegionRuntime, at_ms: int) -> int:
    """An order-independent digest of every entity's vector read at ``at_ms``."""
    total = 0
    for key, state in runtime.live.items():
        total = (total + entity_hash(runtime.engine, key, state, at_ms)) % 2**64
    return total


def stored_states(local: LocalStates, get: Any = None) -> Iterator[tuple[str, EntityState | None]]:
    """Every entity the store holds, each partition's in key order, with its state:
    through ``get`` (a runtime's ``live.get``: its cache, then the store) or read
    from the store."""
    for partition in range(PARTITIONS):
        for key in local.entity_keys(partition):
            yield key, get(key) if get is not None else local.load(key, partition)


def store_digest(
    engine: FeatureEngine,
    states: Iterable[tuple[str, EntityState | None]],
    at_ms: int,
    leave_out: frozenset[str] = frozenset(),
) -> tuple[int, int, int, int]:
    """(digest of every entity's vector, digest without ``leave_out``, entities, rows)."""
    total = without = entities = rows = 0
    for key, state in states:
        if state is None:
            continue
        entities += 1
        rows += sum(len(r) for r in state["rows"].values())
        found = entity_hash(engine, key, state, at_ms)
        total = (total + found) % 2**64
        if key not in leave_out:
            without = (without + found) % 2**64
    return total, without, entities, rows


def store_record_bytes(local: LocalStates) -> int:
    """The serialized size of the changelog records the store holds (one per key, as
    compaction keeps them; its offsets, epochs and renewal index left out)."""
    total = 0
    for partition in range(PARTITIONS):
        it = local.partition(partition).db.iter()
        it.seek_to_first()
        while it.valid():
            key = it.key()
            if key[:1] not in (b"\x00", b"\x1e"):
                total += len(key) + len(it.value())
            it.next()
    return total


# -- memory mode ------------------------------------------------------------------------------


async def load_memory(
    users: int, events: int, seed: int, now_s: float, checkpoint_s: float
) -> dict[str, Any]:
    """Apply the load, then recover from the changelog; the figures."""
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


async def load_disk(
    users: int,
    events: int,
    seed: int,
    now_s: float,
    checkpoint_s: float,
    memory_mb: float,
    profile: str | None = None,
) -> dict[str, Any]:
    """Apply the load with the states on disk, restart on the folder, rebuild a lost
    one from the changelog; the figures."""
    folder = Path(tempfile.mkdtemp(prefix="scale-disk-"))
    try:
        return await _load_disk(
            folder, users, events, seed, now_s, checkpoint_s, memory_mb, profile
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)


async def _load_disk(
    folder: Path,
    users: int,
    events: int,
    seed: int,
    now_s: float,
    checkpoint_s: float,
    memory_mb: float,
    profile: str | None = None,
) -> dict[str, Any]:
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


# -- a bulk-built state (large sizes) ----------------------------------------------------------

BULK_BATCH = 50_000  # records per checkpoint of the bulk build
DIGEST_USERS = 100_000  # up to this size, the bulk state's full digest (else a sample)
SAMPLE = 200  # entities recomputed from their events, checked against the store
NEW_EVENTS = 50_000  # per access pattern over the big state (two changes each)
PATTERNS = ("round", "uniform", "hot")
HOT_SHARE, HOT_EVENTS = 0.1, 0.9  # "hot": 90% of events on 10% of the users and items
KILL_AT = 2  # the killed worker's checkpoint its kill -9 lands in (the first completes)
NEW_LSN = 10**11  # new changes: after every change of the load
KILL_LSN = 9 * NEW_LSN  # the killed worker's: after the patterns'


def state_hash(engine: FeatureEngine, key: str, state: EntityState) -> int:
    """A digest of what a state holds: its position and the rows a feature can still
    read (the rows past every window's retention that the amortised pruning had not
    cut yet, ``marks``, its bookkeeping, and ``until``, its vector's schedule, left
    out: they depend on when checkpoints and writes fell)."""
    kept = {k: state.get(k) for k in ("lsn", "rev", "ts", "gone", "v", "wrev")}
    cut: dict[str, Any] = {"rows": {t: dict(r) for t, r in state["rows"].items()}}
    engine.engine(key.split(":", 1)[0]).prune(cut)  # no marks: every cut made now
    kept["rows"] = cut["rows"]
    raw = key.encode() + orjson.dumps(kept, option=orjson.OPT_SORT_KEYS)
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest())


def states_digest(engine: FeatureEngine, states: Iterable[tuple[str, EntityState | None]]) -> int:
    total = 0
    for key, state in states:
        if state is not None:
            total = (total + state_hash(engine, key, state)) % 2**64
    return total


def computed_state(engine: FeatureEngine, key: str, stream: Iterable[RegionalChange]) -> Any:
    """The entity's state from its changes, applied by the feature engine alone."""
    entity = engine.engine(key.split(":", 1)[0])
    state = None
    for change in stream:
        state, _changed = entity.apply(state, change)
    return state


async def bulk_build(folder: Path, load: Load, engine: FeatureEngine) -> dict[str, Any]:
    """Write the load's final states straight to a worker's folder and changelog:
    each entity's changes applied by the worker's feature engine, its vector
    written as the worker writes it (``wrev``/``until`` in its record: the cache
    holds it), pruned and stored as a checkpoint stores it (``store_state`` through
    ``ChangelogWriter`` into DiskChangelog: the changelog file, then the partition's
    database with the offset of the last record). No batching, packs, cache or
    ledger: what makes it fast is that each state is built once, alone."""
    local = open_states(folder / "state", engine)
    changelog = DiskChangelog(local, folder / "changelog.log")
    now_ms = load.now_ms
    started = time.perf_counter()
    pending: dict[int, Delivery] = {}
    for key in load.entity_keys():
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
    states' cache): changes/s of each; its RSS after them."""
    clock = Clock()
    now_s = load.now_ms / 1000
    gc.collect()
    base = rss_mb()
    local = open_states(folder / "state", engine)
    changelog = DiskChangelog(local, folder / "changelog.log", store_offsets(local))
    runtime, _cache = make_runtime(
        clock, now_s, changelog, engine, checkpoint_s, store=local, memory_bytes=budget
    )
    runtime.resumed(list(range(PARTITIONS)))
    offsets = dict.fromkeys(range(PARTITIONS), 0)
    found: dict[str, Any] = {}
    peak_cache = 0.0
    for n, pattern in enumerate(PATTERNS):
        stream = list(pack_changes(pattern_changes(load, n)))
        loads = runtime.live.loads
        seconds, peak = await apply_messages(runtime, clock, stream, offsets)
        found[f"{pattern}_changes_per_s"] = round(2 * count / seconds)
        found[f"{pattern}_loads"] = runtime.live.loads - loads
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


async def load_bulk(
    users: int, events: int, seed: int, now_s: float, checkpoint_s: float, memory_mb: float
) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="scale-bulk-", dir=os.environ.get("SCALE_DIR")))
    try:
        return await _load_bulk(folder, users, events, seed, now_s, checkpoint_s, memory_mb)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


async def _load_bulk(
    folder: Path,
    users: int,
    events: int,
    seed: int,
    now_s: float,
    checkpoint_s: float,
    memory_mb: float,
) -> dict[str, Any]:
    """Build the state in bulk, check it, then measure a worker over it: the access
    patterns' changes/s and its RSS, a kill -9 during load and its restart, and the
    folder's disk lost and rebuilt from the changelog."""
    load = Load(users, events, int(now_s * 1000), seed)
    engine = FeatureEngine(settings().entities)
    budget = int(memory_mb * 2**20)
    built = await bulk_build(folder, load, engine)
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
    result.update(rebuild_bulk(folder, engine))
    return result


# -- the runs ---------------------------------------------------------------------------------


def child(
    mode: str,
    users: int,
    events: int,
    seed: int,
    now_s: float,
    checkpoint_s: float,
    memory_mb: float,
    out: Any,
    profile: str | None = None,
) -> None:
    if mode == "memory":
        result = asyncio.run(load_memory(users, events, seed, now_s, checkpoint_s))
    elif mode == "bulk":
        result = asyncio.run(load_bulk(users, events, seed, now_s, checkpoint_s, memory_mb))
    else:
        result = asyncio.run(
            load_disk(users, events, seed, now_s, checkpoint_s, memory_mb, profile)
        )
    result["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    out.send(result)


def run_size(
    mode: str,
    users: int,
    events: int,
    seed: int,
    now_s: float,
    checkpoint_s: float,
    memory_mb: float,
    profile: str | None = None,
) -> dict[str, Any]:
    """One size and mode in a fresh process (spawned: its memory is the measurement)."""
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(
        target=child,
        args=(mode, users, events, seed, now_s, checkpoint_s, memory_mb, send, profile),
    )
    process.start()
    send.close()
    try:
        result: dict[str, Any] = receive.recv()
    except EOFError:
        process.join()
        raise RuntimeError(
            f"the {users}-user {mode} run died (exit code {process.exitcode})"
        ) from None
    process.join()
    return result


COLUMNS = (
    ("users", "users"),
    ("changes", "changes"),
    ("changes_per_s", "changes/s"),
    ("rss_mb", "RSS MB"),
    ("state_mb", "state MB"),
    ("kb_per_user", "KB/user"),
    ("bytes_per_row", "B/row"),
    ("checkpoint_s", "checkpoint s"),
    ("serialized_mb", "changelog MB"),
    ("recovery_s", "recovery s"),
    ("rewritten", "rewritten after"),
)

DISK_COLUMNS = (
    ("users", "users"),
    ("changes", "changes"),
    ("changes_per_s", "changes/s"),
    ("rss_mb", "RSS MB"),
    ("state_mb", "state MB"),
    ("kb_per_user", "KB/user"),
    ("checkpoint_s", "checkpoint s"),
    ("serialized_mb", "changelog MB"),
    ("log_mb", "log MB"),
    ("store_open_mb", "store MB open"),
    ("store_mb", "store MB"),
    ("store_ratio", "store/changelog"),
    ("peak_cache_mb", "peak cache MB"),
    ("loads", "loads"),
    ("evictions", "evictions"),
    ("recovery_s", "recovery s"),
    ("renew_s", "renew s"),
    ("rewritten", "rewritten after"),
    ("rebuild_s", "rebuild s"),
    ("recovered_equal", "recovered equal"),
)

RATIO_COLUMNS = (
    ("changes_per_s", "changes/s"),
    ("rss_mb", "RSS"),
    ("state_mb", "state MB"),
    ("checkpoint_s", "checkpoint s"),
    ("recovery_s", "recovery s"),
)


BULK_COLUMNS = (
    ("users", "users"),
    ("changes", "changes built"),
    ("build_s", "build s"),
    ("build_changes_per_s", "build changes/s"),
    ("serialized_mb", "changelog MB"),
    ("store_mb", "store MB"),
    ("store_ratio", "store/changelog"),
    ("round_changes_per_s", "round changes/s"),
    ("uniform_changes_per_s", "uniform changes/s"),
    ("hot_changes_per_s", "hot changes/s"),
    ("rss_mb", "RSS MB"),
    ("worker_rss_mb", "worker RSS MB"),
    ("peak_cache_mb", "peak cache MB"),
    ("kill_tail_records", "tail records"),
    ("kill_tail_s", "tail s"),
    ("kill_recovery_s", "kill -9 to fresh write s"),
    ("kill_equal", "exact after kill"),
    ("rebuild_s", "lost-disk rebuild s"),
    ("rebuilt_equal", "rebuilt exact"),
    ("sample_equal", "built = recomputed"),
)

BULK_RATIOS = (
    ("round_changes_per_s", "round changes/s"),
    ("uniform_changes_per_s", "uniform changes/s"),
    ("hot_changes_per_s", "hot changes/s"),
    ("rss_mb", "RSS"),
    ("worker_rss_mb", "worker RSS"),
    ("kill_recovery_s", "kill -9 to fresh write"),
    ("rebuild_s", "lost-disk rebuild"),
)


def print_bulk_ratios(bulk: list[dict[str, Any]]) -> None:
    """Each bulk-built size's figures over the smallest's of its run (one machine)."""
    print("| users | " + " | ".join(f"{t} / smallest's" for _, t in BULK_RATIOS) + " |")
    print("|" + "---|" * (len(BULK_RATIOS) + 1))
    for result in bulk:
        run = [r for r in bulk if r.get("run", 0) == result.get("run", 0)]
        base = min(run, key=lambda r: r["users"])
        cells = [
            _ratio(result[key], base[key]) if key in result and key in base else "-"
            for key, _ in BULK_RATIOS
        ]
        print(f"| {result['users']:,} | " + " | ".join(cells) + " |")


def _cell(value: Any) -> str:
    return str(value) if isinstance(value, bool | str) else f"{value:,}"


def print_table(results: list[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> None:
    print("| " + " | ".join(title for _, title in columns) + " |")
    print("|" + "---|" * len(columns))
    for result in results:
        print("| " + " | ".join(_cell(result.get(key, "-")) for key, _ in columns) + " |")


def print_ratios(results: list[dict[str, Any]]) -> None:
    """Disk mode's figures over memory mode's, per size (one run: one machine)."""
    pairs = _pairs(results)
    if not pairs:
        return
    titles = [title for _, title in RATIO_COLUMNS]
    print("| users | " + " | ".join(titles) + " | rebuild s / memory recovery s | same vectors |")
    print("|" + "---|" * (len(titles) + 3))
    for memory, disk in pairs:
        cells = [_ratio(disk[key], memory[key]) for key, _ in RATIO_COLUMNS]
        cells.append(_ratio(disk["rebuild_s"], memory["recovery_s"]))
        cells.append(str(disk["digest"] == memory["digest"]))
        print(f"| {memory['users']:,} | " + " | ".join(cells) + " |")


def _ratio(disk: float, memory: float) -> str:
    return f"{disk / memory:.3g}x" if memory else "-"


def _pairs(results: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    memory = {r["users"]: r for r in results if r["mode"] == "memory"}
    return [
        (memory[r["users"]], r) for r in results if r["mode"] == "disk" and r["users"] in memory
    ]


BULK_LINES = {  # panel -> (figure, label, style) of the bulk-built runs
    "rss_mb": (("rss_mb", "bulk-built state on disk: after the new changes", "-."),),
    "changes_per_s": tuple(
        (f"{p}_changes_per_s", f"bulk-built state on disk: new changes, {p} access", style)
        for p, style in zip(PATTERNS, (":", "-.", "--"), strict=True)
    ),
    "recovery_s": (
        ("kill_recovery_s", "bulk-built state on disk: kill -9 during load", "-."),
        ("rebuild_s", "bulk-built state on disk: a lost disk rebuilt from the changelog", ":"),
    ),
}


def _draw(axis: Any, found: list[dict[str, Any]], key: str, label: str, **style: Any) -> None:
    """A line of ``key`` against users per run (``run``: the --replot file it came
    from), in one colour (``style``'s, given), in the legend once."""
    for run in sorted({r.get("run", 0) for r in found}):
        points = sorted((r["users"], r[key]) for r in found if r.get("run", 0) == run and key in r)
        if points:
            users, values = zip(*points, strict=True)
            axis.plot(users, values, label=label, **style)
            label = "_"  # matplotlib leaves labels starting with _ out of the legend


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Memory, changes/s, checkpoint and recovery time against users (log scale), a
    line per mode and run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    panels = (
        ("rss_mb", "worker RSS (MB)"),
        ("changes_per_s", "apply path (changes/s, one core)"),
        ("checkpoint_s", "checkpoint time over the load (s)"),
        ("recovery_s", "recovery (s): until fresh writes are served"),
    )
    lines: list[tuple[str, str, str, str]] = []  # mode, key, label, style
    for mode in MODES:
        found = [r for r in results if r["mode"] == mode]
        if not found:
            continue
        label = (
            "edgefeed, states in memory"
            if mode == "memory"
            else f"edgefeed, states on disk ({found[0]['memory_mb']:g} MB budget)"
        )
        lines.append((mode, "", label, "-"))
    colours: dict[str, str] = {}

    def draw(axis: Any, found: list[dict[str, Any]], key: str, label: str, **style: Any) -> None:
        colour = colours.setdefault(label, f"C{len(colours) % 10}")
        _draw(axis, found, key, label, color=colour, **style)

    bulk = [r for r in results if r["mode"] == "bulk"]
    for axis, (key, title) in zip(axes.flat, panels, strict=True):
        for mode, _, label, style in lines:
            found = [r for r in results if r["mode"] == mode]
            draw(axis, found, key, label, linestyle=style, marker="o")
            if key == "recovery_s" and mode == "disk":
                rebuilt = "states on disk: a lost disk rebuilt from the changelog"
                draw(axis, found, "rebuild_s", rebuilt, linestyle="--", marker="x")
        for field, label, style in BULK_LINES.get(key, ()):
            draw(axis, bulk, field, label, linestyle=style, marker="s")
        axis.set_xscale("log")
        if key != "changes_per_s":
            axis.set_yscale("log")
        axis.set_title(title)
        axis.set_xlabel("users in the region")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize="small")
    runs = len({r.get("run", 0) for r in results})
    each = f"; {runs} runs, a line each" if runs > 1 else ""
    figure.suptitle(f"A regional worker's state against its entities ({platform.machine()}{each})")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, action="append", help="users (repeatable)")
    parser.add_argument("--events", type=int, default=20, help="events per user")
    parser.add_argument("--seed", type=int, default=36)
    parser.add_argument("--mode", choices=(*MODES, "both"), default="both")
    parser.add_argument(
        "--memory-mb",
        type=float,
        help=f"disk mode: the states' memory budget (default {MEMORY_MB:g}; "
        f"{SMOKE_MEMORY_MB:g} with --smoke)",
    )
    parser.add_argument("--smoke", action="store_true", help="500 users: checks it works")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    parser.add_argument("--plot", type=Path, help="write the plot (PNG) here")
    parser.add_argument(
        "--profile",
        help="disk mode: cProfile the apply path and write its stats here (one size)",
    )
    parser.add_argument(
        "--bulk",
        type=int,
        action="append",
        default=[],
        help="users of a bulk-built state to measure a worker over (repeatable)",
    )
    parser.add_argument("--save", type=Path, help="also write the results (JSON) here")
    parser.add_argument(
        "--replot",
        type=Path,
        action="append",
        help="print and plot the results --save wrote (repeatable), running nothing",
    )
    args = parser.parse_args()
    sizes = [500] if args.smoke else (args.users or ([] if args.bulk else [10_000, 100_000]))
    modes = MODES if args.mode == "both" else (args.mode,)
    memory_mb = args.memory_mb or (SMOKE_MEMORY_MB if args.smoke else MEMORY_MB)
    # --smoke: a checkpoint every 20 messages, so that its few changes still see
    # several (states made clean, evicted and read back during the load).
    checkpoint_s = 0.1 if args.smoke else 1.0
    now_s = time.time()  # one read time for every run: their vectors compare
    if args.replot:
        results = [
            {**r, "run": n}
            for n, path in enumerate(args.replot)
            for r in json.loads(path.read_text())
        ]
        sizes, args.bulk = [], []
        memory_mb = next((r["memory_mb"] for r in results if "memory_mb" in r), memory_mb)
    else:
        results = []
    results += [
        run_size(mode, users, args.events, args.seed, now_s, checkpoint_s, memory_mb, args.profile)
        for users in sizes
        for mode in modes
    ]
    results += [
        run_size("bulk", users, args.events, args.seed, now_s, checkpoint_s, memory_mb)
        for users in args.bulk
    ]
    if args.save is not None:
        args.save.write_text(json.dumps(results, indent=2))
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(
            f"machine: {platform.machine()}, {os.cpu_count()} cores, "
            f"Python {platform.python_version()}; {args.events} events per user, "
            f"{PARTITIONS} partitions, packs of {CHANGES_PER_MESSAGE} changes"
        )
        memory = [r for r in results if r["mode"] == "memory"]
        disk = [r for r in results if r["mode"] == "disk"]
        if memory:
            print("\nstates in memory:\n")
            print_table(memory, COLUMNS)
        if disk:
            print(f"\nstates on disk ({memory_mb:g} MB budget):\n")
            print_table(disk, DISK_COLUMNS)
        if memory and disk:
            print("\non disk / in memory:\n")
            print_ratios(results)
        bulk = [r for r in results if r["mode"] == "bulk"]
        if bulk:
            print(f"\nbulk-built states on disk ({memory_mb:g} MB budget):\n")
            print_table(bulk, BULK_COLUMNS)
            print("\nagainst the smallest bulk-built size:\n")
            print_bulk_ratios(bulk)
    if args.plot is not None:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
