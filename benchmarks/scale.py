"""Benchmark of a regional worker's state against the number of entities (issue 36).

For each size, in a process of its own (so that its resident memory is its own)
and with the worker's garbage-collector tuning (pipeline.gctune, once a second):
users with ``--events`` events each over the last day (every event two regional
changes: its user's and its item's; one item per 10 users), interleaved in time
as a stream is, applied through the regional worker's runtime
(pipeline.runtime.RegionRuntime: packs decoded, changes applied, vectors and
schedules computed per batch, states to the changelog per checkpoint) with
in-memory ports: the cache and the changelog cost no I/O here, so what is
measured is the worker's own CPU and memory. Then the worker's recovery: the
changelog's records, serialized as on the broker, decoded and rebuilt into
working states (``pipeline.statestore.rebuild_states``), and the vectors it
writes at once after it (none, when every recovered state is the one whose
vector the cache holds: the rest are renewed when their schedules run out).

Reported per size: changes/s of the apply path, resident memory (RSS) after
the load, the state's part of it (RSS less that of the empty worker) per user
and per stored row, checkpoint seconds, the changelog's
serialized size, recovery seconds (decode + rebuild) and the vectors
rewritten at once after it. The figures, against the number of users, are what issue 36's
state store must keep flat.

    .venv/bin/python benchmarks/scale.py                       # 10k and 100k users
    .venv/bin/python benchmarks/scale.py --users 1000000       # one size
    .venv/bin/python benchmarks/scale.py --smoke               # 500 users (the test suite)
    .venv/bin/python benchmarks/scale.py --plot docs/img/scale.png
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import multiprocessing
import os
import platform
import random
import resource
import struct
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

# This folder holds files named like the packages they measure: not on the path.
_HERE = str(Path(__file__).resolve().parent)
sys.path[:] = [p for p in sys.path if p not in ("", _HERE)]

import orjson  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

from edge_cache import Delete, Upsert  # noqa: E402
from edgefeed.settings import load_settings  # noqa: E402
from pipeline.features import EntityState, FeatureEngine  # noqa: E402
from pipeline.gctune import GcTuner  # noqa: E402
from pipeline.messages import RegionalChange, encode_packs  # noqa: E402
from pipeline.metrics import PipelineMetrics  # noqa: E402
from pipeline.runtime import BatchPolicy, Delivery, RegionRuntime  # noqa: E402
from pipeline.statestore import rebuild_states, store_state  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DAY_MS = 86_400_000
PARTITIONS = 4
CHANGES_PER_MESSAGE = 100  # the router's packs under load
MESSAGE_S = 0.005  # the fake clock's step per message: 20 ms batches hold ~4 messages
KINDS = ("view",) * 6 + ("click",) * 2 + ("add_to_cart", "purchase")


def _page_kb() -> int:
    return os.sysconf("SC_PAGE_SIZE") // 1024


def rss_mb() -> float:
    """This process's resident memory now (not its peak)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * _page_kb() / 1024


class Cache:
    """CacheSink that keeps nothing: the vectors are computed, not stored."""

    def __init__(self) -> None:
        self.ops = 0

    async def write(
        self, ops: Sequence[Upsert | Delete], now_us: int, *, freshness: bool = True
    ) -> Sequence[bool]:
        self.ops += len(ops)
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


