"""Values that once passed validation and crashed a region later (at the Redis or the
changelog write), positions that deletes and truncates ignored, and the one rule for
non-finite numbers (issue: reliability under hostile events)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from edge_cache import Delete, Upsert
from edge_cache.layout import RecordLayout, to_micros
from edgefeed.settings import load_settings
from pipeline.envelope import decode_change
from pipeline.exceptions import PoisonEventError
from pipeline.features import FeatureEngine
from pipeline.messages import MAX_CHANGE_BYTES, RegionalChange
from pipeline.routing import Router

ROOT = Path(__file__).resolve().parents[3]
SETTINGS = load_settings(ROOT / "examples" / "edgefeed.yaml", env={})
ENGINE = FeatureEngine(SETTINGS.entities)
USER, ITEM = ENGINE.engine("user"), ENGINE.engine("item")
T0 = 1_764_000_000_000


def user_row(lsn: int, **row: Any) -> dict[str, Any]:
    body = {"user_id": 7, "home_region": "eu-west", "segment": 1, **row}
    return {"t": "public.users", "op": "u", "lsn": lsn, "seq": 0, "ts": T0, "e": "user",
            "id": 7, "pk": "7", "row": body}  # fmt: skip


def item_row(lsn: int, **row: Any) -> dict[str, Any]:
    body = {"item_id": 3, "price": 2.5, "category_id": 4, **row}
    return {"t": "public.items", "op": "u", "lsn": lsn, "seq": 0, "ts": T0, "e": "item",
            "id": 3, "pk": "3", "row": body}  # fmt: skip


def event(lsn: int, event_id: int, **row: Any) -> dict[str, Any]:
    body = {"event_id": event_id, "user_id": 7, "item_id": 3, "category_id": 4, "price": "1.0",
            "home_region": "eu-west", "kind": "view", "occurred_at": T0 * 1000, **row}  # fmt: skip
    return {"t": "public.events", "op": "c", "lsn": lsn, "seq": 0, "ts": T0, "e": "user",
            "id": 7, "pk": str(event_id), "row": body}  # fmt: skip


def encodable(engine: Any, state: Any) -> None:
    """What the worker does with a state: the vector into the cache's value format,
    the state into the changelog (JSON)."""
    op = engine.write_op(7, state)
    if isinstance(op, Upsert):
        RecordLayout(engine.schema).encode(op.values, op.position, to_micros(op.commit_time), 0)
    orjson.dumps(dict(state))


@pytest.mark.parametrize(
    ("message", "reason", "text"),
    [
        (user_row(10, segment=2**40), "out-of-range", "out of int32 range"),
        (user_row(10, segment="99999999999"), "out-of-range", "out of int32 range"),
        (item_row(10, price=1e39), "out-of-range", "out of float32 range"),
        (item_row(10, category_id=2**70), "out-of-range", "out of int64 range"),
        # A number an aggregate reads, beyond the widest dtype of those aggregates
        # (spend_today sums price as float32): refused, not a missing sum for a day.
        (event(10, 1, kind="purchase", price=1e300), "out-of-range", "float32, up to"),
        (event(10, 1, kind="view", price="-1e39"), "out-of-range", "declare their dtype"),
        (event(10, 1, occurred_at=1e300), "out-of-range", "outside 1970"),
        (event(10, 1, occurred_at=-5), "out-of-range", "outside 1970"),
        (event(10, 1, occurred_at={"t": 1}), "wrong-type", "is not a time"),
        (event(10, 1, kind="v" * 600_000), "too-large", "600000 characters"),
        (event(10, 1, kind={"nested": 1}), "wrong-type", "is not a scalar"),
        (dict(user_row(10), id=1.5), "bad-id", "entity id 1.5"),
        (dict(user_row(10), id=True), "bad-id", "entity id True"),
        (dict(user_row(10), id={}), "bad-id", "entity id {}"),
        (dict(user_row(10), id=""), "bad-id", "entity id ''"),
        (dict(user_row(10), id=2**64), "bad-id", "entity id"),
        (dict(user_row(10), ts=10**17), "undecodable", "'ts' must be an integer"),
        (dict(user_row(10), lsn=-1), "undecodable", "'lsn' must be an integer"),
    ],
)
def test_values_that_would_fail_at_the_cache_or_changelog_are_refused_first(
    message: dict[str, Any], reason: str, text: str
) -> None:
    engine = ITEM if message["e"] == "item" else USER
    with pytest.raises(PoisonEventError, match=text) as info:
        engine.apply(None, message)
    assert info.value.reason == reason
    assert len(str(info.value)) < 400  # the 600 KB value is not echoed whole


def test_aggregates_overflowing_their_dtype_are_stored_as_missing() -> None:
    """Each price fits float32; their sum does not (the cache would refuse the vector)."""
    state = None
    for i in range(4):
        state, _ = USER.apply(state, event(10 + i, i, kind="purchase", price=3e38))
    assert state is not None
    vector = USER.vector(state)
    assert vector["spend_today"] is None
    assert vector["purchases_today"] == 4
    encodable(USER, state)


def test_an_aggregate_declared_float64_takes_what_float32_would_refuse() -> None:
    user = next(e for e in SETTINGS.entities if e.name == "user")
    wide = [
        a.model_copy(update={"dtype": "float64"}) if a.column == "price" else a
        for a in user.aggregates
    ]
    engine = FeatureEngine([user.model_copy(update={"aggregates": wide})]).engine("user")
    state, changed = engine.apply(None, event(10, 1, kind="purchase", price=1e300))
    assert changed
    assert engine.vector(state)["spend_today"] == 1e300
    encodable(engine, state)


@pytest.mark.parametrize(
    "value", [float("nan"), float("inf"), float("-inf"), "NaN", "Infinity", "-inf", "nan"]
)
def test_non_finite_numbers_follow_one_rule_stored_as_missing(value: Any) -> None:
    message = json.loads(json.dumps(item_row(10, price=value)))  # JSON NaN/Infinity too
    before = ITEM.non_finite
    state, changed = ITEM.apply(None, message)
    assert changed and ITEM.vector(state)["price"] is None
    assert ITEM.non_finite == before + 1


def test_a_stale_entity_removal_keeps_rows_written_after_it() -> None:
    state, _ = USER.apply(None, user_row(50, segment=3))
    state, _ = USER.apply(state, event(60, 1))
    state, changed = USER.apply(state, dict(user_row(40), op="x", row=None))  # older delete
    assert changed
    op = USER.write_op(7, state, now_ms=T0 + 1000)
    assert isinstance(op, Upsert)  # the live user was not wiped
    assert op.values["segment"] == 3 and op.values["views_30m"] == 1
    # A removal newer than everything does remove the user, and older changes arriving
    # late do not bring it back.
    state, _ = USER.apply(state, dict(user_row(70), op="x", row=None))
    assert isinstance(USER.write_op(7, state), Delete)
    state, changed = USER.apply(state, event(65, 2))
    assert not changed and isinstance(USER.write_op(7, state), Delete)


def test_a_stale_truncate_keeps_rows_written_after_it() -> None:
    state, _ = ITEM.apply(None, item_row(50, price=9.5))
    truncate = {"t": "public.items", "op": "t", "lsn": 40, "seq": 0, "ts": T0}
    assert not ITEM.truncate(state, truncate)  # nothing older than the truncate
    assert ITEM.vector(state)["price"] == 9.5
    assert ITEM.truncate(state, dict(truncate, lsn=60))
    assert ITEM.vector(state)["price"] is None


def test_debezium_positions_and_times_out_of_range_are_poison() -> None:
    def envelope(**source: Any) -> bytes:
        base = {"ts_ms": T0, "schema": "public", "table": "users", "lsn": 5, **source}
        return json.dumps({"op": "c", "after": {"user_id": 1}, "source": base}).encode()

    for bad in ({"lsn": -1}, {"ts_ms": 10**17}, {"ts_ms": -1}):
        with pytest.raises(PoisonEventError) as info:
            decode_change(envelope(**bad))
        assert info.value.reason == "undecodable"


def router() -> Router:
    return Router(SETTINGS.entities, SETTINGS.tables(), SETTINGS.region_names)


def debezium(table: str, op: str, before: Any, after: Any) -> Any:
    source = {"ts_ms": T0, "schema": "public", "table": table, "lsn": 100}
    change = decode_change(json.dumps({"op": op, "before": before, "after": after,
                                       "source": source}).encode())  # fmt: skip
    assert change is not None
    return change


def test_the_router_refuses_what_it_cannot_encode_instead_of_dropping_its_batch() -> None:
    row = {"event_id": 1, "user_id": 7, "item_id": 3, "home_region": "eu-west",
           "kind": "view", "blob": 2**70}  # fmt: skip
    (first, *_rest) = router().route(debezium("events", "c", None, row))
    with pytest.raises(PoisonEventError, match="cannot be encoded") as info:
        first.change.encode()
    assert info.value.reason == "unencodable"
    big = dict(row, blob="x" * (MAX_CHANGE_BYTES + 1))
    (first, *_rest) = router().route(debezium("events", "c", None, big))
    with pytest.raises(PoisonEventError, match="exclude_columns") as info:
        first.change.encode()
    assert info.value.reason == "too-large"


def test_a_delete_without_its_home_region_names_the_fix() -> None:
    """Default replica identity: Debezium fills the old row's other columns with ''."""
    before = {"event_id": 1, "user_id": 0, "item_id": 0, "home_region": "", "kind": ""}
    with pytest.raises(PoisonEventError, match="replica_identity: full") as info:
        router().route(debezium("events", "d", before, None))
    assert info.value.reason == "missing-home-region"


def test_odd_ids_are_refused_by_the_router() -> None:
    for odd in (1.5, True, {}, ""):
        row = {"user_id": odd, "home_region": "eu-west", "segment": 1}
        with pytest.raises(PoisonEventError) as info:
            router().route(debezium("users", "c", None, row))
        assert info.value.reason in ("bad-id", "missing-key")


def test_a_round_trip_through_the_wire_keeps_every_field() -> None:
    change = RegionalChange("public.events", "c", 5, 2, T0, "user", 7, "1", {"a": 1})
    assert RegionalChange.from_wire(orjson.loads(change.encode())) == change
    truncate = RegionalChange("public.events", "t", 5, 0, T0)
    assert RegionalChange.from_wire(orjson.loads(truncate.encode())) == truncate
