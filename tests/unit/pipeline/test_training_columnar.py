"""The columnar engine of training sets (pipeline.training_columnar) against the reference:
each entity's history replayed through the workers' engine per spine row
(``TrainingSet.batches(replay=True)``). On random histories (inserts, updates and
deletes, late events, equal commit and event times, a day across a DST change) and
random spines (read times on window edges, before an entity existed, unknown ids),
every feature of every row must be equal: every aggregate kind, sliding, tumbling,
zoned and unbounded windows."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgefeed.settings import load_settings
from pipeline import training_columnar
from pipeline.envelope import Change
from pipeline.settings import EntitySettings
from pipeline.training import TrainingSet
from pipeline.training_columnar import _exact_sums, _limbs

ROOT = Path(__file__).resolve().parents[3]
SETTINGS = load_settings(ROOT / "examples" / "edgefeed.yaml", env={})
TABLES = SETTINGS.tables()
REGIONS = SETTINGS.region_names
# 2026-11-01 04:00 UTC: midnight in New York on the day its clocks go back (25 hours).
DAY = int(datetime(2026, 11, 1, 4, 0, tzinfo=UTC).timestamp() * 1000)
MIN = 60_000
HOUR = 60 * MIN
EXTRA = [
    {"name": "min_price_1h", "table": "public.events", "agg": "min", "column": "price",
     "window": {"size": "1h"}},
    {"name": "spend_2h", "table": "public.events", "agg": "sum", "column": "price",
     "window": {"size": "2h"}, "dtype": "float64"},
    {"name": "mean_price_ny_day", "table": "public.events", "agg": "mean", "column": "price",
     "dtype": "float64",
     "window": {"size": "1d", "type": "tumbling", "time_zone": "America/New_York"}},
    {"name": "views_ny_day", "table": "public.events", "agg": "count", "where": {"kind": "view"},
     "window": {"size": "1d", "type": "tumbling", "time_zone": "America/New_York"},
     "dtype": "int32"},
    {"name": "items_ever", "table": "public.events", "agg": "last_n", "column": "item_id",
     "n": 2},
    {"name": "top_items_2h", "table": "public.events", "agg": "top_k", "column": "item_id",
     "n": 2, "where": {"kind": "view"}, "window": {"size": "2h"}},
    {"name": "distinct_cats_30m", "table": "public.events", "agg": "distinct_count",
     "column": "category_id", "window": {"size": "30m"}},
]  # fmt: skip


def entities() -> list[EntitySettings]:
    user = SETTINGS.entities[0].model_dump()
    user["aggregates"] = [*user["aggregates"], *EXTRA]
    return [EntitySettings.model_validate(user), *SETTINGS.entities[1:]]


ENTITIES = entities()
PRICES = st.one_of(
    st.sampled_from(["0.05", "2.37", "19.99", "199.99", "1e-3", "0", "-4.5"]),
    st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_subnormal=False).map(
        lambda f: repr(abs(f) if f == 0 else f)  # no -0.0: its sign in a max is order-bound
    ),
)
EVENTS = st.lists(
    st.tuples(
        st.integers(1, 3),  # user
        st.sampled_from(["view", "view", "click", "add_to_cart", "purchase"]),
        st.integers(0, 30 * 60).map(lambda m: m * MIN),  # event time after DAY
        st.sampled_from([-1, 0, 0, 0, 1]),  # ms off the minute: equal times and edges
        st.sampled_from([0, 0, 0, 1, 5 * MIN, 40 * MIN, 3 * HOUR]),  # late by
        st.integers(1, 4),  # item
        PRICES,
        st.sampled_from([None, None, None, "update", "delete"]),
        st.integers(0, 90).map(lambda m: m * MIN),  # then, after
    ),
    max_size=40,
)
USERS = st.lists(
    st.tuples(
        st.integers(0, 26 * 60).map(lambda m: m * MIN),  # created
        st.sampled_from([None, None, "update", "delete"]),
        st.integers(1, 600).map(lambda m: m * MIN),  # then, after
    ),
    min_size=3,
    max_size=3,
)


def changes_of(users: list[Any], events: list[Any]) -> list[Change]:
    """Changes in commit order, positions growing with it (as in the WAL)."""
    stamped: list[tuple[int, int, str, str, dict[str, Any] | None, dict[str, Any] | None]] = []
    for uid, (created, then, after) in enumerate(users, start=1):
        row = {"user_id": uid, "home_region": REGIONS[0], "country": "DE", "segment": uid}
        stamped.append((DAY + created, len(stamped), "public.users", "c", None, row))
        if then == "update":
            new = {**row, "segment": uid + 10}
            stamped.append((DAY + created + after, len(stamped), "public.users", "u", row, new))
        elif then == "delete":
            stamped.append((DAY + created + after, len(stamped), "public.users", "d", row, None))
    for eid, (uid, kind, at, off, late, item, price, then, after) in enumerate(events, 1):
        event_ms = DAY + at + off
        row = {
            "event_id": eid,
            "user_id": uid,
            "item_id": item,
            "category_id": item % 3,
            "price": price,
            "home_region": REGIONS[0],
            "kind": kind,
            "occurred_at": event_ms * 1000,  # microseconds, as Debezium's MicroTimestamp
        }
        committed = event_ms + late
        stamped.append((committed, len(stamped), "public.events", "c", None, row))
        if then == "update":
            new = {**row, "price": "7.25", "kind": "view", "item_id": item % 4 + 1}
            stamped.append((committed + after, len(stamped), "public.events", "u", row, new))
        elif then == "delete":
            stamped.append((committed + after, len(stamped), "public.events", "d", row, None))
    stamped.sort(key=lambda s: (s[0], s[1]))
    return [
        Change(table, op, before, after, lsn, 0, commit)
        for lsn, (commit, _, table, op, before, after) in enumerate(stamped, start=1)
    ]


def spine_of(changes: list[Change], extra: list[int]) -> pa.RecordBatch:
    """Read times on every edge the history has: commits, event times, the windows'
    ends (30 m, 1 h, 2 h, 1 d), one ms either side; plus random ones."""
    times = list(extra)
    for change in changes:
        row = change.after or change.before or {}
        edges = [change.commit_ms]
        if "occurred_at" in row:
            event = row["occurred_at"] // 1000
            edges += [event + size for size in (0, 30 * MIN, HOUR, 2 * HOUR, 24 * HOUR)]
        times += [t + d for t in edges for d in (-1, 0, 1)]
    times += [DAY - 1, DAY, DAY + 25 * HOUR - 1, DAY + 25 * HOUR]  # the local day's ends
    users = [(i % 4) + 1 for i in range(len(times))]  # user 4 never exists
    return pa.record_batch(
        {
            "user_id": pa.array(users, pa.int64()),
            "timestamp": pa.array([t * 1000 for t in times], pa.timestamp("us", tz="UTC")),
        }
    )


def both(changes: list[Change], spine: pa.RecordBatch, batch_rows: int) -> tuple[Any, Any]:
    history = TrainingSet(ENTITIES, TABLES, REGIONS, "user", changes)
    assert history.columnar() is not None, history.replay_reason
    batches = [spine.slice(i, batch_rows) for i in range(0, spine.num_rows, batch_rows)]
    fast = pa.Table.from_batches(list(history.batches(batches, "user_id", "timestamp")))
    slow = pa.Table.from_batches(
        list(history.batches(batches, "user_id", "timestamp", replay=True))
    )
    return fast, slow


def assert_equal(fast: pa.Table, slow: pa.Table) -> None:
    assert fast.schema == slow.schema
    for name in fast.column_names:
        got, want = fast.column(name).to_pylist(), slow.column(name).to_pylist()
        wrong = [(i, g, w) for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]
        assert not wrong, f"{name}: (row, columnar, reference) {wrong[:5]}"


@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    users=USERS,
    events=EVENTS,
    extra=st.lists(st.integers(DAY - HOUR, DAY + 40 * HOUR), max_size=20),
    batch_rows=st.sampled_from([7, 64, 100_000]),
)
def test_the_columnar_engine_equals_the_reference_replay(
    users: list[Any], events: list[Any], extra: list[int], batch_rows: int
) -> None:
    changes = changes_of(users, events)
    assert_equal(*both(changes, spine_of(changes, extra), batch_rows))


@pytest.mark.parametrize("dense", [(0, 0), (1 << 40, 1 << 40)], ids=["sorted", "dense"])
def test_a_hand_built_history_with_every_case_at_once(
    dense: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cases the property test draws, all together, so one run always has them;
    top_k by both of its ways (a table of few values, or sorting)."""
    monkeypatch.setattr(training_columnar, "DENSE_TOP_K", dense)
    users = [(0, "update", 90 * MIN), (10 * MIN, "delete", 200 * MIN), (5 * HOUR, None, MIN)]
    events = [
        (1, "view", 5 * MIN, 0, 0, 1, "2.37", None, 0),
        (1, "view", 5 * MIN, 0, 0, 2, "19.99", None, 0),  # an equal event time
        (1, "view", 6 * MIN, -1, 40 * MIN, 3, "0.05", None, 0),  # late
        (1, "purchase", 7 * MIN, 1, 0, 1, "199.99", "update", 20 * MIN),
        (2, "view", 20 * MIN, 0, 0, 4, "1e-3", "delete", 5 * MIN),
        (2, "click", 25 * HOUR - MIN, 0, 3 * HOUR, 4, "-4.5", None, 0),  # late, next day
        (3, "view", 4 * HOUR, 0, 0, 2, "1e300", None, 0),  # before user 3 exists
    ]
    changes = changes_of(users, events)
    fast, slow = both(changes, spine_of(changes, []), 5)
    assert_equal(fast, slow)
    assert fast.column("views_30m").null_count < fast.num_rows  # not all null
    assert max(v or 0 for v in fast.column("views_30m").to_pylist()) >= 2
    assert fast.column("top_items_2h.2").null_count < fast.num_rows  # ranks were compared