def changes(users: int, events: int, now_ms: int, seed: int) -> Iterator[RegionalChange]:
    """The load: round r gives every user its r-th event, at a time inside the r-th
    slice of the last day (a stream interleaves its entities)."""
    rng = random.Random(seed)
    items = max(1, users // 10)
    slice_ms = DAY_MS // events
    lsn = 1_000
    event_id = 0
    for r in range(events):
        base = now_ms - DAY_MS + r * slice_ms
        for user in range(1, users + 1):
            event_id += 1
            lsn += 1
            at = base + rng.randrange(slice_ms)
            item = rng.randrange(1, items + 1)
            row = {
                "event_id": event_id,
                "user_id": user,
                "item_id": item,
                "category_id": item % 20,
                "price": round(rng.uniform(1, 200), 2),
                "home_region": "eu-west",
                "kind": rng.choice(KINDS),
                "occurred_at": at * 1000,
            }
            pk = str(event_id)
            yield RegionalChange("public.events", "c", lsn, 0, at, "user", user, pk, row)
            yield RegionalChange("public.events", "c", lsn, 1, at, "item", item, pk, row)


def messages(users: int, events: int, now_ms: int, seed: int) -> Iterator[tuple[int, list[bytes]]]:
    """(partition, packs) by CHANGES_PER_MESSAGE changes, per partition as the router's
    key partitioning sends them."""
    pending: dict[int, list[bytes]] = {p: [] for p in range(PARTITIONS)}
    for change in changes(users, events, now_ms, seed):
        partition = hash(change.key) % PARTITIONS
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


def make_runtime(clock: Clock, now_s: float) -> tuple[RegionRuntime, Cache, Changelog]:
    settings = load_settings(ROOT / "examples" / "edgefeed.yaml", env={})
    cache, changelog = Cache(), Changelog()
    runtime = RegionRuntime(
        region="eu-west",
        app_id="scale",
        engine=FeatureEngine(settings.entities),
        partition_of=lambda key: hash(key) % PARTITIONS,
        cache=cache,
        changelog=changelog,
        dead_letters=DeadLetters(),
        acker=Acker(),
        metrics=PipelineMetrics.create(CollectorRegistry()),
        policy=BatchPolicy(5000, 0.02, 2.0),
        checkpoint_interval_s=1.0,
        clock=clock,
        wall=lambda: now_s + (clock.now - 1_000.0),
    )
    return runtime, cache, changelog


async def load(users: int, events: int, seed: int) -> dict[str, Any]:
    """Apply the load, then recover from the changelog; the figures."""
    now_s = time.time()
    clock = Clock()
    runtime, cache, changelog = make_runtime(clock, now_s)
    gc.collect()
    base = rss_mb()  # the interpreter, the libraries, an empty worker
    offsets = dict.fromkeys(range(PARTITIONS), 0)
    applied_s = 0.0
    # The worker's collector tuning (pipeline.gctune), once per second of its clock,
    # as the region app's housekeeping task runs it.
    tuner = GcTuner()
    next_tune = clock.now + 1.0
    for partition, packs in messages(users, events, int(now_s * 1000), seed):
        for body in packs:
            offsets[partition] += 1
            delivery = Delivery(partition, offsets[partition])
            started = time.perf_counter()
            await runtime.on_message(delivery, body)
            clock.now += MESSAGE_S
            await runtime.tick()
            if clock.now >= next_tune:
                tuner.tick()
                next_tune = clock.now + 1.0
            task = runtime._checkpoint_task
            if task is not None and not task.done():
                await task
            applied_s += time.perf_counter() - started
    started = time.perf_counter()
    await runtime.flush(lane=True)
    clock.now += 2.0
    await runtime.tick()
    if runtime._checkpoint_task is not None:
        await runtime._checkpoint_task
    applied_s += time.perf_counter() - started
    changes_n = 2 * users * events
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
        recovery = await recover(path, now_s, at_ms, digest)
    finally:
        os.unlink(path)
    return {
        "users": users,
        "events_per_user": events,
        "changes": changes_n,
        "dead_lettered": dead,
        "entities": entities,
        "rows": rows,
        "apply_s": round(applied_s, 2),
        "changes_per_s": round(changes_n / applied_s),
        "rss_mb": round(rss),
        "state_mb": round(rss - base),
        "kb_per_user": round((rss - base) * 1024 / users, 1),
        "bytes_per_row": round((rss - base) * 1024 * 1024 / max(rows, 1)),
        "checkpoint_s": round(checkpoint_s, 2),
        "changelog_records": records,
        "serialized_mb": round(serialized / 1e6, 1),
        **recovery,
    }


def vectors_digest(runtime: RegionRuntime, at_ms: int) -> int:
    """An order-independent digest of every entity's vector read at ``at_ms``."""
    total = 0
    for key, state in runtime.live.items():
        vector = runtime.engine.engine(key.split(":", 1)[0]).vector(state, at_ms)
        raw = key.encode() + orjson.dumps(vector, option=orjson.OPT_SORT_KEYS)
        total = (total + int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest())) % 2**64
    return total


