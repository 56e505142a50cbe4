"""A cache write's schedule as the worker computes it (windows moved only at their own
change times, aggregates read through bound readers) against the straightforward
one: every read time's vector recomputed from the rows, on randomized entities whose
schedules are computed again and again as the worker does (time moving on, changes,
prunes, truncates and evictions in between)."""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import pytest
from test_incremental_windows import ENGINE, T0, oracle, stream

from edge_cache import Schedule
from edgefeed.settings import load_settings
from pipeline.features import EntityEngine, EntityState, FeatureEngine
from pipeline.messages import RegionalChange
from pipeline.windows import TableIndex

ROOT = Path(__file__).resolve().parents[3]


def straightforward(
    engine: EntityEngine, state: dict[str, Any], now: int
) -> tuple[dict[str, Any], Schedule]:
    """The schedule from first principles: the read times at which a window's rows
    change, and the vector recomputed from the rows at each."""
    rows = state["rows"]
    times: set[int] = set()
    for table, windows in engine._windows.items():
        index = TableIndex(list(windows.values()), rows.get(table, {}), now)
        times.update(index.changes_after(now, engine.slots + 1))
    points = sorted(times)[: engine.slots + 1]
    base = oracle(engine, state, at=now)
    patches: list[tuple[int, dict[str, Any]]] = []
    previous = base
    for at in points[: engine.slots]:
        vector = oracle(engine, state, at=at)
        if vector != previous:
            patches.append((at * 1000, vector))
            previous = vector
    until = points[engine.slots] * 1000 if len(points) > engine.slots else None
    return base, Schedule(tuple(patches), until)


@pytest.mark.parametrize("seed", range(8))
def test_schedules_equal_a_recomputation_at_every_read_time_as_time_moves_on(seed: int) -> None:
    rng = random.Random(seed)
    state: dict[str, Any] | None = None
    now = T0
    for step, message in enumerate(stream(seed + 300, 250)):
        state, _ = ENGINE.apply(state, message)
        assert isinstance(state, EntityState)
        if step % 53 == 0:
            ENGINE.prune(state)
        if step % 131 == 130:
            ENGINE.truncate(state, {"t": "public.events", "lsn": message["lsn"], "ts": T0})
        if rng.random() < 0.5:
            # Mostly forward, as the worker's clock goes; now and then back (a state
            # written late) or far ahead (a renewal after a quiet spell).
            now = max(now, message["ts"]) + rng.choice((0, 40, 700, 9_000, -6_000, 40_000))
            if rng.random() < 0.1:
                state.index = None  # evicted, read back from the local store
            got = ENGINE.schedule(state, now)
            assert got == straightforward(ENGINE, state, now), f"seed {seed}, step {step}"
            # Renewed at its end: the next schedule starts where this one stops.
            until = got[1].until_us if got[1] is not None else None
            if until is not None and rng.random() < 0.3:
                now = until // 1000
                renewed = ENGINE.schedule(state, now)
                assert renewed == straightforward(ENGINE, state, now), f"seed {seed}, step {step}"


def test_the_demo_users_schedules_equal_a_recomputation() -> None:
    """The demo shop's user (examples/edgefeed.yaml): windows of 30 minutes to a day,
    every aggregate kind, written each time a batch changes it."""
    settings = load_settings(ROOT / "examples" / "edgefeed.yaml", env={})
    engine = FeatureEngine(settings.entities).engine("user")
    rng = random.Random(11)
    now = 1_800_000_000_000
    state: EntityState | None = None
    for i in range(300):
        now += rng.choice((5, 200, 1_500, 60_000))
        row = {
            "event_id": i,
            "user_id": 7,
            "item_id": rng.randrange(12),
            "category_id": rng.randrange(5),
            "price": rng.choice(("1.50", "0.10", "19.99", "0.30")),
            "home_region": "eu-west",
            "kind": rng.choice(("view", "view", "click", "purchase", "add_to_cart")),
            "occurred_at": (now - rng.choice((0, 0, 1_000, 2_000_000))) * 1000,
        }
        pk = str(rng.randrange(250))
        change = RegionalChange("public.events", "u", 100 + i, 0, now, "user", 7, pk, row)
        state, _ = engine.apply(state, change)
        if i % 3 == 0:
            got = engine.write_op(7, state, now)
            plain = copy.deepcopy(dict(state))  # no index: built afresh
            base, schedule = straightforward(engine, plain, now)
            assert (got.values, got.schedule) == (base, schedule), i  # type: ignore[union-attr]


def test_a_schedule_leaves_its_windows_at_its_last_read_time_and_the_next_moves_on() -> None:
    """After a schedule the windows stay where its last read time put them (moving
    them back would be undone by the next schedule, or wasted on a state evicted
    first); the next schedule, earlier or later, after changes or not, moves them
    from there and equals the recomputation."""
    state: dict[str, Any] | None = None
    for message in stream(905, 120):
        state, _ = ENGINE.apply(state, message)
    assert isinstance(state, EntityState)
    now = max(int(e[2]) for rows in state["rows"].values() for e in rows.values())
    got = ENGINE.schedule(state, now)
    assert got == straightforward(ENGINE, state, now)
    assert got[1] is not None and got[1].patches  # windows that move after ``now``
    times: set[int] = set()
    for table, windows in ENGINE._windows.items():
        fresh = TableIndex(list(windows.values()), state["rows"].get(table, {}), now)
        times.update(fresh.changes_after(now, ENGINE.slots + 1))
    last = sorted(times)[ENGINE.slots - 1]  # the schedule's last read time
    assert state.index is not None
    assert {index.at for index in state.index.values()} == {last}
    for step, message in enumerate(stream(906, 40)):
        state, _ = ENGINE.apply(state, message)
        now += (-5_000, 30, 2_000, 600_000)[step % 4]  # back, on a little, on, far on
        assert ENGINE.schedule(state, now) == straightforward(ENGINE, state, now), step
