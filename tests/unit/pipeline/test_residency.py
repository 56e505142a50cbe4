"""Residency of home-region moves (issue 13 item 6): the home region is the entity's.

The router is driven with decoded Debezium changes, and its regional messages are
applied by one feature engine per region, as the regional workers do; each region's
changelog is modelled by the records ``store_state`` writes (a compacted topic: the
last record per key).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from edge_cache import Delete
from edgefeed.settings import load_settings
from pipeline.envelope import Change, decode_change
from pipeline.features import EntityState, FeatureEngine
from pipeline.homes import HomeBook
from pipeline.recompute import expected_vectors
from pipeline.routing import RegionMessage, Router
from pipeline.statestore import ROW_SEP, store_state

ROOT = Path(__file__).resolve().parents[3]
SETTINGS = load_settings(ROOT / "examples" / "edgefeed.yaml", env={})
REGIONS = SETTINGS.region_names
T0 = 1_764_000_000_000  # ms
READ_AT = T0 + 1000  # windows are read as of a read time: a second after the events


def change(table: str, op: str, before: Any, after: Any, lsn: int) -> Change:
    body = {
        "op": op,
        "before": before,
        "after": after,
        "source": {"ts_ms": T0, "schema": "public", "table": table, "lsn": lsn},
    }
    decoded = decode_change(json.dumps(body).encode())
    assert decoded is not None
    return decoded


def user(home: str, segment: int = 1) -> dict[str, Any]:
    return {"user_id": 7, "home_region": home, "country": "DE", "segment": segment}


def event(event_id: int, home: str, kind: str = "view", item: int = 3) -> dict[str, Any]:
    return {
        "event_id": event_id,
        "user_id": 7,
        "item_id": item,
        "category_id": 5,
        "price": "10.00",
        "home_region": home,
        "kind": kind,
        "occurred_at": (T0 - event_id * 60_000) * 1000,  # MicroTimestamp
    }


class Regions:
    """The router and every region's worker state and changelog, in memory."""

    def __init__(self, homes: HomeBook | None = None) -> None:
        self.router = Router(SETTINGS.entities, SETTINGS.tables(), REGIONS, homes)
        self.engines = {
            region: FeatureEngine(SETTINGS.entities, SETTINGS.tables()) for region in REGIONS
        }
        self.states: dict[str, dict[str, EntityState]] = {region: {} for region in REGIONS}
        self.changelogs: dict[str, dict[str, Any]] = {region: {} for region in REGIONS}
        self.sent: list[RegionMessage] = []

    def feed(self, *changes: Change) -> list[RegionMessage]:
        sent = []
        for source in changes:
            for message in self.router.route(source):
                sent.append(message)
                region, body = message.region, message.change
                key = message.key or ""
                engine = self.engines[region].engine(body.entity)
                state, changed = engine.apply(self.states[region].get(key), body)
                if changed:
                    self.states[region][key] = state
                    store_state(self.changelogs[region], key, state)
            self.router.homes.flush()  # as the router app does after each batch
        self.sent.extend(sent)
        return sent

    def vector(self, region: str, key: str) -> dict[str, Any] | None:
        state = self.states[region].get(key)
        if state is None:
            return None
        entity, entity_id = key.split(":", 1)
        op = self.engines[region].engine(entity).write_op(int(entity_id), state, READ_AT)
        return None if isinstance(op, Delete) else dict(op.values)

    def rows_in_changelog(self, region: str, key: str) -> dict[str, Any]:
        """The row records of ``key`` the region's changelog still holds."""
        return {
            stored: value
            for stored, value in self.changelogs[region].items()
            if stored.startswith(key + ROW_SEP) and value is not None
        }


def user_messages(sent: list[RegionMessage], region: str) -> list[dict[str, Any]]:
    return [m.value for m in sent if m.region == region and m.key == "user:7"]


def moved_user() -> Regions:
    """User 7 lived in eu-west with two events there, then moved to us-east."""
    regions = Regions()
    regions.feed(
        change("users", "c", None, user("eu-west"), 10),
        change("events", "c", None, event(1, "eu-west"), 11),
        change("events", "c", None, event(2, "eu-west"), 12),
        change("users", "u", user("eu-west"), user("us-east"), 20),
    )
    assert regions.vector("eu-west", "user:7") is None
    assert regions.vector("us-east", "user:7") is not None
    return regions


def test_a_change_to_an_old_event_row_does_not_bring_a_moved_user_back() -> None:
    regions = moved_user()
    sent = regions.feed(
        change("events", "u", event(1, "eu-west"), event(1, "eu-west", "click"), 30)
    )
    # Nothing of the user, and none of its rows, goes to eu-west.
    assert user_messages(sent, "eu-west") == []
    assert regions.vector("eu-west", "user:7") is None
    assert regions.rows_in_changelog("eu-west", "user:7") == {}
    # The row names eu-west, not the user's home: it does not count in us-east either.
    assert [m["op"] for m in user_messages(sent, "us-east")] == ["d"]
    assert all(m["row"] is None for m in user_messages(sent, "us-east"))