@pytest.mark.parametrize("seed", range(6))
def test_exact_sums_and_means_round_once_like_the_engines_integers(seed: int) -> None:
    """Sums and means of random windows of float64 values over ranges from 2**-1000 to
    2**1000 equal Python's exact integer arithmetic (the engine's), rounded once."""
    rng = np.random.default_rng(seed)
    scale = [1.0, 1e-3, 1e12, 1e-300, 1e300, 3.0][seed]
    values = np.round(rng.standard_normal(80) * 100, 2) * scale
    values[::7] *= 10.0 ** rng.integers(-8, 8, len(values[::7]))
    limbs, emin = _limbs(values)
    sums = [np.concatenate([[0], np.cumsum(x)]) for x in limbs]
    lo = rng.integers(0, 60, 200)
    hi = lo + rng.integers(0, 20, 200)
    for mean in (False, True):
        got, null = _exact_sums([c[hi] - c[lo] for c in sums], hi - lo, emin, mean)
        for k in range(200):
            exact = sum(
                n * (2**1074 // d) for n, d in (v.as_integer_ratio() for v in values[lo[k] : hi[k]])
            )
            count = int(hi[k] - lo[k])
            try:
                want = (exact / (count * 2**1074) if count else None) if mean else exact / 2**1074
            except OverflowError:
                want = None
            assert (None if null[k] else float(got[k])) == want, (mean, k)
