"""Feature lookup benchmark: edgefeed's FeatureClient against plain redis-py and Feast.

Measured in one run, one caller at a time, on one local redis-server (started
here on a free loopback port, stopped at the end):

* plain redis-py: the floor. A packed float32 vector per entity, read with GET
  (1 entity) or one MGET (100 entities) and turned into a NumPy matrix.
* edgefeed: ``FeatureClient.get(...).to_numpy()`` / ``AsyncFeatureClient``,
  near cache off and on (on: every read is a near-cache hit).
* edgefeed, scheduled: the same 50 features in an entity type whose windows are
  read as of the read time (``slots=4``: each value carries the next 4 vectors
  and when they take over; half the entities read a scheduled one). Its values
  are 4.5x larger than the floor's; the floor stays what a plain application
  would store (one vector, no time). A second floor, "same-bytes", MGETs the
  scheduled values themselves without decoding: what their size alone costs.
* Feast: ``FeatureStore.get_online_features(...).to_dict()`` on a Redis online
  store holding the same values. Feast pins redis<8 (edgefeed uses redis 8), so
  it runs in its own virtual environment, driven as a subprocess; the interpreter
  is ``--feast-python``, else ``$EDGEFEED_FEAST_PYTHON``, else ``.venv/feast``.

Usage::

    .venv/bin/python benchmarks/lookup.py            # full run (~1 min)
    .venv/bin/python benchmarks/lookup.py --smoke    # a few seconds, checks values
    .venv/bin/python benchmarks/lookup.py --json out.json

Every case first checks that its values equal the written ones.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import redis
import redis.asyncio as aioredis

from edge_cache import (
    AsyncFeatureClient,
    FeatureClient,
    FeatureSchema,
    FeatureWriter,
    NearCacheConfig,
    Position,
    RegionSettings,
    Schedule,
    Upsert,
)

ROOT = Path(__file__).resolve().parent.parent
N_ENTITIES = 1000
WRITE_CHUNK = 10_000  # entities per write while filling the Redis
PATCH_US = 1_800_000_000  # the scheduled values' first patch: 30 min from the fill
N_FEATURES = 50
SIZES = (1, 100)
SLOTS = 4  # pipeline.features.SCHEDULE_SLOTS
TIMED_MAX = 1_100_000  # scheduled values (4.5x larger) held for at most this many entities

FEAST_DRIVER = r"""
import json, sys, tempfile, time, os
from datetime import datetime, timedelta, timezone
import numpy as np
import pandas as pd
from feast import Entity, FeatureStore, FeatureView, Field, FileSource, ValueType
from feast.types import Float32, Int64

args = json.loads(sys.argv[1])
data = np.load(args["data"])
n, k = data.shape
repo = tempfile.mkdtemp(prefix="edgefeed-feast-")
with open(os.path.join(repo, "feature_store.yaml"), "w") as f:
    f.write(
        "project: edgefeed_bench\n"
        f"registry: {repo}/registry.db\n"
        "provider: local\n"
        "online_store:\n  type: redis\n"
        f"  connection_string: \"127.0.0.1:{args['port']}\"\n"
        "offline_store:\n  type: file\n"
        "entity_key_serialization_version: 3\n"
    )
now = datetime.now(timezone.utc)
frame = pd.DataFrame(data, columns=[f"f{i}" for i in range(k)])
frame.insert(0, "user_id", np.arange(n, dtype=np.int64))
frame["event_timestamp"] = now
parquet = os.path.join(repo, "users.parquet")
frame.to_parquet(parquet)
user = Entity(name="user", join_keys=["user_id"], value_type=ValueType.INT64)
view = FeatureView(
    name="user_features",
    entities=[user],
    ttl=timedelta(days=1),
    schema=[Field(name="user_id", dtype=Int64)]
    + [Field(name=f"f{i}", dtype=Float32) for i in range(k)],
    online=True,
    source=FileSource(path=parquet, timestamp_field="event_timestamp"),
)
store = FeatureStore(repo_path=repo)
store.apply([user, view])
store.write_to_online_store("user_features", frame)
refs = [f"user_features:f{i}" for i in range(k)]
out = {"version": __import__("feast").__version__, "cases": {}}
for size, batches in args["batches"].items():
    rows_of = [[{"user_id": int(i)} for i in batch] for batch in batches]
    got = store.get_online_features(features=refs, entity_rows=rows_of[0]).to_dict()
    first = range(len(batches[0]))
    check = np.array([[got[f"f{i}"][r] for i in range(k)] for r in first], np.float32)
    ok = bool(np.array_equal(check, data[batches[0]]))
    for rows in rows_of[: args["warmup"]]:
        store.get_online_features(features=refs, entity_rows=rows).to_dict()
    times = []
    start = time.perf_counter()
    i = 0
    while True:
        rows = rows_of[i % len(rows_of)]
        t0 = time.perf_counter_ns()
        store.get_online_features(features=refs, entity_rows=rows).to_dict()
        times.append(time.perf_counter_ns() - t0)
        i += 1
        if i >= args["min_calls"] and time.perf_counter() - start >= args["seconds"]:
            break
    wall = time.perf_counter() - start
    out["cases"][size] = {"times_ns": times, "wall_s": wall, "values_ok": ok}
