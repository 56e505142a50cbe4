"""Point-in-time training sets (pipeline.training, issue 32): rows/s of
``TrainingSet.batches`` over the demo's tables against what a data scientist would
write with pandas (cumulative sums and ``merge_asof`` per feature), in the same process.

The history is routed, then prepared once (the columnar engine replays it through the
workers' engine into row-version intervals: pipeline.training_columnar); both are timed
and printed apart from the spine's rows/s, and an end-to-end figure includes them.
``--check N`` compares the first N spine rows, all 17 features, with the reference
path (each entity's history replayed per batch); ``--replay`` times the reference.

The tables are the demo shop's (examples/edgefeed.yaml, the ``user`` entity: 17
features, every aggregate kind) generated in memory, so that the database's read is
not timed: ``--users`` users, ``--events`` events over one day, one in ten committed
``--late-s`` seconds after its event time (a late event). The spine: ``--spine`` rows
of a random user and a random read time in the day's second half.

pandas computes the 6 features merge_asof can express (the windowed counts, the daily
sum, the hourly mean); it reads event times, as such code usually does, so it counts a
late event before it was committed (leakage). Its values are compared with
edgefeed's: the rows that differ are counted, and with the late events taken out of
both the values must agree (checked, float32 rounding).

    .venv/bin/python benchmarks/history.py                       # 100k spine rows
    .venv/bin/python benchmarks/history.py --spine 1000000
    .venv/bin/python benchmarks/history.py --sorted   # the spine sorted by user and time
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

# benchmarks/pipeline.py would shadow the package: drop this folder from the path.
_HERE = str(Path(__file__).resolve().parent)
sys.path[:] = [p for p in sys.path if p not in ("", _HERE)]

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pyarrow as pa  # noqa: E402

from connectors.database import COMMIT_MS  # noqa: E402
from edgefeed.settings import load_settings  # noqa: E402
from pipeline.settings import EntitySettings  # noqa: E402
from pipeline.training import TrainingSet, changes_from_rows  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DAY0 = datetime(2026, 12, 1, tzinfo=UTC)
KINDS = ("view", "view", "view", "click", "add_to_cart", "purchase")
# feature -> (kind, window ms or "day", column or None: count)
PANDAS_FEATURES: dict[str, tuple[str, int | str, str | None]] = {
    "views_30m": ("view", 1_800_000, None),
    "clicks_30m": ("click", 1_800_000, None),
    "carts_1h": ("add_to_cart", 3_600_000, None),
    "purchases_today": ("purchase", "day", None),
    "spend_today": ("purchase", "day", "price"),
    "avg_price_viewed_1h": ("view", 3_600_000, "price"),
}


def tables(users: int, events: int, late_s: int, seed: int) -> dict[str, list[dict[str, Any]]]:
    rng = random.Random(seed)
    start_ms = int(DAY0.timestamp() * 1000)
    user_rows = [
        {"user_id": u, "home_region": "eu-west", "country": "DE", "segment": u % 4}
        | {COMMIT_MS: start_ms}
        for u in range(1, users + 1)
    ]
    event_rows = []
    for event_id in range(1, events + 1):
        at = start_ms + 1 + rng.randrange(86_399_000)
        item = rng.randrange(1, 500)
        event_rows.append(
            {
                "event_id": event_id,
                "user_id": rng.randrange(1, users + 1),
                "item_id": item,
                "category_id": item % 12,
                "price": f"{rng.uniform(2, 200):.2f}",
                "home_region": "eu-west",
                "kind": rng.choice(KINDS),
                "occurred_at": datetime.fromtimestamp(at / 1000, UTC),
                COMMIT_MS: at + (late_s * 1000 if rng.random() < 0.1 else 0),
            }
        )
    return {"public.users": user_rows, "public.items": [], "public.events": event_rows}


def spine_of(users: int, rows: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    start_us = int(DAY0.timestamp() * 1_000_000) + 43_200_000_000
    times = start_us + rng.integers(0, 43_200_000_000, rows)
    return pa.table(
        {
            "user_id": rng.integers(1, users + 1, rows),
            "timestamp": pa.array(times, pa.timestamp("us", tz="UTC")),
            "label": rng.integers(0, 2, rows),
        }
    )


def with_pandas(events: pd.DataFrame, spine: pd.DataFrame) -> pd.DataFrame:
    """The 6 features from event times: per feature, cumulative sums per user, read
    with merge_asof at the read time and at the window's start."""
    out = spine[["user_id", "t"]].copy()
    out["row"] = np.arange(len(out))
    ordered = out.sort_values("t")
    day = 86_400_000
    for name, (kind, window, column) in PANDAS_FEATURES.items():
        picked = events[events["kind"] == kind].sort_values("t")
        picked = picked.assign(
            n=picked.groupby("user_id").cumcount() + 1,
            s=picked.groupby("user_id")["price"].cumsum(),
        )[["t", "user_id", "n", "s"]]
        low = ordered["t"] - window if window != "day" else ordered["t"] - ordered["t"] % day - 1
        upto = pd.merge_asof(ordered, picked, on="t", by="user_id")
        before = pd.merge_asof(
            ordered.assign(t=low).sort_values("t"), picked, on="t", by="user_id"
        ).set_index("row")
        upto = upto.set_index("row")
        n = upto["n"].fillna(0) - before["n"].reindex(upto.index).fillna(0)
        s = upto["s"].fillna(0) - before["s"].reindex(upto.index).fillna(0)
        if column is None:
            value = n
        elif name.startswith("avg"):
            value = (s / n).where(n > 0)
        else:
            value = s
        out[name] = value.reindex(out["row"]).to_numpy()
    return out


