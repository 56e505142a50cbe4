"""Instructions per entity of a regional worker's per-entity steps (issue 36): a
measure that does not move with the machine's neighbours.

On the shared 2-core machines a change of 10% in the worker's CPU per change is
inside the spread of one tree's own timed runs (10-30% between runs of
benchmarks/scale.py's in-process patterns). Valgrind's callgrind counts the
instructions a process executes instead: the same tree measured twice agrees to
~0.3%, so one run resolves a step of a few percent, and two trees compare in one
run without alternating.

The steps, over the demo's definitions (examples/edgefeed.yaml: 17 user and 4
item features) and a local store built in bulk by benchmarks/scale.py's code
(``scalebench.bulk.bulk_build``: users with 20 events each over a day, one item
per 10 users):

- ``read``: an entity's state read back from the local store (its record and
  row chunks: ``LocalStates.load``);
- ``vector``: read back, then its vector and schedule from scratch, as a worker
  computes them on a miss (``EntityEngine.write_op`` on a state just read back);
  the vector's own share is ``vector - read``;
- ``change``: one new change applied to a state held in memory with its index,
  then its vector and schedule (``EntityEngine.apply`` and ``write_op``), as a
  worker does on a hit; per change (two per event: its user's and its item's).

Each step runs in a process of its own under ``valgrind --tool=callgrind``
(``PYTHONHASHSEED=0``) with ``--reps`` passes over every entity after a warm-up
the same for every step, and one more process runs the warm-up alone: the
difference divided by the passes and entities is the step's instructions per
entity (start-up, imports and the warm-up cancel out). A
digest of every vector and schedule written is reported per tree: two trees with
the same digest computed the same values.

    .venv/bin/python benchmarks/instructions.py                       # this tree
    .venv/bin/python benchmarks/instructions.py --baseline-ref main   # and main's
    .venv/bin/python benchmarks/instructions.py --smoke               # the test suite

Needs valgrind (Debian: ``apt-get install valgrind``; scripts/bootstrap.sh installs
it). Instructions are not time: a step that trades instructions for memory
stalls is not measured fairly here, so a step found here is then timed where it
runs (benchmarks/scale.py).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# This folder holds files named like the packages they measure: not on the path.
_HERE = Path(__file__).resolve().parent
ROOT = _HERE.parent
sys.path[:] = [p for p in sys.path if p not in ("", str(_HERE))]

STEPS = ("read", "vector", "change")
NOW_MS = 1_765_000_000_000  # the read time of every vector: the runs compare
EVENTS, SEED = 20, 36
_COLLECTED = re.compile(rb"Collected : (\d+)")


class InstructionsError(RuntimeError):
    """A measurement could not be made (valgrind missing, a child failed)."""


# The measured process. It runs with the measured tree first on the path and that
# tree's benchmarks/scalebench loaded by path (benchmarks/ holds a pipeline.py that
# would shadow the package). argv: tree, store folder, users, step, passes.
_CHILD = r"""
import hashlib, importlib.util, sys
from pathlib import Path
tree, folder, step = sys.argv[1], Path(sys.argv[2]), sys.argv[4]
users, reps = int(sys.argv[3]), int(sys.argv[5])
sys.path[:] = [tree] + [p for p in sys.path if p not in ("", tree)]
spec = importlib.util.spec_from_file_location(
    "scalebench", f"{tree}/benchmarks/scalebench/__init__.py",
    submodule_search_locations=[f"{tree}/benchmarks/scalebench"])
module = importlib.util.module_from_spec(spec); sys.modules["scalebench"] = module
spec.loader.exec_module(module)
import orjson
from pipeline.features import FeatureEngine
from scalebench.bulk import NEW_LSN, new_changes
from scalebench.load import Load, partition_of
from scalebench.modes import open_states
from scalebench.worker import settings

NOW_MS, EVENTS, SEED = %(now)d, %(events)d, %(seed)d
engine = FeatureEngine(settings().entities)
local = open_states(folder / "state", engine)
load = Load(users, EVENTS, NOW_MS, SEED)
keys = list(load.entity_keys())
where = [
    (k, partition_of(k), engine.engine(k.split(":", 1)[0]), int(k.split(":", 1)[1])) for k in keys
]
digest = hashlib.blake2b(digest_size=16)