def test_changing_an_events_home_region_alone_splits_no_user() -> None:
    regions = Regions()
    regions.feed(
        change("users", "c", None, user("eu-west"), 10),
        change("events", "c", None, event(1, "eu-west"), 11),
        change("events", "c", None, event(2, "eu-west"), 12),
    )
    assert regions.vector("eu-west", "user:7")["views_30m"] == 2  # type: ignore[index]
    sent = regions.feed(change("events", "u", event(1, "eu-west"), event(1, "us-east"), 20))
    # No part of the user appears in us-east; eu-west keeps the user, whose vector
    # no longer counts the row that names another region.
    assert user_messages(sent, "us-east") == []
    assert regions.vector("us-east", "user:7") is None
    assert [m["op"] for m in user_messages(sent, "eu-west")] == ["d"]
    assert regions.vector("eu-west", "user:7")["views_30m"] == 1  # type: ignore[index]


def test_a_forged_move_without_the_old_row_leaves_nothing_in_the_old_region() -> None:
    regions = Regions()
    regions.feed(
        change("users", "c", None, user("eu-west"), 10),
        change("events", "c", None, event(1, "eu-west"), 11),
    )
    assert regions.rows_in_changelog("eu-west", "user:7") != {}
    # An update without its old row (default replica identity, or forged).
    sent = regions.feed(change("users", "u", None, user("us-east"), 20))
    assert [m["op"] for m in user_messages(sent, "eu-west")] == ["x"]
    assert regions.vector("eu-west", "user:7") is None
    assert regions.rows_in_changelog("eu-west", "user:7") == {}
    assert regions.vector("us-east", "user:7") is not None


def test_a_replayed_older_user_row_does_not_move_the_user_back() -> None:
    regions = moved_user()
    sent = regions.feed(change("users", "c", None, user("eu-west"), 10))  # redelivered
    assert user_messages(sent, "eu-west") == []
    assert regions.vector("eu-west", "user:7") is None
    assert regions.vector("us-east", "user:7") is not None


def test_the_homes_survive_a_router_restart() -> None:
    book: dict[str, Any] = {}
    first = Regions(HomeBook(book))
    first.feed(change("users", "c", None, user("eu-west"), 10))
    first.feed(change("users", "u", user("eu-west"), user("us-east"), 20))
    assert set(book) == {"user:7"}  # flushed: no row data, the home only
    assert book["user:7"]["region"] == "us-east"
    # A new router over the same records (the Faust table after recovery).
    again = Regions(HomeBook(json.loads(json.dumps(book))))
    sent = again.router.route(
        change("events", "u", event(1, "eu-west"), event(1, "eu-west", "click"), 30)
    )
    assert [(m.region, m.value["op"]) for m in sent if m.key == "user:7"] == [("us-east", "d")]


def test_rows_routed_before_the_home_was_known_are_forgotten_there() -> None:
    regions = Regions()
    # The events topic ran ahead of the users topic: the events went where they say,
    # and one of them is newer than the user's row.
    regions.feed(
        change("events", "c", None, event(1, "eu-west"), 11),
        change("events", "c", None, event(2, "eu-west"), 30),
    )
    # Kept there, not served (the user's own row is not known yet).
    assert regions.rows_in_changelog("eu-west", "user:7") != {}
    assert regions.vector("eu-west", "user:7") is None
    sent = regions.feed(change("users", "c", None, user("us-east"), 10))
    assert [m["op"] for m in user_messages(sent, "eu-west")] == ["x"]
    assert regions.vector("eu-west", "user:7") is None
    assert regions.rows_in_changelog("eu-west", "user:7") == {}


def test_a_deleted_user_is_removed_where_the_book_says_it_lives() -> None:
    regions = moved_user()
    # The delete's old row names eu-west (a stale value), the user lives in us-east.
    sent = regions.feed(change("users", "d", user("eu-west"), None, 40))
    assert {(m["op"]) for m in user_messages(sent, "us-east")} == {"x"}
    assert regions.vector("us-east", "user:7") is None


def held_vectors(regions: Regions, region: str, entity: str) -> dict[str, Any]:
    return {
        key.split(":", 1)[1]: vector
        for key in regions.states[region]
        if key.startswith(entity + ":") and (vector := regions.vector(region, key)) is not None
    }


def test_a_deleted_users_remaining_rows_are_served_nowhere_and_verify_agrees() -> None:
    """A personal entity exists while its own row does (issue 30): a user whose row
    was deleted while its events remain (no cascade) is served in no region, and
    the recomputation from the remaining rows (edgefeed pipeline verify) expects
    none; the item the events feed keeps counting them."""
    regions = Regions()
    rows = [event(1, "eu-west"), event(2, "eu-west", "click")]
    regions.feed(
        change("users", "c", None, user("eu-west"), 10),
        *(change("events", "c", None, row, 11 + i) for i, row in enumerate(rows)),
        change("users", "d", user("eu-west"), None, 20),
    )
    expected = expected_vectors(
        SETTINGS.entities, SETTINGS.tables(), REGIONS, {"public.events": rows}, READ_AT
    )
    for region in REGIONS:
        assert regions.vector(region, "user:7") is None, region
        assert "7" not in expected[region].vectors.get("user", {}), region
        assert held_vectors(regions, region, "item") == expected[region].vectors.get("item", {})
    assert expected["eu-west"].vectors["item"]["3"]["views_1h"] == 1