def edgefeed_values(
    training: TrainingSet, spine: pa.Table, batch_rows: int, replay: bool = False
) -> pa.Table:
    batches = training.batches(spine.to_batches(batch_rows), "user_id", "timestamp", replay=replay)
    return pa.Table.from_batches(list(batches))


def pandas_features_only(entities: list[EntitySettings]) -> list[EntitySettings]:
    """The demo's user with only the 6 features pandas computes (a like-for-like run)."""
    user = entities[0].model_dump()
    user["latest"] = []
    user["aggregates"] = [a for a in user["aggregates"] if a["name"] in PANDAS_FEATURES]
    return [EntitySettings.model_validate(user), *entities[1:]]


def unequal_to_reference(training: TrainingSet, spine: pa.Table, batch_rows: int) -> int:
    """Cells where the columnar engine and the reference replay differ (0: none)."""
    fast = edgefeed_values(training, spine, batch_rows)
    slow = edgefeed_values(training, spine, batch_rows, replay=True)
    return sum(
        a != b for name in fast.column_names for a, b in zip(fast[name], slow[name], strict=True)
    )


def differing(ours: pa.Table, theirs: pd.DataFrame) -> dict[str, int]:
    counts = {}
    for name in PANDAS_FEATURES:
        mine = ours.column(name).to_numpy(zero_copy_only=False).astype("float64")
        other = theirs[name].to_numpy().astype("float32").astype("float64")
        both_missing = np.isnan(mine) & np.isnan(other)
        counts[name] = int(np.sum(~both_missing & ~np.isclose(mine, other, rtol=1e-6)))
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=2_000)
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--spine", type=int, default=100_000)
    parser.add_argument("--late-s", type=int, default=300)
    parser.add_argument("--batch-rows", type=int, default=65_536)
    parser.add_argument(
        "--sorted", action="store_true", help="Sort the spine by user and time first."
    )
    parser.add_argument(
        "--replay", action="store_true", help="Time the reference path (replay per batch)."
    )
    parser.add_argument(
        "--check", type=int, default=0, help="Compare N spine rows with the reference path."
    )
    args = parser.parse_args()
    settings = load_settings(ROOT / "examples" / "edgefeed.yaml", env={})
    rows = tables(args.users, args.events, args.late_s, seed=32)
    spine = spine_of(args.users, args.spine, seed=32)
    if args.sorted:
        spine = spine.sort_by([("user_id", "ascending"), ("timestamp", "ascending")])
    print(
        f"{platform.node()} {platform.processor() or platform.machine()}, Python "
        f"{platform.python_version()}, pandas {pd.__version__}, pyarrow {pa.__version__}; "
        f"{args.users:,} users, {args.events:,} events (10% late by {args.late_s} s), "
        f"spine {args.spine:,} rows{' sorted by user and time' if args.sorted else ''}, "
        f"batches of {args.batch_rows:,}"
    )

    started = time.perf_counter()
    changes, _ = changes_from_rows(rows)
    training = TrainingSet(settings.entities, settings.tables(), ["eu-west"], "user", changes)
    loaded = time.perf_counter() - started
    started = time.perf_counter()
    prepared = 0.0
    if not args.replay:
        if training.columnar() is None:
            sys.exit(f"the columnar engine refused the demo: {training.replay_reason}")
        prepared = time.perf_counter() - started
    started = time.perf_counter()
    ours = edgefeed_values(training, spine, args.batch_rows, replay=args.replay)
    ours_s = time.perf_counter() - started

    events = pd.DataFrame(
        {
            "user_id": [r["user_id"] for r in rows["public.events"]],
            "kind": [r["kind"] for r in rows["public.events"]],
            "price": [float(r["price"]) for r in rows["public.events"]],
            "t": [int(r["occurred_at"].timestamp() * 1000) for r in rows["public.events"]],
        }
    )
    frame = pd.DataFrame(
        {
            "user_id": spine.column("user_id").to_numpy(),
            "t": spine.column("timestamp").cast(pa.int64()).to_numpy() // 1000,
        }
    )
    started = time.perf_counter()
    theirs = with_pandas(events, frame)
    pandas_s = time.perf_counter() - started
    wrong = differing(ours, theirs)
    same_s = None
    if not args.replay:  # like for like: the columnar engine with pandas' 6 features
        six = TrainingSet(
            pandas_features_only(settings.entities), settings.tables(), ["eu-west"], "user", changes
        )
        six.columnar()
        started = time.perf_counter()
        same = edgefeed_values(six, spine, args.batch_rows)
        same_s = time.perf_counter() - started
        assert differing(same, theirs) == wrong, "the 6 features differ from the 17's"

    # Without the late events, the pandas values must be edgefeed's (a check of both).
    late = np.array(
        [r[COMMIT_MS] != t for r, t in zip(rows["public.events"], events["t"], strict=True)]
    )
    on_time = {
        **rows,
        "public.events": [r for r, x in zip(rows["public.events"], late, strict=True) if not x],
    }
    exact = TrainingSet(
        settings.entities, settings.tables(), ["eu-west"], "user", changes_from_rows(on_time)[0]
    )
    agree = differing(
        edgefeed_values(exact, spine, args.batch_rows), with_pandas(events[~late], frame)
    )
    assert not any(agree.values()), f"without late events pandas and edgefeed differ: {agree}"

    n = args.spine
    path = "reference replay" if args.replay else "columnar"
    print(
        f"edgefeed  17 features: {n / ours_s:>10,.0f} rows/s ({ours_s:.2f} s, {path}; "
        f"history routed in {loaded:.2f} s, prepared in {prepared:.2f} s)"
    )
    print(f"pandas     6 features: {n / pandas_s:>10,.0f} rows/s ({pandas_s:.2f} s)")
    print(f"ratio (edgefeed/pandas rows/s): {pandas_s / ours_s:.2f}x")
    if same_s is not None:
        print(
            f"edgefeed   6 features: {n / same_s:>10,.0f} rows/s ({same_s:.2f} s; pandas' "
            f"features only): ratio {pandas_s / same_s:.2f}x"
        )
    whole = ours_s + prepared + loaded
    print(
        f"end to end (routing + preparation + spine): {n / whole:,.0f} rows/s, "
        f"{pandas_s / whole:.2f}x pandas"
    )
    if args.check:
        cells = unequal_to_reference(training, spine.slice(0, args.check), args.batch_rows)
        assert not cells, f"{cells} cells differ from the reference replay"
        print(f"the first {min(args.check, n):,} rows equal the reference replay (all features)")
    print(f"load average {os.getloadavg()[0]:.2f}")
    print(
        "pandas rows differing (late events counted before their commit): "
        + ", ".join(f"{k} {v:,}" for k, v in wrong.items())
    )
    print("without the late events: pandas equals edgefeed on all 6 features")


if __name__ == "__main__":
    main()