def written(key, op):
    options = orjson.OPT_SORT_KEYS | orjson.OPT_SERIALIZE_NUMPY
    digest.update(key.encode() + orjson.dumps(op.values, option=options))
    digest.update(repr(getattr(op, "schedule", None)).encode())

def read_all():
    for key, partition, _entity, _id in where:
        local.load(key, partition)

def vector_all():
    for key, partition, entity, id_ in where:
        state = local.load(key, partition)
        state.loaded = True  # as StateCache.get marks a state read back
        written(key, entity.write_op(id_, state, NOW_MS))

states = {}
def change_pass(n):
    for change in new_changes(load, "round", users, NEW_LSN * (n + 2)):
        key = change.key
        entity = engine.engine(key.split(":", 1)[0])
        state, _changed = entity.apply(states[key], change)
        states[key] = state
        written(key, entity.write_op(int(key.split(":", 1)[1]), state, NOW_MS))

# The warm-up, the same for every step (so that one run without passes is every
# step's base): the states in memory with their index (built by a first vector),
# one change each, and every entity read back once.
for key, partition, entity, id_ in where:
    states[key] = state = local.load(key, partition)
    written(key, entity.write_op(id_, state, NOW_MS))
change_pass(0)
read_all()
for n in range(reps):
    if step == "read":
        read_all()
    elif step == "vector":
        vector_all()
    else:
        change_pass(n + 1)
