"""Incremental aggregates (pipeline.windows) against a full recomputation from the rows.

The oracle below recomputes every feature from the state's rows the simple way;
random streams of inserts, updates, deletes, late and duplicate messages, window
moves, prunes and truncates must give exactly the same vector after every step.
"""

from __future__ import annotations

import random
from collections import Counter
from datetime import datetime, timedelta
from fractions import Fraction
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from pipeline.features import EntityEngine, EntityState
from pipeline.settings import AggregateFeature, EntitySettings
from pipeline.windows import pk_rank

_LSN, _SEQ, _T, _DEL, _VALS = range(5)
T0 = 1_764_000_000_000

ENTITY = EntitySettings.model_validate(
    {
        "name": "user",
        "tables": {"public.users": "user_id", "public.events": "user_id"},
        "time_columns": {"public.events": "at"},
        "latest": [{"name": "segment", "table": "public.users", "column": "segment"}],
        "aggregates": [
            {"name": "n_10s", "table": "public.events", "agg": "count", "window": {"size": "10s"}},
            {
                "name": "views_10s",
                "table": "public.events",
                "agg": "count",
                "where": {"kind": "view"},
                "window": {"size": "10s"},
            },
            {
                "name": "spend_7s",
                "table": "public.events",
                "agg": "sum",
                "column": "price",
                "window": {"size": "7s", "type": "tumbling"},
            },
            {
                "name": "avg_view_price",
                "table": "public.events",
                "agg": "mean",
                "column": "price",
                "where": {"kind": "view"},
                "window": {"size": "20s"},
            },
            {
                "name": "min_price",
                "table": "public.events",
                "agg": "min",
                "column": "price",
                "window": {"size": "20s"},
            },
            {
                "name": "max_price",
                "table": "public.events",
                "agg": "max",
                "column": "price",
                "window": {"size": "5s"},
            },
            {
                "name": "items",
                "table": "public.events",
                "agg": "distinct_count",
                "column": "item",
                "window": {"size": "10s"},
            },
            {
                "name": "last_items",
                "table": "public.events",
                "agg": "last_n",
                "column": "item",
                "n": 3,
                "window": {"size": "10s"},
            },
            {
                "name": "last_bought",
                "table": "public.events",
                "agg": "last_n",
                "column": "item",
                "n": 2,
                "where": {"kind": "buy"},
            },
            {
                "name": "top_cat",
                "table": "public.events",
                "agg": "top_k",
                "column": "cat",
                "n": 2,
                "window": {"size": "20s"},
            },
            {
                "name": "events_today",
                "table": "public.events",
                "agg": "count",
                "window": {"size": "1d", "type": "tumbling"},
            },
            {
                "name": "buys_today_new_york",
                "table": "public.events",
                "agg": "count",
                "where": {"kind": "buy"},
                "window": {"size": "1d", "type": "tumbling", "time_zone": "America/New_York"},
            },
        ],
    }
)


def _bucket(agg: AggregateFeature, t: int) -> tuple[int, int]:
    """The tumbling bucket holding ``t``, the plain way (a zone's days from local midnight)."""
    assert agg.window is not None
    size = agg.window.size_ms
    if agg.window.time_zone == "UTC":
        return (t - t % size, t - t % size + size)
    assert size == 86_400_000, "the oracle knows local days only"
    zone = ZoneInfo(agg.window.time_zone)
    day = datetime.fromtimestamp(t / 1000, zone).date()
    start = datetime.combine(day, datetime.min.time(), zone)
    end = datetime.combine(day + timedelta(days=1), datetime.min.time(), zone)
    return (round(start.timestamp() * 1000), round(end.timestamp() * 1000))


def _in_window(
    entries: list[list[Any]], agg: AggregateFeature, ref: int | None, at: int | None
) -> list[Any]:
    if agg.window is None or ref is None:
        return entries
    size = agg.window.size_ms
    t = ref if at is None else at
    if agg.window.type == "sliding":
        return [e for e in entries if t - size < e[_T] <= t]
    start, end = _bucket(agg, t)
    return [e for e in entries if start <= e[_T] < end and e[_T] <= t]


