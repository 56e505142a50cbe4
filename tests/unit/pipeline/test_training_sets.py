"""Point-in-time training sets (pipeline.training): the vector as of each spine row's read
time, on small hand-built tables with hand-computed values: every aggregate kind, a DST
day in the entity's zone, nulls before the entity existed, no change committed after the
read time counted (a late event counts from its commit), and bad spines refused."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from connectors.database import COMMIT_MS
from edgefeed.settings import load_settings
from pipeline.envelope import Change
from pipeline.exceptions import TrainingSetError
from pipeline.settings import EntitySettings
from pipeline.training import META_VERSION, TrainingSet, changes_from_rows, write_training_set

ROOT = Path(__file__).resolve().parents[3]
SETTINGS = load_settings(ROOT / "examples" / "edgefeed.yaml", env={})
TABLES = SETTINGS.tables()
REGIONS = SETTINGS.region_names
T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
MIN = timedelta(minutes=1)


def ms(at: datetime) -> int:
    return int(at.timestamp() * 1000)


def user_row(committed: datetime, segment: int = 2) -> dict[str, Any]:
    return {
        "user_id": 7,
        "home_region": REGIONS[0],
        "country": "DE",
        "segment": segment,
        "signup_at": committed,
        COMMIT_MS: ms(committed),
    }


def event_row(
    event_id: int, kind: str, occurred: datetime, item: int, category: int, price: str, **kw: Any
) -> dict[str, Any]:
    committed = kw.get("committed", occurred)
    return {
        "event_id": event_id,
        "user_id": 7,
        "item_id": item,
        "category_id": category,
        "price": price,
        "home_region": REGIONS[0],
        "kind": kind,
        "occurred_at": occurred,
        COMMIT_MS: ms(committed),
    }


# User 7 signs up at T0; events in the 40 minutes after; event 6 happened at T0+25m but
# was committed at T0+50m (a late event).
ROWS = {
    "public.users": [user_row(T0)],
    "public.items": [],
    "public.events": [
        event_row(1, "view", T0 + 1 * MIN, 10, 1, "10.00"),
        event_row(2, "view", T0 + 2 * MIN, 11, 1, "30.00"),
        event_row(3, "click", T0 + 3 * MIN, 11, 1, "30.00"),
        event_row(4, "purchase", T0 + 4 * MIN, 12, 2, "25.50"),
        event_row(5, "view", T0 + 40 * MIN, 13, 2, "5.00"),
        event_row(6, "view", T0 + 25 * MIN, 14, 3, "100.00", committed=T0 + 50 * MIN),
    ],
}


def training(rows: dict[str, list[dict[str, Any]]] = ROWS, **kw: Any) -> TrainingSet:
    changes, notes = changes_from_rows(rows)
    return TrainingSet(SETTINGS.entities, TABLES, REGIONS, "user", changes, notes=notes, **kw)


def at(*times: datetime) -> list[dict[str, Any] | None]:
    return training().vectors(7, [ms(t) for t in times])


def test_before_the_entity_existed_every_feature_is_null_not_zero() -> None:
    before, just_after = at(T0 - MIN, T0)
    assert before is None
    assert just_after is not None and just_after["views_30m"] == 0  # it exists: counts are 0
    spine = pa.record_batch(
        {"user_id": [7], "ts": pa.array([T0 - MIN], pa.timestamp("us", tz="UTC"))}
    )
    (batch,) = training().batches([spine], "user_id", "ts")
    assert all(batch.column(f.name)[0].as_py() is None for f in training().features)


def test_every_aggregate_kind_as_of_a_read_time() -> None:
    (vector,) = at(T0 + 30 * MIN)
    assert vector is not None
    assert vector["segment"] == 2  # latest
    assert vector["views_30m"] == 2  # count: events 1, 2 (5 is later; 6 not committed yet)
    assert vector["clicks_30m"] == 1
    assert vector["purchases_today"] == 1
    assert vector["spend_today"] == pytest.approx(25.5)  # sum
    assert vector["avg_price_viewed_1h"] == pytest.approx(20.0)  # mean of 10, 30
    assert vector["max_price_viewed_1h"] == 30.0  # max
    assert vector["distinct_items_1h"] == 3  # distinct_count: 10, 11, 12
    assert [vector[f"last_items.{i}"] for i in range(1, 6)] == [12, 11, 11, 10, None]  # last_n
    assert [vector[f"top_categories_1h.{i}"] for i in (1, 2, 3)] == [1, 2, None]  # top_k


def test_windows_slide_with_the_read_time() -> None:
    # Read at +32m30s: the views at +1m and +2m have left the 30 minutes, the click stays.
    (late,) = at(T0 + 32 * MIN + timedelta(seconds=30))
    assert late is not None and late["views_30m"] == 0 and late["clicks_30m"] == 1
    (next_day,) = at(datetime(2026, 12, 2, 0, 1, tzinfo=UTC))  # tumbling day: a new day
    assert next_day is not None and next_day["purchases_today"] == 0
    assert next_day["spend_today"] == 0.0


def test_a_change_committed_after_the_read_time_never_counts_a_late_event_from_its_commit() -> None:
    before_commit, after_commit = at(T0 + 45 * MIN, T0 + 50 * MIN)
    assert before_commit is not None and after_commit is not None
    # Event 6 happened at +25m, inside the 30 minutes read at +45m, but was committed at +50m.
    assert before_commit["views_30m"] == 1  # event 5 only
    assert before_commit["max_price_viewed_1h"] == 30.0
    assert after_commit["views_30m"] == 2  # 5 and the late 6 (within (20m, 50m])
    assert after_commit["max_price_viewed_1h"] == 100.0
    # The current row version counts only from its commit: the segment is not leaked back.
    rows = {**ROWS, "public.users": [user_row(T0 + 35 * MIN, segment=3)]}
    early, late = training(rows).vectors(7, [ms(T0 + 30 * MIN), ms(T0 + 36 * MIN)])
    assert early is None and late is not None and late["segment"] == 3


def zoned_entities() -> list[EntitySettings]:
    user = SETTINGS.entities[0].model_dump()
    user["aggregates"] = [
        {
            "name": "purchases_today",
            "table": "public.events",
            "agg": "count",
            "where": {"kind": "purchase"},
            "window": {"size": "1d", "type": "tumbling", "time_zone": "America/New_York"},
        }
    ]
    return [EntitySettings.model_validate(user), *SETTINGS.entities[1:]]


def test_a_dst_day_in_the_entitys_zone_lasts_25_hours() -> None:
    zone = ZoneInfo("America/New_York")
    day_start = datetime(2026, 11, 1, 0, 30, tzinfo=zone)  # EDT; the clocks go back at 2:00
    day_end = datetime(2026, 11, 1, 23, 30, tzinfo=zone)  # EST: 24 real hours later
    assert day_end.astimezone(UTC) - day_start.astimezone(UTC) == timedelta(hours=24)
    rows = {
        "public.users": [user_row(day_start - timedelta(hours=1))],
        "public.items": [],
        "public.events": [
            event_row(1, "purchase", day_start, 1, 1, "1.00"),
            event_row(2, "purchase", day_end, 1, 1, "1.00"),
        ],
    }
    changes, _ = changes_from_rows(rows)
    history = TrainingSet(zoned_entities(), TABLES, REGIONS, "user", changes)
    reads = [
        day_end + 10 * MIN,  # both in the local day (a UTC day would hold only the second)
        datetime(2026, 11, 2, 0, 5, tzinfo=zone),  # the next local day
    ]
    same_day, next_day = history.vectors(7, [ms(t) for t in reads])
    assert same_day is not None and same_day["purchases_today"] == 2
    assert next_day is not None and next_day["purchases_today"] == 0


def spine_file(tmp_path: Path, **columns: Any) -> Path:
    path = tmp_path / "spine.parquet"
    pq.write_table(pa.table(columns), path)
    return path


def test_the_file_keeps_spine_order_and_labels_types_the_features_and_names_the_version(
    tmp_path: Path,
) -> None:
    # In batches of 2: user 7 goes on from one batch to the next, then back in time.
    times = [T0 + 30 * MIN, T0 - MIN, T0 + 45 * MIN, T0 + 50 * MIN, T0 + 30 * MIN, T0 + 30 * MIN]
    spine = spine_file(
        tmp_path,
        user_id=[7, 7, 7, 7, 8, 7],
        ts=pa.array(times, pa.timestamp("us", tz="UTC")),
        label=[1, 0, 1, 0, 1, 1],
    )
    out = tmp_path / "train.parquet"
    written = write_training_set(
        training(), spine, out, entity_column="user_id", time_column="ts", batch_rows=2
    )
    table = pq.read_table(out)
    assert written == table.num_rows == 6
    assert table.column("label").to_pylist() == [1, 0, 1, 0, 1, 1]
    assert table.column("views_30m").to_pylist() == [2, None, 1, 2, None, 2]  # 8: unknown
    assert table.schema.field("views_30m").type == pa.int64()
    assert table.schema.field("segment").type == pa.int32()
    assert table.schema.field("spend_today").type == pa.float32()
    assert table.schema.metadata[META_VERSION] == str(SETTINGS.entities[0].version).encode()
    assert not list(tmp_path.glob(".*partial"))


def test_bad_spines_and_versions_are_refused_naming_the_column_or_version(tmp_path: Path) -> None:
    stamps = pa.array([T0], pa.timestamp("us", tz="UTC"))
    out = tmp_path / "train.parquet"
    no_entity = spine_file(tmp_path, customer=[7], ts=stamps)
    with pytest.raises(TrainingSetError, match="no entity column 'user_id'"):
        write_training_set(training(), no_entity, out, entity_column="user_id", time_column="ts")
    naive = spine_file(tmp_path, user_id=[7], ts=pa.array([T0.replace(tzinfo=None)]))
    with pytest.raises(TrainingSetError, match=r"'ts' is timestamp.*not a timestamp with a time"):
        write_training_set(training(), naive, out, entity_column="user_id", time_column="ts")
    version = SETTINGS.entities[0].version
    with pytest.raises(TrainingSetError, match=f"version {version + 1} of 'user' no longer"):
        training(version=version + 1)
    with pytest.raises(TrainingSetError, match=r"'item' is shared.*--region"):
        TrainingSet(SETTINGS.entities, TABLES, REGIONS, "item", [])
    assert not out.exists()
    assert issubclass(TrainingSetError, ValueError)


def test_the_command_refuses_a_naive_spine_before_reading_the_database(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from edgefeed.cli import app

    naive = spine_file(tmp_path, user_id=[7], timestamp=pa.array([T0.replace(tzinfo=None)]))
    settings = ROOT / "examples" / "edgefeed.yaml"
    args = ["--settings", str(settings), "features", "history", "--entity", "user"]
    result = CliRunner().invoke(app, [*args, "--spine", str(naive), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())  # the console wraps lines
    assert "'timestamp' is timestamp[us], not a timestamp with a time zone" in said
    assert not (tmp_path / "o").exists()


def test_changes_with_every_version_give_each_version_from_its_commit_and_a_delete() -> None:
    """From the change topics (every version of a row, as the router read them): an
    update counts from its commit, a deleted user is not served after its delete."""
    row = {k: v for k, v in user_row(T0).items() if k not in (COMMIT_MS, "signup_at")}
    updated = {**row, "segment": 3}
    changes = [
        Change("public.users", "c", None, row, 10, 0, ms(T0)),
        Change("public.users", "u", row, updated, 20, 0, ms(T0 + 10 * MIN)),
        Change("public.users", "d", updated, None, 30, 0, ms(T0 + 20 * MIN)),
    ]
    history = TrainingSet(SETTINGS.entities, TABLES, REGIONS, "user", changes)
    first, second, gone = history.vectors(
        7, [ms(T0 + 5 * MIN), ms(T0 + 15 * MIN), ms(T0 + 25 * MIN)]
    )
    assert first is not None and first["segment"] == 2
    assert second is not None and second["segment"] == 3
    assert gone is None
