"""Windows read as of the read time: the vector a worker writes, with its schedule,
must give at every read time what a recomputation from the rows gives at that time,
for every aggregate, sliding and tumbling windows, and a zone's local days."""

from __future__ import annotations

import random
from typing import Any

import pytest
from pydantic import ValidationError
from test_incremental_windows import ENGINE, T0, oracle, stream

from edge_cache import Schedule
from pipeline.featureplan import feature_definitions
from pipeline.features import SCHEDULE_SLOTS
from pipeline.settings import WindowSettings

DAY_MS = 86_400_000


def in_force(base: dict[str, Any], schedule: Schedule | None, t_ms: int) -> dict[str, Any]:
    """What a reader at ``t_ms`` gets from a written value (what the lookup client does
    with the bytes; tests/unit/edge_cache checks the bytes)."""
    value = base
    for from_us, patch in schedule.patches if schedule is not None else ():
        if from_us <= t_ms * 1000:
            value = dict(patch)
    return value


def read(state: dict[str, Any], written_ms: int, t_ms: int) -> dict[str, Any]:
    """What a reader at ``t_ms`` gets from a value written at ``written_ms`` and renewed
    at each schedule's end, as the worker does."""
    base, schedule = ENGINE.schedule(state, written_ms)
    while (
        schedule is not None and schedule.until_us is not None and t_ms * 1000 >= schedule.until_us
    ):
        base, schedule = ENGINE.schedule(state, schedule.until_us // 1000)
    return in_force(base, schedule, t_ms)


def state_of(seed: int, steps: int, shift_ms: int = 0) -> dict[str, Any]:
    state: dict[str, Any] | None = None
    for message in stream(seed, steps):
        if message.get("row") and shift_ms:
            message = {**message, "row": {**message["row"], "at": message["row"]["at"] + shift_ms}}
        state, _ = ENGINE.apply(state, message)
    assert state is not None
    return state


def read_times(now: int, schedule: Schedule | None, rng: random.Random) -> list[int]:
    """``now``, each change and the millisecond before it, and random times until the
    schedule's end."""
    end = schedule.until_us // 1000 if schedule and schedule.until_us else now + 3 * DAY_MS
    times = [now, end - 1]
    for from_us, _ in schedule.patches if schedule is not None else ():
        times += [from_us // 1000 - 1, from_us // 1000]
    times += [rng.randrange(now, end) for _ in range(20)]
    return sorted(t for t in times if now <= t < end)


@pytest.mark.parametrize("seed", range(10))
def test_the_value_in_force_at_every_read_time_equals_a_recomputation_then(seed: int) -> None:
    rng = random.Random(seed)
    # Some streams sit around a New York midnight, one across the DST change (2026-11-01).
    shift = [0, 5 * 3600_000, 1_793_500_000_000 - T0][seed % 3]
    state = state_of(seed, 150, shift)
    newest = max(e[2] for e in state["rows"]["public.events"].values())
    for now in (newest - 15_000, newest - 1, newest, newest + 3_000, newest + 11 * 3600_000):
        base, schedule = ENGINE.schedule(state, now)
        assert schedule is not None and len(schedule.patches) <= SCHEDULE_SLOTS
        for t in read_times(now, schedule, rng):
            assert in_force(base, schedule, t) == oracle(ENGINE, state, at=t), (seed, now, t)


@pytest.mark.parametrize("seed", range(4))
def test_renewing_at_each_schedules_end_covers_all_time_and_counts_decay_to_zero(
    seed: int,
) -> None:
    """An entity that stops changing: its value is renewed at each schedule's end until
    nothing more changes; every window then reads empty."""
    rng = random.Random(seed)
    state = state_of(seed, 120)
    now = min(e[2] for e in state["rows"]["public.events"].values())
    renewals = 0
    while True:
        base, schedule = ENGINE.schedule(state, now)
        assert schedule is not None
        for t in read_times(now, schedule, rng):
            assert in_force(base, schedule, t) == oracle(ENGINE, state, at=t), (seed, now, t)
        if schedule.until_us is None:
            break
        assert schedule.until_us // 1000 > now  # every renewal moves time on
        now = schedule.until_us // 1000
        renewals += 1
        assert renewals < 1000
    last = in_force(base, schedule, now + 3 * DAY_MS)
    for name in ("n_10s", "views_10s", "items", "events_today", "buys_today_new_york"):
        assert last[name] == 0, name
    assert last["min_price"] is None and last["top_cat.1"] is None
    assert last["last_bought.1"] is not None or not any(  # unwindowed: kept for ever
        e[4].get("kind") == "buy" and e[4].get("item") is not None and not e[3]
        for e in state["rows"]["public.events"].values()
    )
    assert renewals > 1  # more changes than slots: the schedule was renewed


def test_a_days_count_is_zero_after_local_midnight_and_counts_the_day_up_to_the_read() -> None:
    new_york_midnight = 1_796_187_600_000  # 2026-12-02T00:00:00-05:00 (05:00 UTC)
    state: dict[str, Any] | None = None
    for lsn, minutes in enumerate((-90, -30, 10, 70), start=10):  # two before midnight, two after
        at = new_york_midnight + minutes * 60_000
        row = {"at": at, "kind": "buy", "price": 1.0, "item": 1, "cat": 7}
        message = {"t": "public.events", "e": "user", "id": 1, "pk": str(lsn), "lsn": lsn}
        state, _ = ENGINE.apply(state, message | {"seq": 0, "ts": at, "op": "c", "row": row})
    assert state is not None
    written = new_york_midnight - 60 * 60_000  # 23:00
    assert read(state, written, written)["buys_today_new_york"] == 1  # 22:30's; 23:30 is ahead
    assert read(state, written, new_york_midnight - 1)["buys_today_new_york"] == 2
    assert read(state, written, new_york_midnight)["buys_today_new_york"] == 0
    assert read(state, written, new_york_midnight + 10 * 60_000)["buys_today_new_york"] == 1
    assert read(state, written, new_york_midnight + 2 * DAY_MS)["buys_today_new_york"] == 0
    # All four fall on one UTC day, which ends at 19:00 New York time.
    assert read(state, written, new_york_midnight - 1)["events_today"] == 2
    assert read(state, written, new_york_midnight + 3 * 3600_000)["events_today"] == 4
    assert read(state, written, new_york_midnight + 19 * 3600_000)["events_today"] == 0


def test_an_entity_without_windows_has_no_schedule() -> None:
    state, _ = ENGINE.apply(
        None,
        {"t": "public.users", "e": "user", "id": 1, "pk": "1", "lsn": 5, "seq": 0, "ts": T0}
        | {"op": "c", "row": {"segment": 3}},
    )
    base, schedule = ENGINE.schedule(state, T0)
    assert base["segment"] == 3 and schedule is not None and schedule.patches == ()
    assert schedule.until_us is None  # nothing will change without a new event


def test_a_window_time_zone_is_checked_and_the_default_leaves_definitions_unchanged() -> None:
    def window(**extra: Any) -> WindowSettings:
        return WindowSettings.model_validate({"size": "1d", "type": "tumbling", **extra})

    assert window().key == (DAY_MS, "tumbling", "UTC")
    assert window(time_zone="Europe/London").key[2] == "Europe/London"
    with pytest.raises(ValidationError, match="'Mars/Olympus' is not an IANA time zone"):
        window(time_zone="Mars/Olympus")
    with pytest.raises(ValidationError, match="applies to tumbling windows only"):
        WindowSettings.model_validate({"size": "1h", "time_zone": "Europe/London"})
    # A definition deployed before time zones existed still equals today's (no change
    # to plan for every windowed feature); a zone is a changed definition.
    definitions = feature_definitions(ENGINE.settings)
    assert "time_zone" not in definitions["events_today"]
    assert '"time_zone": "America/New_York"' in definitions["buys_today_new_york"]


def test_a_state_recovered_from_the_changelog_gives_the_same_schedule() -> None:
    state = state_of(3, 150)
    recovered = {k: v for k, v in state.items()}  # a plain dict: no index yet
    newest = max(e[2] for e in state["rows"]["public.events"].values())
    for now in (newest - 5_000, newest + 9_000):
        assert ENGINE.schedule(recovered, now) == ENGINE.schedule(state, now)
