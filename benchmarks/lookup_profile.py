"""Where a lookup's microseconds go: one FeatureClient.get of 1 x 50 features, in parts.

The figures docs/benchmarks.md quotes for issue 35. On one local redis-server
(started here, stopped at the end), in interleaved rounds:

* the floor: plain redis-py GET of a packed float32 vector and ``numpy.frombuffer``;
* ``FeatureClient.get(...).to_numpy()``, whole;
* the same call with its reads answered from memory (``FeatureClient._execute``
  replaced): everything the call does but I/O;
* redis-py's pool checkout and release alone (what each plain command pays);

then each part of the call without I/O, hot (``timeit``, best of 5): planning
(validation, keys), decoding, assembling the result, the metrics.

Usage::

    .venv/bin/python benchmarks/lookup_profile.py [--ids 1] [--scheduled] [--json out.json]
    .venv/bin/python benchmarks/lookup_profile.py --smoke     # a second, checks values

Run from another directory with ``PYTHONPATH=<a tree>`` to profile another tree
(e.g. ``git archive <commit> edge_cache | tar -x -C /tmp/before``).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import timeit
from pathlib import Path
from typing import Any

import numpy as np
import redis

from edge_cache import (
    FeatureClient,
    FeatureSchema,
    FeatureWriter,
    Position,
    RegionSettings,
    Schedule,
    Upsert,
)


def _sibling(name: str) -> Any:
    """benchmarks/<name>.py as a module, without putting benchmarks/ on sys.path (its
    workers.py and preprocess.py would shadow the packages for every later import,
    in this process and in the processes it spawns)."""
    import importlib.util

    path = Path(__file__).resolve().with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"edgefeed_bench_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


_lookup = _sibling("lookup")
SLOTS, RedisServer = _lookup.SLOTS, _lookup.RedisServer

N_FEATURES = 50


def _timed(call: Any, calls: int, into: list[int]) -> None:
    perf = time.perf_counter_ns
    for _ in range(calls):
        t0 = perf()
        call()
        into.append(perf() - t0)


def _hot(call: Any, number: int) -> float:
    return min(timeit.repeat(call, number=number, repeat=5)) / number * 1e6


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ids", type=int, default=1, help="entities per call (default 1)")
    parser.add_argument("--scheduled", action="store_true", help="read scheduled values")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--smoke", action="store_true", help="a second: tiny runs, same checks")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rounds, calls, warmup, number = (1, 20, 5, 20) if args.smoke else (args.rounds, 2000, 200, 5000)
    names = [f"f{i}" for i in range(N_FEATURES)]
    schema = FeatureSchema.of("user", names, slots=SLOTS if args.scheduled else 0)
    rng = np.random.default_rng(7)
    n_entities = 100 if args.smoke else 1000
    data = rng.standard_normal((n_entities, N_FEATURES)).astype(np.float32)
    ids = sorted(rng.choice(n_entities, args.ids, replace=False).tolist())
    server = RedisServer()
    try:
        region = RegionSettings(name="bench", redis_url=server.url, residency_zone="local")
        now = time.time()
        now_us = int(now * 1e6)
        with FeatureWriter.from_region(region, [schema]) as writer:
            later = Schedule(
                tuple((now_us + (k + 1) * 3_600_000_000, {"f0": float(k)}) for k in range(SLOTS)),
                now_us + (SLOTS + 1) * 3_600_000_000,
            )
            writer.write(
                [
                    Upsert(
                        "user",
                        i,
                        dict(zip(names, row.tolist(), strict=True)),
                        Position(1),
                        now,
                        schedule=later if args.scheduled else None,
                    )
                    for i, row in enumerate(data)
                ]
            )
        plain = redis.Redis.from_url(server.url)
        plain.mset({f"plain:{i}": row.tobytes() for i, row in enumerate(data)})
        plain_keys = [f"plain:{i}" for i in ids]

        def floor() -> np.ndarray:
            if len(ids) == 1:
                return np.frombuffer(plain.get(plain_keys[0]), np.float32).reshape(1, -1)
            raw = plain.mget([f"plain:{i}" for i in ids])
            return np.frombuffer(b"".join(raw), np.float32).reshape(len(ids), -1)

        client = FeatureClient("bench", [region], [schema])
        memory = FeatureClient("bench", [region], [schema])
        replies: dict[Any, Any] = {}
        execute = memory._execute

        def from_memory(step: Any, deadline: float) -> Any:
            key = (type(step).__name__, tuple(getattr(step, "keys", ())))
            if key not in replies:
                replies[key] = execute(step, deadline)
            return replies[key]

        memory._execute = from_memory  # type: ignore[method-assign]
        for read in (client.get, memory.get):  # every case reads the written values
            if not np.array_equal(read("user", ids).to_numpy(), data[ids]):
                raise AssertionError("edgefeed's values differ from the written ones")
        if not np.array_equal(floor(), data[ids]):
            raise AssertionError("the floor's values differ from the written ones")
        pool = plain.connection_pool

        def checkout() -> None:
            pool.release(pool.get_connection())

        cases = {
            "floor: redis-py GET/MGET + frombuffer": floor,
            "edgefeed get().to_numpy()": lambda: client.get("user", ids).to_numpy(),
            "edgefeed, reads from memory (no I/O)": lambda: memory.get("user", ids).to_numpy(),
            "redis-py pool checkout + release": checkout,
        }
        times: dict[str, list[int]] = {name: [] for name in cases}
        for _ in range(rounds):
            for name, call in cases.items():
                for _ in range(warmup):
                    call()
                gc.collect()
                _timed(call, calls, times[name])
        p50 = {name: float(np.median(t)) / 1000 for name, t in times.items()}
        core = client.core
        plan = core.plan("user", ids, None, None)
        raws = [plain.get(key) for key in core.layout.keys("user", plan.ids)]
        decoded = plan.reader.decode(raws, plan.ids, plan.at_us)
        result = core.assemble(plan, "bench", decoded, 0)
        parts = {
            "plan (validate, keys)": lambda: core.plan("user", ids, None, None),
            "decode": lambda: plan.reader.decode(raws, plan.ids, plan.at_us),
            "assemble (FeatureVectors)": lambda: core.assemble(plan, "bench", decoded, 0),
            "metrics (record)": lambda: core.record(plan, result, 0.0),
            "whole call, reads from memory": lambda: memory.get("user", ids).to_numpy(),
        }
        hot = {name: _hot(call, number) for name, call in parts.items()}
        client.close()
        memory.close()
        plain.close()
    finally:
        server.stop()
    out = {"ids": args.ids, "scheduled": args.scheduled, "p50_us": p50, "hot_us": hot}
    floor_us = p50["floor: redis-py GET/MGET + frombuffer"]
    print(f"{args.ids} x {N_FEATURES}{' scheduled' if args.scheduled else ''}: p50, interleaved")
    for name, value in p50.items():
        print(f"  {name:42} {value:8.1f} us  {value / floor_us:5.2f}x floor")
    print(f"parts of a call without I/O, hot (best of 5 x {number}):")
    for name, value in hot.items():
        print(f"  {name:42} {value:8.2f} us")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