def test_a_user_seen_only_through_events_is_served_once_its_row_arrives() -> None:
    """Events read before their user's row (the Debezium topics are not ordered with
    one another) are kept, not served; the user's row makes them count."""
    regions = Regions()
    regions.feed(change("events", "c", None, event(1, "eu-west"), 11))
    assert regions.vector("eu-west", "user:7") is None
    expected = expected_vectors(
        SETTINGS.entities, SETTINGS.tables(), REGIONS, {"public.events": [event(1, "eu-west")]}
    )
    assert "7" not in expected["eu-west"].vectors.get("user", {})
    regions.feed(change("users", "c", None, user("eu-west"), 12))
    served = regions.vector("eu-west", "user:7")
    assert served is not None and served["views_30m"] == 1


def test_a_moved_users_vectors_equal_a_recomputation_from_the_final_rows() -> None:
    """What happens to a moved user's history: its rows that still name the old
    region count nowhere for the user; re-tagging them carries them over."""
    regions = Regions()
    rows = {1: event(1, "eu-west"), 2: event(2, "eu-west"), 3: event(3, "eu-west", "click")}
    regions.feed(
        change("users", "c", None, user("eu-west"), 10),
        *(change("events", "c", None, rows[i], 10 + i) for i in rows),
        change("users", "u", user("eu-west"), user("us-east"), 20),
        change("events", "c", None, event(4, "us-east"), 21),
        change("events", "u", rows[1], event(1, "eu-west", "click"), 22),  # old row, still eu-west
        change("events", "u", rows[2], event(2, "us-east"), 23),  # re-tagged: carried over
    )
    final_events = [event(1, "eu-west", "click"), event(2, "us-east"), rows[3], event(4, "us-east")]
    expected = expected_vectors(
        SETTINGS.entities,
        SETTINGS.tables(),
        REGIONS,
        {"public.users": [user("us-east")], "public.events": final_events},
        READ_AT,
    )
    for region in REGIONS:
        for entity in ("user", "item"):
            held = {
                key.split(":", 1)[1]: vector
                for key in regions.states[region]
                if key.startswith(entity + ":")
                and (vector := regions.vector(region, key)) is not None
            }
            assert held == expected[region].vectors.get(entity, {}), (region, entity)
    us_east = regions.vector("us-east", "user:7")
    assert us_east is not None and us_east["views_30m"] == 2  # events 2 and 4


def test_a_move_that_is_dead_lettered_decides_nothing() -> None:
    """The router encodes a change after routing it; one it cannot encode is
    dead-lettered, and the move it recorded is undone (its eviction was never sent)."""
    regions = Regions()
    regions.feed(change("users", "c", None, user("eu-west"), 10))
    router = regions.router
    router.route(change("users", "u", None, user("us-east"), 20))
    router.homes.rollback()  # what the app does when the encoding fails
    home = router.homes.get("user:7")
    assert home is not None and home.region == "eu-west"
    again = router.route(change("users", "u", None, user("us-east"), 21))
    assert [(m.region, m.value["op"]) for m in again] == [("us-east", "u"), ("eu-west", "x")]


def test_events_read_before_their_users_move_count_once_the_move_is_read() -> None:
    """The Debezium topics are not ordered with one another: the events written after
    a move (naming the new region) may be routed before it."""
    regions = Regions()
    regions.feed(
        change("users", "c", None, user("eu-west"), 10),
        change("events", "c", None, event(1, "eu-west"), 11),
    )
    early = regions.feed(
        change("events", "c", None, event(2, "us-east"), 21),
        change("events", "u", event(1, "eu-west"), event(1, "us-east"), 22),
    )
    assert user_messages(early, "us-east") == []  # the router does not know the move yet
    regions.feed(change("users", "u", user("eu-west"), user("us-east"), 20))
    assert regions.vector("eu-west", "user:7") is None
    moved = regions.vector("us-east", "user:7")
    assert moved is not None and moved["views_30m"] == 2  # events 1 and 2, as recomputed
    expected = expected_vectors(
        SETTINGS.entities,
        SETTINGS.tables(),
        REGIONS,
        {
            "public.users": [user("us-east")],
            "public.events": [event(1, "us-east"), event(2, "us-east")],
        },
        READ_AT,
    )
    assert expected["us-east"].vectors["user"]["7"] == moved


def test_a_moved_users_stale_rows_stay_out_after_an_unrelated_update() -> None:
    regions = moved_user()
    regions.feed(change("events", "u", event(1, "eu-west"), event(1, "eu-west", "click"), 30))
    sent = regions.feed(change("users", "u", user("us-east"), user("us-east", segment=4), 31))
    assert user_messages(sent, "eu-west") == []
    assert [m["op"] for m in user_messages(sent, "us-east")] == ["u"]