def oracle(engine: EntityEngine, state: dict[str, Any], at: int | None = None) -> dict[str, Any]:
    """Every feature recomputed from the rows, with windows read at ``at`` (None: as of
    the newest event of each table)."""
    values: dict[str, Any] = {}
    for latest in engine.settings.latest:
        live = [e for e in state["rows"].get(latest.table, {}).values() if not e[_DEL]]
        newest = max(live, key=lambda e: (e[_LSN], e[_SEQ])) if live else None
        values[latest.name] = None if newest is None else newest[_VALS].get(latest.column)
    for agg in engine.settings.aggregates:
        rows = state["rows"].get(agg.table, {})
        ref = max((e[_T] for e in rows.values()), default=None)
        keyed = {id(e): pk_rank(pk) for pk, e in rows.items()}
        entries = _in_window([e for e in rows.values() if not e[_DEL]], agg, ref, at)
        entries = [e for e in entries if all(e[_VALS].get(k) == v for k, v in agg.where.items())]
        column = agg.column or ""
        present = [e for e in entries if e[_VALS].get(column) is not None]
        numbers = [e[_VALS][column] for e in present]
        names = agg.feature_names
        if agg.agg == "count":
            values[agg.name] = len(entries)
        elif agg.agg == "sum":
            values[agg.name] = float(sum(map(Fraction, numbers), Fraction(0)))
        elif agg.agg == "mean":
            total = sum(map(Fraction, numbers), Fraction(0))
            values[agg.name] = float(total / len(numbers)) if numbers else None
        elif agg.agg in ("min", "max"):
            values[agg.name] = (min if agg.agg == "min" else max)(numbers) if numbers else None
        elif agg.agg == "distinct_count":
            values[agg.name] = len(set(numbers))
        elif agg.agg == "last_n":
            ordered = sorted(
                present, key=lambda e: (e[_T], e[_LSN], e[_SEQ], keyed[id(e)]), reverse=True
            )
            picked = [e[_VALS][column] for e in ordered[: len(names)]]
            values.update(zip(names, picked + [None] * (len(names) - len(picked)), strict=True))
        else:
            counts = Counter(numbers)
            newest = {
                v: max(
                    (e[_T], e[_LSN], e[_SEQ], keyed[id(e)])
                    for e in present
                    if e[_VALS][column] == v
                )
                for v in counts
            }
            ranked = sorted(counts, key=lambda v: (counts[v], newest[v]), reverse=True)[
                : len(names)
            ]
            values.update(zip(names, ranked + [None] * (len(names) - len(ranked)), strict=True))
    return values


def stream(seed: int, steps: int) -> list[dict[str, Any]]:
    """Random event messages: mostly moving forward in time, with late rows, updates,
    deletes, prices that do not add up exactly in floating point, and duplicates."""
    rng = random.Random(seed)
    messages: list[dict[str, Any]] = []
    lsn, now = 1000, T0
    for _ in range(steps):
        lsn += rng.randrange(1, 4)
        now += rng.choice((0, 0, 150, 900, 2500, 6000))
        roll = rng.random()
        base = {"t": "public.events", "lsn": lsn, "seq": 0, "ts": now, "e": "user", "id": 1}
        if roll < 0.08 and messages:
            messages.append(dict(rng.choice(messages)))  # an exact duplicate
            continue
        pk = str(rng.randrange(1, 40))
        if roll < 0.16:
            messages.append({**base, "pk": pk, "op": "d", "row": None})
            continue
        row = {
            "at": now - rng.choice((0, 0, 0, 400, 3000, 12000)),  # some rows arrive late
            "kind": rng.choice(("view", "view", "click", "buy")),
            "price": rng.choice((0.1, 0.2, 0.3, 19.99, 1e-3, None, 7.0, 1e16)),
            "item": rng.choice((1, 2, 3, 4, 5, None)),
            "cat": rng.choice((7, 8, 9)),
        }
        messages.append({**base, "pk": pk, "op": rng.choice(("c", "u")), "row": row})
    return messages


ENGINE = EntityEngine(ENTITY)


