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
    .venv/bin/python benchmarks/scale.py --bulk 10000 --bulk 10000000 --bulk-jobs 2
                                                               # a state built in bulk
    .venv/bin/python benchmarks/scale.py --plot docs/img/scale.png
    .venv/bin/python benchmarks/scale.py --users 10000 --mode disk --memory-mb 64 \\
        --profile /tmp/scale.prof                              # where the time goes
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import multiprocessing
import os
import platform
import resource
import sys
import time
from pathlib import Path
from typing import Any

# This folder holds files named like the packages they measure: not on the path.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if p not in ("", str(_HERE))]


def _load_parts() -> None:
    """benchmarks/scalebench, this script's parts, loaded by path (this folder is not
    on the path) and registered, so that they import one another and a spawned run
    finds them (it runs this script first)."""
    if "scalebench" in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(
        "scalebench",
        _HERE / "scalebench" / "__init__.py",
        submodule_search_locations=[str(_HERE / "scalebench")],
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["scalebench"] = module
    spec.loader.exec_module(module)


_load_parts()

from scalebench.bulk import load_bulk  # noqa: E402
from scalebench.load import CHANGES_PER_MESSAGE, PARTITIONS  # noqa: E402
from scalebench.modes import MODES, load_disk, load_memory  # noqa: E402
from scalebench.report import (  # noqa: E402
    BULK_COLUMNS,
    COLUMNS,
    DISK_COLUMNS,
    plot,
    print_bulk_ratios,
    print_ratios,
    print_table,
)
from scalebench.worker import Run  # noqa: E402

MEMORY_MB = 256.0  # disk mode's default budget for the states in memory
SMOKE_MEMORY_MB = 2.0  # --smoke: small, so that states are evicted and read back


# -- the runs ---------------------------------------------------------------------------------


def child(run: Run, out: Any) -> None:
    loads = {"memory": load_memory, "bulk": load_bulk, "disk": load_disk}
    result = asyncio.run(loads[run.mode](run))
    result["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    out.send(result)


def run_size(run: Run) -> dict[str, Any]:
    """One size and mode in a fresh process (spawned: its memory is the measurement)."""
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(
        target=child,
        args=(run, send),
    )
    process.start()
    send.close()
    try:
        result: dict[str, Any] = receive.recv()
    except EOFError:
        process.join()
        raise RuntimeError(
            f"the {run.users}-user {run.mode} run died (exit code {process.exitcode})"
        ) from None
    process.join()
    return result


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
    parser.add_argument(
        "--bulk-jobs",
        type=int,
        default=1,
        help="processes that build a --bulk state, each some partitions' entities "
        f"(at most {PARTITIONS}; the measurements after it are one worker's)",
    )
    parser.add_argument("--save", type=Path, help="also write the results (JSON) here")
    parser.add_argument(
        "--replot",
        type=Path,
        action="append",
        help="print and plot the results --save wrote (repeatable), running nothing",
    )
    args = parser.parse_args()
    if not 1 <= args.bulk_jobs <= PARTITIONS:
        parser.error(f"--bulk-jobs {args.bulk_jobs}: give 1 to {PARTITIONS} (the partitions)")
    jobs = args.bulk_jobs
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
        run_size(
            Run(mode, users, args.events, args.seed, now_s, checkpoint_s, memory_mb, args.profile)
        )
        for users in sizes
        for mode in modes
    ]
    results += [
        run_size(
            Run("bulk", users, args.events, args.seed, now_s, checkpoint_s, memory_mb, jobs=jobs)
        )
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
