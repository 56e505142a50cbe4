"""benchmarks/scale.py's regional worker: the runtime with in-memory ports, a
changelog whose broker is a file, the load applied message by message, digests."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import os
import struct
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from prometheus_client import CollectorRegistry

from edge_cache import Delete, Upsert
from edgefeed.settings import EdgefeedSettings, load_settings
from pipeline.features import EntityState, FeatureEngine
from pipeline.gctune import GcTuner
from pipeline.localstore import ChangelogWriter, LocalStates
from pipeline.metrics import PipelineMetrics
from pipeline.runtime import BatchPolicy, Delivery, RegionRuntime
from pipeline.runtime.region import ChangelogSink
from pipeline.statestore import checkpoint_key, store_state
from scalebench.load import (
    PARTITIONS,
    messages,
    partition_of,
)

ROOT = Path(__file__).resolve().parents[2]
MESSAGE_S = 0.005  # the fake clock's step per message: 20 ms batches hold ~4 messages
REBUILD_BATCH = 10_000  # records per records_applied when rebuilding a lost disk
# A changelog file's record: partition, key length, value length (NONE: a deletion).
FRAME = struct.Struct("<BII")
NONE = 0xFFFFFFFF
FRESH_USER = 1  # the existing user whose new change a restarted disk worker serves
FRESH_LSN = 10**12  # after every change of the load
DIGEST_USERS = 100_000  # up to this size, the bulk state's full digest (else a sample)


@dataclass(frozen=True, slots=True)
class Run:
    """One size in one mode, as the command line asks for it (``jobs``: the bulk
    build's processes; ``profile``: the disk mode's cProfile output)."""

    mode: str
    users: int
    events: int
    seed: int
    now_s: float
    checkpoint_s: float
    memory_mb: float
    profile: str | None = None
    jobs: int = 1


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