print(json.dumps(out))
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """A throw-away redis-server on a free loopback port."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.dir = tempfile.mkdtemp(prefix="edgefeed-bench-redis-")
        self.port = free_port()
        self.proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                with redis.Redis(port=self.port, socket_timeout=1) as client:
                    client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def summarize(times_ns: list[int], wall_s: float) -> dict[str, float]:
    arr = np.asarray(times_ns, dtype=np.float64) / 1000.0
    return {
        "calls": len(times_ns),
        "p50_us": float(np.percentile(arr, 50)),
        "p99_us": float(np.percentile(arr, 99)),
        "calls_per_s": len(times_ns) / wall_s,
    }


@dataclass
class Case:
    """One measured case; its calls are spread over interleaved rounds."""

    name: str
    call: Callable[[list[int]], Any]
    is_async: bool
    batches: list[list[int]]
    times: list[int] = field(default_factory=list)
    wall_s: float = 0.0
    next: int = 0

    async def run(self, seconds: float, min_calls: int, record: bool = True) -> None:
        perf = time.perf_counter_ns
        batches = self.batches
        start = time.perf_counter()
        count = 0
        while True:
            batch = batches[self.next % len(batches)]
            self.next += 1
            t0 = perf()
            if self.is_async:
                await self.call(batch)
            else:
                self.call(batch)
            if record:
                self.times.append(perf() - t0)
            count += 1
            if count >= min_calls and time.perf_counter() - start >= seconds:
                break
        if record:
            self.wall_s += time.perf_counter() - start


async def measure(cases: list[Case], seconds: float, min_calls: int, rounds: int) -> None:
    """Warm every case up, then run them in interleaved rounds (rotating the order), so a
    change in the machine's load hits every case alike instead of whichever ran then."""
    for case in cases:
        await case.run(0.0, min_calls // 2, record=False)
    for round_ in range(rounds):
        shift = round_ % len(cases)
        for case in cases[shift:] + cases[:shift]:
            gc.collect()
            await case.run(seconds / rounds, max(1, min_calls // rounds))


def feast_python(explicit: str | None) -> str | None:
    candidates = [
        explicit,
        os.environ.get("EDGEFEED_FEAST_PYTHON"),
        str(ROOT / ".venv/feast/bin/python"),
    ]
    for candidate in candidates:
        if candidate and Path(candidate).exists():
            return candidate
    return None


def run_feast(
    python: str,
    port: int,
    data: np.ndarray,
    batches: dict[int, list[list[int]]],
    seconds: float,
    min_calls: int,
    warmup: int,
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="edgefeed-bench-") as tmp:
        path = os.path.join(tmp, "data.npy")
        np.save(path, data)
        args = {
            "data": path,
            "port": port,
            "seconds": seconds,
            "min_calls": min_calls,
            "warmup": warmup,
            "batches": {str(k): v for k, v in batches.items()},
        }
        done = subprocess.run(
            [python, "-c", FEAST_DRIVER, json.dumps(args)],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    if done.returncode != 0:
        raise RuntimeError(f"the Feast driver failed:\n{done.stderr[-2000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def fill_vectors(
    writer: FeatureWriter, schema: FeatureSchema, data: np.ndarray, now: float
) -> None:
    """Write row ``i`` of ``data`` as entity ``i``'s vector, as ``writer.write`` of
    an Upsert each would store it, at millions of entities in seconds.

    With the writer's clock fixed at ``now``, every value is the same bytes but its
    features: one value is encoded by the writer, and the others are that value
    with their own float32 row spliced in where its row sits, then ``MSET``. The
    first and last value of every chunk are checked against the writer's encoding
    (a layout where the splice is not exact fails loudly), and the benchmark's own
    checks read every case's values back.
    """

    def encoded(i: int) -> bytes:
        values = dict(zip(schema.names, data[i].tolist(), strict=True))
        return writer.core.encode(Upsert(schema.entity, i, values, Position(1), now))[1]

    template = encoded(0)
    row_bytes = data[0].tobytes()
    offset = template.find(row_bytes)
    if offset < 0 or template.find(row_bytes, offset + 1) >= 0:
        raise AssertionError("the vector's features are not one float32 run in its value")
    for start in range(0, len(data), WRITE_CHUNK):
        chunk = data[start : start + WRITE_CHUNK]
        values = np.tile(np.frombuffer(template, np.uint8), (len(chunk), 1))
        values[:, offset : offset + len(row_bytes)] = chunk.view(np.uint8)
        for row in (0, len(chunk) - 1):
            if values[row].tobytes() != encoded(start + row):
                raise AssertionError(f"entity {start + row}: spliced value != the writer's")
        keys = [writer.core.layout.key(schema.entity, i) for i in range(start, start + len(chunk))]
        writer.client.mset(dict(zip(keys, (v.tobytes() for v in values), strict=True)))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--smoke", action="store_true", help="a few seconds: tiny runs, same checks"
    )
    parser.add_argument("--seconds", type=float, default=2.0, help="measuring time per case")
    parser.add_argument("--feast-python", help="interpreter of a venv with feast[redis] installed")
    parser.add_argument("--no-feast", action="store_true", help="skip the Feast comparison")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--entities",
        type=int,
        help=f"entities the Redis holds, reads drawn from all (default {N_ENTITIES}; "
        "issue 36: a region's millions)",
    )
    parser.add_argument(
        "--timed-entities",
        type=int,
        help=f"entities with scheduled values (default: --entities, at most {TIMED_MAX:,}: "
        "each value is 4.5x the plain vector, so 11M would not fit this machine's memory)",
    )
    args = parser.parse_args(argv)
    seconds, min_calls, warmup = (0.05, 20, 5) if args.smoke else (args.seconds, 200, 200)
    rounds = 2 if args.smoke else 8
    n_entities = args.entities or (200 if args.smoke else N_ENTITIES)
    n_timed = min(n_entities, args.timed_entities or TIMED_MAX)

    rng = np.random.default_rng(42)
    data = rng.standard_normal((n_entities, N_FEATURES)).astype(np.float32)
    batches = {
        size: [sorted(rng.choice(n_entities, size, replace=False).tolist()) for _ in range(64)]
        for size in SIZES
    }
    timed_batches = (
        batches
        if n_timed == n_entities
        else {
            size: [sorted(rng.choice(n_timed, size, replace=False).tolist()) for _ in range(64)]
            for size in SIZES
        }
    )
    schema = FeatureSchema.of("user", [f"f{i}" for i in range(N_FEATURES)])
    timed = FeatureSchema.of("timed", [f"f{i}" for i in range(N_FEATURES)], slots=SLOTS)
    server = RedisServer()
    results: dict[str, Any] = {"cases": {}, "checks": {}}
    try:
        region = RegionSettings(name="bench", redis_url=server.url, residency_zone="local")
        now = time.time()
        with FeatureWriter.from_region(region, [schema, timed], clock=lambda: now) as writer:
            fill_started = time.perf_counter()
            writer.publish_schemas()
            fill_vectors(writer, schema, data, now)
            # Scheduled values: odd entities read their first patch (in force since
            # half an hour ago), even ones the vector written (their first patch takes
            # over in half an hour: after the fill, which takes minutes at millions of
            # entities); every slot is used.
            now_us = int(now * 1e6)

            def vector(row: np.ndarray) -> dict[str, float]:
                return dict(zip(timed.names, row.tolist(), strict=True))

            for start in range(0, n_timed, WRITE_CHUNK):
                writer.write(
                    [
                        Upsert(
                            "timed",
                            i,
                            vector(row - 1),
                            Position(1),
                            now,
                            schedule=Schedule(
                                tuple(
                                    (
                                        now_us
                                        + (
                                            k * 3_600_000_000
                                            if k
                                            else (-1 if i % 2 else 1) * PATCH_US
                                        ),
                                        vector(row if k == 0 else row + k),
                                    )
                                    for k in range(SLOTS)
                                ),
                                now_us + SLOTS * 3_600_000_000,
                            ),
                        )
                        for i, row in enumerate(
                            data[start : min(start + WRITE_CHUNK, n_timed)], start
                        )
                    ]
                )
            timed_data = data[:n_timed]
            expected_timed = np.where(
                (np.arange(n_timed) % 2 == 1)[:, None], timed_data, timed_data - 1
            )
        plain = redis.Redis.from_url(server.url)
        for start in range(0, n_entities, WRITE_CHUNK):
            chunk = enumerate(data[start : start + WRITE_CHUNK], start)
            plain.mset({f"plain:{i}": row.tobytes() for i, row in chunk})
        results["fill"] = {
            "entities": n_entities,
            "timed_entities": n_timed,
            "seconds": round(time.perf_counter() - fill_started, 1),
            "redis_used_memory_mb": round(int(plain.info("memory")["used_memory"]) / 2**20, 1),
        }
        print(
            f"filled {n_entities:,} entities ({n_timed:,} with scheduled values) in "
            f"{results['fill']['seconds']} s; Redis holds "
            f"{results['fill']['redis_used_memory_mb']} MB",
            file=sys.stderr,
            flush=True,
        )

        def plain_read(ids: list[int]) -> np.ndarray:
            if len(ids) == 1:
                return np.frombuffer(plain.get(f"plain:{ids[0]}"), np.float32).reshape(1, -1)
            raw = plain.mget([f"plain:{i}" for i in ids])
            return np.frombuffer(b"".join(raw), np.float32).reshape(len(ids), -1)

        timed_size = len(plain.get("ef:{timed:0}") or b"")

        def plain_same_bytes(ids: list[int]) -> np.ndarray:
            """The floor for scheduled values: plain MGET of the same keys and bytes,
            viewed as raw bytes (no decoding): what their size alone costs."""
            raw = plain.mget([f"ef:{{timed:{i}}}" for i in ids])
            return np.frombuffer(b"".join(raw), np.uint8).reshape(len(ids), timed_size)

        aplain = aioredis.Redis.from_url(server.url)

        async def aplain_read(ids: list[int]) -> np.ndarray:
            if len(ids) == 1:
                return np.frombuffer(await aplain.get(f"plain:{ids[0]}"), np.float32).reshape(1, -1)
            raw = await aplain.mget([f"plain:{i}" for i in ids])
            return np.frombuffer(b"".join(raw), np.float32).reshape(len(ids), -1)

        near = NearCacheConfig(max_entries=10_000, ttl_s=3600)
        off = FeatureClient("bench", [region], [schema, timed])
        on = FeatureClient("bench", [region], [schema], near_cache=near)
        deadline = time.monotonic() + 5
        while on.near is not None and not on.near.active and time.monotonic() < deadline:
            time.sleep(0.01)

        def check(name: str, got: np.ndarray, ids: list[int], want: np.ndarray = data) -> None:
            ok = bool(np.array_equal(got, want[ids]))
            results["checks"][name] = ok
            if not ok:
                raise AssertionError(f"{name}: values differ from the written ones")

        async def run_cases() -> None:
            aoff = AsyncFeatureClient("bench", [region], [schema, timed])
            aon = AsyncFeatureClient("bench", [region], [schema], near_cache=near)
            try:
                # the listener is a thread: poll its flag (no asyncio.Event to wait on)
                polls = 0
                while aon.near is not None and not aon.near.active and polls < 500:
                    await asyncio.sleep(0.01)
                    polls += 1

                async def off_call(ids: list[int]) -> np.ndarray:
                    return (await aoff.get("user", ids)).to_numpy()

                async def on_call(ids: list[int]) -> np.ndarray:
                    return (await aon.get("user", ids)).to_numpy()

                async def timed_call(ids: list[int]) -> np.ndarray:
                    return (await aoff.get("timed", ids)).to_numpy()

                cases: list[Case] = []
                for size in SIZES:
                    sample = batches[size]
                    timed_sample = timed_batches[size]
                    first = sample[0]
                    check(f"plain {size}", plain_read(first), first)
                    check(f"plain async {size}", await aplain_read(first), first)
                    check(f"edgefeed {size}", off.get("user", first).to_numpy(), first)
                    check(f"edgefeed async {size}", await off_call(first), first)
                    for ids in timed_sample[:4]:
                        got = off.get("timed", ids).to_numpy()
                        check(f"edgefeed scheduled {size}", got, ids, expected_timed)
                        got = await timed_call(ids)
                        check(f"edgefeed async scheduled {size}", got, ids, expected_timed)
                    for batch in sample:  # fill the near caches: "near-on" measures hits
                        on.get("user", batch)
                        await aon.get("user", batch)
                    hit, ahit = on.get("user", first), await aon.get("user", first)
                    check(f"edgefeed near {size}", hit.to_numpy(), first)
                    check(f"edgefeed async near {size}", ahit.to_numpy(), first)
                    results["checks"][f"near hits {size}"] = hit.near_hits == size
                    results["checks"][f"async near hits {size}"] = ahit.near_hits == size
                    tag = f"{size}x50"
                    cases += [
                        Case(f"plain redis-py sync {tag}", plain_read, False, sample),
                        Case(
                            f"edgefeed sync near-off {tag}",
                            lambda ids: off.get("user", ids).to_numpy(),
                            False,
                            sample,
                        ),
                        Case(
                            f"edgefeed sync near-on {tag}",
                            lambda ids: on.get("user", ids).to_numpy(),
                            False,
                            sample,
                        ),
                        Case(
                            f"plain redis-py sync same-bytes {tag}",
                            plain_same_bytes,
                            False,
                            timed_sample,
                        ),
                        Case(
                            f"edgefeed sync scheduled {tag}",
                            lambda ids: off.get("timed", ids).to_numpy(),
                            False,
                            timed_sample,
                        ),
                        Case(f"plain redis-py async {tag}", aplain_read, True, sample),
                        Case(f"edgefeed async scheduled {tag}", timed_call, True, timed_sample),
                        Case(f"edgefeed async near-off {tag}", off_call, True, sample),
                        Case(f"edgefeed async near-on {tag}", on_call, True, sample),
                    ]
                await measure(cases, seconds, min_calls, rounds)
                for case in sorted(cases, key=lambda c: c.name.split()[-1]):
                    results["cases"][case.name] = summarize(case.times, case.wall_s)
            finally:
                await aoff.close()
                await aon.close()
                await aplain.aclose()

        asyncio.run(run_cases())
        off.close()
        on.close()
        plain.close()

        python = None if args.no_feast else feast_python(args.feast_python)
        if python is None:
            results["feast"] = "skipped (no Feast interpreter; see --feast-python)"
        else:
            feast = run_feast(
                python, server.port, data, batches, seconds, min(min_calls, 50), min(warmup, 20)
            )
            results["feast"] = f"feast {feast['version']}"
            for size, case in feast["cases"].items():
                results["checks"][f"feast {size}"] = case["values_ok"]
                results["cases"][f"feast get_online_features {size}x50"] = summarize(
                    case["times_ns"], case["wall_s"]
                )
    finally:
        server.stop()
    results["ratios"] = ratios(results["cases"])
    report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


def ratios(cases: dict[str, dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for size in SIZES:
        tag = f"{size}x50"
        ours = cases[f"edgefeed sync near-off {tag}"]
        floor = cases[f"plain redis-py sync {tag}"]
        out[f"edgefeed/plain p50 {tag}"] = ours["p50_us"] / floor["p50_us"]
        out[f"edgefeed/plain p99 {tag}"] = ours["p99_us"] / floor["p99_us"]
        scheduled = cases[f"edgefeed sync scheduled {tag}"]
        out[f"edgefeed scheduled/plain p50 {tag}"] = scheduled["p50_us"] / floor["p50_us"]
        out[f"edgefeed scheduled/plain p99 {tag}"] = scheduled["p99_us"] / floor["p99_us"]
        same = cases[f"plain redis-py sync same-bytes {tag}"]
        out[f"edgefeed scheduled/same-bytes p50 {tag}"] = scheduled["p50_us"] / same["p50_us"]
        out[f"same-bytes/plain p50 {tag}"] = same["p50_us"] / floor["p50_us"]
        aours = cases[f"edgefeed async near-off {tag}"]
        afloor = cases[f"plain redis-py async {tag}"]
        out[f"edgefeed/plain async p50 {tag}"] = aours["p50_us"] / afloor["p50_us"]
        feast = cases.get(f"feast get_online_features {tag}")
        if feast:
            out[f"edgefeed/feast calls/s {tag}"] = ours["calls_per_s"] / feast["calls_per_s"]
            out[f"edgefeed async/feast calls/s {tag}"] = aours["calls_per_s"] / feast["calls_per_s"]
    return out


def report(results: dict[str, Any]) -> None:
    print(f"{'case':44} {'calls':>7} {'p50 us':>9} {'p99 us':>9} {'calls/s':>9}")
    for name, case in results["cases"].items():
        print(
            f"{name:44} {case['calls']:7d} {case['p50_us']:9.1f} {case['p99_us']:9.1f} "
            f"{case['calls_per_s']:9.0f}"
        )
    print()
    for name, value in results["ratios"].items():
        print(f"{name:44} {value:9.2f}")
    print(f"\nFeast: {results['feast']}")
    print(
        "values checked: "
        + ", ".join(f"{k}={'ok' if v else 'WRONG'}" for k, v in results["checks"].items())
    )
    print(
        f"machine: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, "
        f"redis-py {redis.__version__}"
    )


if __name__ == "__main__":
    main()
