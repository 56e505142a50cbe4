"""The pipeline's pure logic: decoding, residency routing, and feature computation."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from connectors.settings import TableSettings
from edge_cache import Delete, Upsert
from edgefeed.settings import SettingsError, load_settings, settings_from_mapping
from pipeline.envelope import decode_change
from pipeline.exceptions import FeatureConfigError, PoisonEventError
from pipeline.features import FeatureEngine, event_time_ms
from pipeline.routing import Router
from pipeline.settings import AggregateFeature, EntitySettings
from pipeline.validate import check_feature_columns

ROOT = Path(__file__).resolve().parents[3]
SETTINGS = load_settings(ROOT / "examples" / "edgefeed.yaml", env={})
REGIONS = SETTINGS.region_names
T0 = 1_764_000_000_000  # ms


def envelope(
    table: str, op: str, before: Any, after: Any, lsn: int, ts: int = T0, schema: bool = False
) -> bytes:
    body = {
        "op": op,
        "before": before,
        "after": after,
        "source": {"ts_ms": ts, "schema": "public", "table": table, "lsn": lsn},
    }
    if schema:
        body = {"schema": {"type": "struct"}, "payload": body}
    return json.dumps(body).encode()


# -- envelope ------------------------------------------------------------------------------


def test_decode_all_ops_with_and_without_schema() -> None:
    created = decode_change(envelope("users", "c", None, {"user_id": 1}, 100), offset=5)
    assert created is not None
    assert (created.table, created.op, created.lsn, created.seq) == ("public.users", "c", 100, 0)
    wrapped = decode_change(
        envelope("users", "u", {"user_id": 1}, {"user_id": 1}, 101, schema=True)
    )
    assert wrapped is not None and wrapped.op == "u" and wrapped.before == {"user_id": 1}
    snap = decode_change(envelope("users", "r", None, {"user_id": 1}, 50), offset=7)
    assert snap is not None and snap.seq == 7  # snapshot rows share an LSN: offset orders them
    deleted = decode_change(envelope("users", "d", {"user_id": 1}, None, 102))
    assert deleted is not None and deleted.row == {"user_id": 1}
    truncated = decode_change(envelope("users", "t", None, None, 103))
    assert truncated is not None and truncated.op == "t"
    assert decode_change(b"") is None  # tombstone


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (b"{not json", "not JSON"),
        (b"[1,2]", "not a JSON object"),
        (json.dumps({"op": "c", "after": {}}).encode(), "source"),
        (json.dumps({"op": "z", "source": {"ts_ms": 1, "table": "t"}}).encode(), "op"),
        (json.dumps({"op": "c", "source": {"ts_ms": 1, "table": "t"}}).encode(), "'after'"),
    ],
)
def test_undecodable_values_are_poison(value: bytes, reason: str) -> None:
    with pytest.raises(PoisonEventError, match=reason) as info:
        decode_change(value)
    assert info.value.reason == "undecodable"


# -- routing -------------------------------------------------------------------------------


def router() -> Router:
    return Router(SETTINGS.entities, SETTINGS.tables(), REGIONS)


def change(table: str, op: str, before: Any, after: Any, lsn: int = 200) -> Any:
    decoded = decode_change(envelope(table, op, before, after, lsn))
    assert decoded is not None
    return decoded


def test_personal_data_goes_only_to_its_home_region() -> None:
    row = {"event_id": 1, "user_id": 7, "item_id": 3, "home_region": "eu-west", "kind": "view"}
    messages = router().route(change("events", "c", None, row))
    assert {(m.region, m.key) for m in messages} == {("eu-west", "user:7"), ("eu-west", "item:3")}


def test_shared_data_goes_to_every_region() -> None:
    messages = router().route(change("items", "u", None, {"item_id": 3, "price": "2.50"}))
    assert sorted(m.region for m in messages) == sorted(REGIONS)
    assert {m.key for m in messages} == {"item:3"}


def test_home_region_change_evicts_the_entity_from_the_old_region() -> None:
    before = {"user_id": 7, "home_region": "eu-west", "country": "DE"}
    after = {"user_id": 7, "home_region": "us-east", "country": "US"}
    messages = router().route(change("users", "u", before, after))
    by_region = {m.region: m.value["op"] for m in messages}
    assert by_region == {"us-east": "u", "eu-west": "x"}


def test_own_row_delete_removes_the_entity() -> None:
    before = {"user_id": 7, "home_region": "eu-west"}
    messages = router().route(change("users", "d", before, None))
    assert [(m.region, m.value["op"]) for m in messages] == [("eu-west", "x")]


def test_truncate_reaches_every_region_and_partition() -> None:
    messages = router().route(change("events", "t", None, None))
    assert sorted(m.region for m in messages) == sorted(REGIONS)
    assert all(m.key is None for m in messages)


def test_unknown_tables_are_ignored() -> None:
    assert router().route(change("audit_log", "c", None, {"id": 1})) == []


@pytest.mark.parametrize(
    ("table", "row", "reason", "text"),
    [
        (
            "events",
            {"event_id": 1, "user_id": 7, "item_id": 3, "home_region": "mars"},
            "unknown-region",
            "'mars' not in regions: eu-west, us-east, ap-southeast",
        ),
        (
            "events",
            {"event_id": 1, "user_id": 7, "item_id": 3},
            "missing-home-region",
            "replica_identity: full",
        ),
        (
            "events",
            {"user_id": 7, "item_id": 3, "home_region": "eu-west"},
            "missing-key",
            "'event_id'",
        ),
        (
            "events",
            {"event_id": 1, "item_id": 3, "home_region": "eu-west"},
            "missing-key",
            "'user_id'",
        ),
    ],
)
def test_unroutable_rows_are_poison(
    table: str, row: dict[str, Any], reason: str, text: str
) -> None:
    with pytest.raises(PoisonEventError, match=text) as info:
        router().route(change(table, "c", None, row))
    assert info.value.reason == reason


# -- features ------------------------------------------------------------------------------

ENGINE = FeatureEngine(SETTINGS.entities)


def event_message(
    event_id: int,
    lsn: int,
    kind: str,
    item: int,
    category: int,
    price: str,
    minutes_ago: float,
    user: int = 7,
    ref_ms: int = T0,
) -> dict[str, Any]:
    occurred = ref_ms - int(minutes_ago * 60_000)
    row = {
        "event_id": event_id,
        "user_id": user,
        "item_id": item,
        "category_id": category,
        "price": price,
        "home_region": "eu-west",
        "kind": kind,
        "occurred_at": occurred * 1000,
    }  # MicroTimestamp
    return {
        "t": "public.events",
        "lsn": lsn,
        "seq": 0,
        "ts": occurred,
        "e": "user",
        "id": user,
        "pk": str(event_id),
        "op": "c",
        "row": row,
    }


def user_row_message(lsn: int, segment: int, op: str = "c") -> dict[str, Any]:
    row = {"user_id": 7, "home_region": "eu-west", "country": "DE", "segment": segment}
    return {
        "t": "public.users",
        "lsn": lsn,
        "seq": 0,
        "ts": T0,
        "e": "user",
        "id": 7,
        "pk": "7",
        "op": op,
        "row": row if op != "x" else None,
    }


def scenario() -> list[dict[str, Any]]:
    return [
        user_row_message(10, segment=1),
        event_message(1, 11, "view", 100, 5, "10.00", minutes_ago=50),  # outside 30m
        event_message(2, 12, "view", 101, 5, "20.00", minutes_ago=20),
        event_message(3, 13, "view", 102, 6, "30.00", minutes_ago=10),
        event_message(4, 14, "click", 102, 6, "30.00", minutes_ago=9),
        event_message(5, 15, "purchase", 102, 6, "30.00", minutes_ago=5),
        event_message(6, 16, "view", 103, 6, "5.50", minutes_ago=0),
        user_row_message(17, segment=3, op="u"),
    ]


def run(messages: list[dict[str, Any]]) -> dict[str, Any] | None:
    engine = ENGINE.engine("user")
    state: dict[str, Any] | None = None
    for message in messages:
        state, _ = engine.apply(state, json.loads(json.dumps(message)))
    return state


def test_windowed_features_are_exact() -> None:
    state = run(scenario())
    assert state is not None
    vector = ENGINE.engine("user").vector(state)
    assert vector["segment"] == 3
    assert vector["views_30m"] == 3  # events 2, 3, 6; event 1 is 50 minutes old
    assert vector["clicks_30m"] == 1
    assert vector["purchases_today"] == 1
    assert vector["spend_today"] == 30.0
    assert vector["avg_price_viewed_1h"] == pytest.approx((10 + 20 + 30 + 5.5) / 4)
    assert vector["max_price_viewed_1h"] == 30.0
    assert vector["distinct_items_1h"] == 4
    assert [vector[f"last_items.{i}"] for i in range(1, 6)] == [103, 102, 102, 102, 101]
    # category 6: 4 events; category 5: 2 events
    assert [vector[f"top_categories_1h.{i}"] for i in (1, 2, 3)] == [6, 5, None]


def test_duplicates_and_reordering_leave_the_same_state() -> None:
    expected = run(scenario())
    rng = random.Random(7)
    for _ in range(30):
        messages = scenario() + rng.sample(scenario(), 4)  # redeliveries
        rng.shuffle(messages)
        state = run(messages)
        assert state is not None and expected is not None
        assert ENGINE.engine("user").vector(state) == ENGINE.engine("user").vector(expected)
        assert state["rows"] == expected["rows"]
        assert state["lsn"] == expected["lsn"]


def test_every_state_change_gets_a_later_cache_position() -> None:
    engine = ENGINE.engine("user")
    state: dict[str, Any] | None = None
    positions = []
    # Out of order: the later LSN first, then an earlier event that still changes the vector.
    for message in [scenario()[2], scenario()[1]]:
        state, changed = engine.apply(state, message)
        assert changed and state is not None
        op = engine.write_op(7, state)
        positions.append((op.position.lsn, op.position.seq))
    assert positions[1] > positions[0]


def test_row_delete_and_entity_removal() -> None:
    engine = ENGINE.engine("user")
    messages = scenario()
    deleted_event = dict(messages[3], op="d", row=None, lsn=20)
    state = run([*messages, deleted_event])
    assert state is not None and engine.vector(state)["views_30m"] == 2
    gone = dict(user_row_message(30, 0), op="x")
    state, changed = engine.apply(state, gone)
    assert changed and state is not None
    assert isinstance(engine.write_op(7, state), Delete)
    # A late, older event of the removed user does not bring it back.
    state, changed = engine.apply(state, messages[5])
    assert not changed
    assert isinstance(engine.write_op(7, state), Delete)
    # A newer event does (the id is in use again).
    state, changed = engine.apply(state, dict(messages[5], lsn=31, pk="99"))
    assert changed and state is not None and isinstance(engine.write_op(7, state), Upsert)


def test_old_rows_are_pruned_but_windows_stay_exact() -> None:
    engine = ENGINE.engine("user")
    messages = [
        event_message(i, 100 + i, "view", 100 + i, 1, "1.00", minutes_ago=3000 - i * 60)
        for i in range(50)
    ]
    state = run(messages)
    assert state is not None
    # Largest window is 1 day, last_n keeps 5: everything older than a day is gone.
    assert len(state["rows"]["public.events"]) < 30
    assert engine.vector(state)["views_30m"] == 1


def test_wrong_types_are_poison() -> None:
    engine = ENGINE.engine("user")
    bad = event_message(1, 11, "view", 100, 5, "ten euros", minutes_ago=1)
    with pytest.raises(PoisonEventError, match=r"'ten euros' is not a valid float64") as info:
        engine.apply(None, bad)
    assert info.value.reason == "wrong-type"


def test_event_time_units() -> None:
    assert event_time_ms(1_764_000_000_000_000, 0) == 1_764_000_000_000  # µs
    assert event_time_ms(1_764_000_000_000, 0) == 1_764_000_000_000  # ms
    assert event_time_ms("2025-11-24T16:00:00Z", 0) == 1_764_000_000_000
    assert event_time_ms(None, 42) == 42


# -- settings ------------------------------------------------------------------------------


def test_feature_settings_errors_name_the_problem() -> None:
    with pytest.raises(ValidationError, match="needs a window"):
        AggregateFeature(name="views", table="events", agg="count")
    with pytest.raises(ValidationError, match="count"):
        AggregateFeature(
            name="views",
            table="events",
            agg="median",
            column="x",  # type: ignore[arg-type]
            window={"size": "1h"},
        )
    with pytest.raises(ValidationError, match="must be like 500ms"):
        AggregateFeature(name="v", table="events", agg="count", window={"size": "soon"})
    with pytest.raises(ValidationError, match="not in its tables"):
        EntitySettings(
            name="user",
            tables={"users": "user_id"},
            aggregates=[
                AggregateFeature(name="v", table="events", agg="count", window={"size": "1h"})
            ],
        )


def test_entity_reading_an_uncaptured_table_is_refused() -> None:
    mapping = SETTINGS.model_dump(mode="json")
    mapping["database"]["password"] = "x"
    mapping["entities"][0]["tables"]["public.sessions"] = "user_id"
    with pytest.raises(SettingsError, match=r"public\.sessions, which no source captures"):
        settings_from_mapping(mapping)


def test_missing_column_is_reported_at_start() -> None:
    columns = {
        "public.users": {"user_id", "home_region", "segment"},
        "public.events": {"event_id", "user_id", "item_id", "kind", "occurred_at", "category_id"},
        "public.items": {"item_id", "category_id", "price"},
    }
    with pytest.raises(FeatureConfigError, match=r"reads column 'price', which public.events"):
        check_feature_columns(SETTINGS.entities, columns)


def test_schemas_follow_the_declarations() -> None:
    user = ENGINE.engine("user").schema
    assert user.personal and user.names[0] == "segment"
    assert "top_categories_1h.3" in user.names
    assert not ENGINE.engine("item").schema.personal
    table = TableSettings(name="x", key=["id"])
    assert table.name == "public.x"
    assert list(itertools.islice(user.names, 2)) == ["segment", "views_30m"]
