"""What windows read as of the read time cost the worker: one entity's cache write
with its schedule (``EntityEngine.write_op``: the vector in force now and the next
4 with their times) against the vector alone (``EntityEngine.vector``, windows as
of the entity's newest event: what a write cost before schedules), in the same
process, interleaved.

The entity is the demo shop's user (examples/edgefeed.yaml: 17 features, windows
of 30 minutes to a day) holding ``--events`` events spread over the last hour.
Two write cases: at one fixed ``now`` (the windows stand where the last write left
them: the least a write costs), and with ``now`` moving on between writes, as the
worker's clock does (``--span-s`` over a round's calls: the windows move at each
write, rows leave them; each round from a fresh state).

    .venv/bin/python benchmarks/schedule.py                 # 5, 50 and 500 events
    .venv/bin/python benchmarks/schedule.py --events 200
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# benchmarks/pipeline.py would shadow the package: drop this folder from the path.
_HERE = str(Path(__file__).resolve().parent)
sys.path[:] = [p for p in sys.path if p not in ("", _HERE)]

from edgefeed.settings import load_settings  # noqa: E402
from pipeline.features import EntityEngine, FeatureEngine  # noqa: E402
from pipeline.messages import RegionalChange  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def user_with(engine: EntityEngine, events: int, now_ms: int) -> Any:
    rng = random.Random(events)
    state = None
    for i in range(events):
        row = {
            "event_id": i,
            "user_id": 7,
            "item_id": rng.randrange(50),
            "category_id": rng.randrange(8),
            "price": "1.50",
            "home_region": "eu-west",
            "kind": rng.choice(("view", "view", "click", "purchase", "add_to_cart")),
            "occurred_at": (now_ms - rng.randrange(3_600_000)) * 1000,
        }
        change = RegionalChange("public.events", "c", 100 + i, 0, now_ms, "user", 7, str(i), row)
        state, _ = engine.apply(state, change)
    return state


def median_us(call: Any, calls: int) -> float:
    times = []
    for _ in range(calls):
        started = time.perf_counter_ns()
        call()
        times.append(time.perf_counter_ns() - started)
    return statistics.median(times) / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", type=int, action="append", help="events per user")
    parser.add_argument("--calls", type=int, default=2000, help="calls per case and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--span-s",
        type=float,
        default=600.0,
        help="how far the moving case's clock goes over a round's calls",
    )
    args = parser.parse_args()
    step_ms = args.span_s * 1000 / args.calls
    settings = load_settings(ROOT / "examples" / "edgefeed.yaml", env={})
    engine = FeatureEngine(settings.entities).engine("user")
    now_ms = int(time.time() * 1000)
    print(f"machine: {platform.machine()}, Python {platform.python_version()}")
    print(
        f"{'events':>7} {'vector us':>10} {'write_op us':>12} {'ratio':>6} "
        f"{'write_op us, now moving':>24}"
    )
    for events in args.events or [5, 50, 500]:
        state = user_with(engine, events, now_ms)
        other = user_with(engine, events, now_ms)  # its own windows: each case as it runs
        plain: list[float] = []
        scheduled: list[float] = []
        moving: list[float] = []
        for _ in range(args.rounds):
            plain.append(median_us(lambda state=state: engine.vector(state), args.calls))
            scheduled.append(
                median_us(lambda other=other: engine.write_op(7, other, now_ms), args.calls)
            )
            walker = user_with(engine, events, now_ms)
            clock = iter(range(args.calls))
            moving.append(
                median_us(
                    lambda walker=walker, clock=clock: engine.write_op(
                        7, walker, now_ms + int(next(clock) * step_ms)
                    ),
                    args.calls,
                )
            )
        a, b = statistics.median(plain), statistics.median(scheduled)
        c = statistics.median(moving)
        print(f"{events:7d} {a:10.1f} {b:12.1f} {b / a:6.2f} {c:24.1f}")


if __name__ == "__main__":
    main()