local.close()
print("digest", digest.hexdigest())
"""


def _load_parts() -> None:
    """benchmarks/scalebench, loaded as benchmarks/scale.py loads it (by running that
    script's module, which registers its parts)."""
    if "scalebench" in sys.modules:
        return
    spec = importlib.util.spec_from_file_location("edgefeed_bench_scale", _HERE / "scale.py")
    assert spec is not None and spec.loader is not None
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


def build_store(folder: Path, users: int) -> dict[str, Any]:
    """The local store the steps read: ``users`` demo users built in bulk."""
    _load_parts()
    from scalebench.bulk import bulk_build
    from scalebench.load import Load
    from scalebench.worker import settings

    from pipeline.features import FeatureEngine

    engine = FeatureEngine(settings().entities)
    load = Load(users, EVENTS, NOW_MS, SEED)
    return asyncio.run(bulk_build(folder, load, engine))


def valgrind() -> str:
    found = shutil.which("valgrind")
    if found is None:
        raise InstructionsError(
            "valgrind is not installed: install it (Debian: apt-get install valgrind; "
            "scripts/bootstrap.sh does) to count instructions"
        )
    return found


def count(tree: Path, folder: Path, users: int, step: str, reps: int) -> tuple[int, str]:
    """Instructions of one child process (the step ``reps`` times after its warm-up
    pass) and the digest of the vectors it wrote.

    The child reads a copy of the built store made for it alone: RocksDB writes at
    every open (its manifest, its log) and may flush or compact, so a store opened
    by the runs before would read differently (5% fewer instructions per read
    after four opens, measured)."""
    with tempfile.TemporaryDirectory(prefix="edgefeed-bench-instructions-run-") as tmp:
        copy = Path(tmp) / "store"
        shutil.copytree(folder, copy)
        return _count(tree, copy, users, step, reps)


def _count(tree: Path, folder: Path, users: int, step: str, reps: int) -> tuple[int, str]:
    code = _CHILD % {"now": NOW_MS, "events": EVENTS, "seed": SEED}
    command = [
        valgrind(),
        "--tool=callgrind",
        "--callgrind-out-file=/dev/null",
        sys.executable,
        "-c",
        code,
        str(tree),
        str(folder),
        str(users),
        step,
        str(reps),
    ]
    env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": str(tree)}
    done = subprocess.run(command, capture_output=True, env=env, cwd=tree)
    found = _COLLECTED.search(done.stderr)
    if done.returncode != 0 or found is None:
        tail = done.stderr.decode(errors="replace")[-2000:]
        raise InstructionsError(
            f"the {step} step of {tree} failed (exit {done.returncode}): {tail}"
        )
    digest = done.stdout.decode().split("digest", 1)[1].strip()
    return int(found.group(1)), digest


def measure(
    tree: Path, folder: Path, users: int, reps: int, steps: tuple[str, ...] = STEPS
) -> dict[str, Any]:
    """Instructions per entity (per change for ``change``) of every step, and the
    digests of what the steps wrote."""
    entities = users + max(1, users // 10)
    per_unit = {"read": entities, "vector": entities, "change": 2 * users}
    found: dict[str, Any] = {"digests": {}}
    # Byte-compiled first, outside the count: a tree extracted fresh has no
    # __pycache__, and its first runs counted 1.5-5% more per step than the same
    # code compiled (measured: HEAD against itself).
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", "-x", r"/\.venv", str(tree)],
        check=True,
        capture_output=True,
    )
    # One run not counted: the first process on a fresh clone counted more than the
    # later ones (a smoke run's base exceeded its step), so the base is the second.
    count(tree, folder, users, "none", 0)
    base, _ = count(tree, folder, users, "none", 0)
    for step in steps:
        total, digest = count(tree, folder, users, step, reps)
        found[step] = round((total - base) / (reps * per_unit[step]))
        found["digests"][step] = digest
    if "read" in found and "vector" in found:
        found["vector_alone"] = found["vector"] - found["read"]
    return found


def _extract(ref: str, into: Path) -> None:
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", ref], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)


def render(report: dict[str, Any]) -> str:
    trees = report["trees"]
    lines = [
        f"instructions per entity (callgrind), {report['users']} users, "
        f"{report['reps']} passes; per change for 'change'"
    ]
    names = list(trees)
    lines.append("  step           " + "".join(f"{n:>14s}" for n in names))
    for step in [s for s in (*STEPS, "vector_alone") if s in trees[names[0]]]:
        row = "".join(f"{trees[n][step]:>14,d}" for n in names)
        lines.append(f"  {step:14s} {row}")
    if "ratios" in report:
        lines.append(f"  after / before: {report['ratios']}")
        lines.append(f"  same vectors and schedules: {report['same_values']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=300)
    parser.add_argument("--reps", type=int, default=4, help="passes over every entity")
    parser.add_argument(
        "--baseline-ref", default="", help="git ref measured beside this tree ('': none)"
    )
    parser.add_argument(
        "--steps", nargs="+", choices=STEPS, default=list(STEPS), help="the steps measured"
    )
    parser.add_argument("--smoke", action="store_true", help="20 users, one pass")
    parser.add_argument("--json", type=Path, help="also write the report (JSON) here")
    args = parser.parse_args()
    if args.smoke:
        args.users, args.reps = 20, 1
    if args.users < 1 or args.reps < 1:
        parser.error(f"--users {args.users} and --reps {args.reps} must be at least 1")
    valgrind()
    started = time.perf_counter()
    report: dict[str, Any] = {
        "users": args.users,
        "reps": args.reps,
        "steps": args.steps,
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "trees": {},
    }
    with tempfile.TemporaryDirectory(prefix="edgefeed-bench-instructions-") as tmp:
        work = Path(tmp)
        report["build"] = build_store(work / "store", args.users)
        trees = {"after": ROOT}
        if args.baseline_ref:
            before = work / "before"
            before.mkdir()
            _extract(args.baseline_ref, before)
            trees = {"before": before, "after": ROOT}
            report["baseline_ref"] = args.baseline_ref
        for name, tree in trees.items():
            report["trees"][name] = measure(
                tree, work / "store", args.users, args.reps, tuple(args.steps)
            )
    if args.baseline_ref:
        before, after = report["trees"]["before"], report["trees"]["after"]
        report["ratios"] = {
            step: round(after[step] / before[step], 3)
            for step in (*STEPS, "vector_alone")
            if step in after
        }
        report["same_values"] = before["digests"] == after["digests"]
    report["seconds"] = round(time.perf_counter() - started, 1)
    print(render(report))
    print(f"done in {report['seconds']} s")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    try:
        main()
    except InstructionsError as exc:
        sys.exit(f"instructions: {exc}")