def read_log(path: str) -> Iterator[tuple[str, Any]]:
    """The changelog's records from the file ``load`` wrote, decoded."""
    with open(path, "rb") as log:
        while header := log.read(8):
            key_len, value_len = struct.unpack("<II", header)
            key = log.read(key_len).decode()
            yield key, orjson.loads(log.read(value_len))


async def recover(path: str, now_s: float, at_ms: int, digest: int) -> dict[str, Any]:
    """A restarted worker's recovery from the changelog's bytes: decode, rebuild the
    working states, then write what is due at once (renewals)."""
    started = time.perf_counter()
    states = rebuild_states(read_log(path), lambda key: True)
    decoded_s = time.perf_counter() - started
    clock = Clock()
    runtime, cache, _changelog = make_runtime(clock, now_s)
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


def child(users: int, events: int, seed: int, out: Any) -> None:
    result = asyncio.run(load(users, events, seed))
    result["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    out.send(result)


def run_size(users: int, events: int, seed: int) -> dict[str, Any]:
    """One size in a fresh process (spawned: its memory is the measurement)."""
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=child, args=(users, events, seed, send))
    process.start()
    send.close()
    try:
        result: dict[str, Any] = receive.recv()
    except EOFError:
        process.join()
        raise RuntimeError(f"the {users}-user run died (exit code {process.exitcode})") from None
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


def print_table(results: list[dict[str, Any]]) -> None:
    print("| " + " | ".join(title for _, title in COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for result in results:
        print("| " + " | ".join(f"{result[key]:,}" for key, _ in COLUMNS) + " |")


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Memory, changes/s, checkpoint and recovery time against users (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    users = [r["users"] for r in results]
    figure, axes = plt.subplots(2, 2, figsize=(10, 7))
    panels = (
        ("rss_mb", "worker RSS (MB)"),
        ("changes_per_s", "apply path (changes/s, one core)"),
        ("checkpoint_s", "checkpoint time over the load (s)"),
        ("recovery_s", "recovery: decode + rebuild (s)"),
    )
    for axis, (key, title) in zip(axes.flat, panels, strict=True):
        axis.plot(users, [r[key] for r in results], marker="o", label="edgefeed (in memory)")
        axis.set_xscale("log")
        if key != "changes_per_s":
            axis.set_yscale("log")
        axis.set_title(title)
        axis.set_xlabel("users in the region")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend()
    figure.suptitle(f"A regional worker's state against its entities ({platform.machine()})")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, action="append", help="users (repeatable)")
    parser.add_argument("--events", type=int, default=20, help="events per user")
    parser.add_argument("--seed", type=int, default=36)
    parser.add_argument("--smoke", action="store_true", help="500 users: checks it works")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    parser.add_argument("--plot", type=Path, help="write the plot (PNG) here")
    args = parser.parse_args()
    sizes = [500] if args.smoke else (args.users or [10_000, 100_000])
    results = [run_size(users, args.events, args.seed) for users in sizes]
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(
            f"machine: {platform.machine()}, {os.cpu_count()} cores, "
            f"Python {platform.python_version()}; {args.events} events per user, "
            f"{PARTITIONS} partitions, packs of {CHANGES_PER_MESSAGE} changes"
        )
        print_table(results)
    if args.plot is not None:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