@pytest.mark.parametrize("seed", range(12))
def test_incremental_vector_equals_full_recomputation_after_every_change(seed: int) -> None:
    rng = random.Random(seed * 7 + 1)
    messages = stream(seed, 400)
    segment = {"t": "public.users", "e": "user", "id": 1, "pk": "1", "seq": 0, "ts": T0}
    messages.insert(5, {**segment, "lsn": 999, "op": "c", "row": {"segment": 3}})
    if seed % 3 == 0:  # some streams arrive shuffled: the result must not depend on order
        rng.shuffle(messages)
    state: dict[str, Any] | None = None
    for step, message in enumerate(messages):
        new_state, _changed = ENGINE.apply(state, message)
        state = new_state
        assert state is not None
        if step % 37 == 0:
            ENGINE.prune(state)
        if step % 97 == 0:  # a truncate of the events table
            ENGINE.truncate(state, {"t": "public.events", "lsn": message["lsn"], "ts": T0})
        assert ENGINE.vector(state) == oracle(ENGINE, state), f"seed {seed}, step {step}"
        if rng.random() < 0.3:
            # A write's schedule leaves the windows standing at its read time (sometimes
            # before the newest event); the next changes and prunes must still add up.
            now = message["ts"] + rng.choice((-5_000, 0, 800, 30_000))
            base, _schedule = ENGINE.schedule(state, now)
            assert base == oracle(ENGINE, state, at=now), f"seed {seed}, step {step}"
    assert state is not None
    # A state recovered from the changelog (a plain dict, no index) gives the same vector.
    recovered = {k: v for k, v in state.items()}
    assert not isinstance(recovered, EntityState)
    assert ENGINE.vector(recovered) == ENGINE.vector(state)


@pytest.mark.parametrize("seed", range(6))
def test_a_state_read_back_without_its_index_schedules_the_same_values(seed: int) -> None:
    """With the states on disk, a state read back has no index: changes apply to its
    rows alone, and the index is built at the read time of the next write. Its
    schedules must be those of a state whose index was kept and moved along."""
    rng = random.Random(seed)
    kept: dict[str, Any] | None = None
    read_back: dict[str, Any] | None = None
    for step, message in enumerate(stream(seed + 100, 300)):
        kept, _ = ENGINE.apply(kept, dict(message))
        read_back, _ = ENGINE.apply(read_back, dict(message))
        assert isinstance(kept, EntityState) and isinstance(read_back, EntityState)
        if step % 41 == 0:
            ENGINE.prune(kept)
            ENGINE.prune(read_back)
        if rng.random() < 0.4:
            now = message["ts"] + rng.choice((-5_000, 0, 800, 30_000))
            if rng.random() < 0.5:
                read_back.index = None  # evicted and read again
            got = ENGINE.schedule(read_back, now)
            assert got == ENGINE.schedule(kept, now), f"seed {seed}, step {step}"
            assert got[0] == oracle(ENGINE, kept, at=now), f"seed {seed}, step {step}"


def test_order_of_delivery_does_not_change_the_vector() -> None:
    messages = stream(99, 300)
    forward: dict[str, Any] | None = None
    for message in messages:
        forward, _ = ENGINE.apply(forward, message)
    shuffled = list(messages)
    random.Random(5).shuffle(shuffled)
    backward: dict[str, Any] | None = None
    for message in shuffled + messages:  # shuffled, then everything again
        backward, _ = ENGINE.apply(backward, message)
    assert forward is not None and backward is not None
    assert ENGINE.vector(backward) == ENGINE.vector(forward) == oracle(ENGINE, forward)


def test_sums_are_exact_whatever_was_added_and_retracted() -> None:
    engine = EntityEngine(ENTITY)
    state: dict[str, Any] | None = None
    lsn = 10
    for price in (0.1, 0.2, 1e16, 0.3):
        lsn += 1
        row = {"at": T0, "kind": "view", "price": price, "item": 1, "cat": 7}
        state, _ = engine.apply(
            state,
            {"t": "public.events", "e": "user", "id": 1, "pk": str(lsn), "lsn": lsn, "seq": 0}
            | {"ts": T0, "op": "c", "row": row},
        )
    assert state is not None
    lsn += 1  # retract the huge price: what remains must be 0.1 + 0.2 + 0.3, exactly rounded
    state, _ = engine.apply(
        state,
        {"t": "public.events", "e": "user", "id": 1, "pk": "13", "lsn": lsn, "seq": 0}
        | {"ts": T0, "op": "d", "row": None},
    )
    assert state is not None
    assert engine.vector(state)["spend_7s"] == float(Fraction(0.1) + Fraction(0.2) + Fraction(0.3))
