"""The per-entity, per-row layout of the worker's states in its Faust table."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from edgefeed.settings import load_settings
from pipeline.features import EntityState, FeatureEngine, chunk_of
from pipeline.statestore import ROW_SEP, checkpoint_key, rebuild_states, store_state

ROOT = Path(__file__).resolve().parents[3]
ENGINE = FeatureEngine(load_settings(ROOT / "examples" / "edgefeed.yaml", env={}).entities)
USER = ENGINE.engine("user")
T0 = 1_764_000_000_000


def messages(seed: int, count: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    base = {"e": "user", "id": 7, "seq": 0}
    out: list[dict[str, Any]] = [
        base
        | {"t": "public.users", "pk": "7", "lsn": 10, "ts": T0, "op": "c"}
        | {"row": {"user_id": 7, "segment": 1}}
    ]
    for i in range(count):
        lsn = 20 + i
        op = rng.choice(("c", "c", "c", "u", "d"))
        row = (
            None
            if op == "d"
            else {
                "user_id": 7,
                "item_id": rng.randrange(5),
                "category_id": rng.randrange(3),
                "price": rng.choice((1.5, 2.25, 9.99)),
                "kind": rng.choice(("view", "click", "purchase", "add_to_cart")),
                "occurred_at": (T0 + i * 1000) * 1000,
            }
        )
        pk = str(rng.randrange(12))
        out.append(
            base | {"t": "public.events", "pk": pk, "lsn": lsn, "ts": T0 + i, "op": op, "row": row}
        )
    return out


def test_checkpoints_write_only_what_changed_and_rebuild_the_same_state() -> None:
    stream = messages(1, 60)
    table: dict[str, Any] = {}
    state: EntityState | None = None
    for i, message in enumerate(stream):
        state, _ = USER.apply(state, message)
        if i % 9 == 0:  # a checkpoint now and then
            USER.prune(state)
            written = store_state(table, "user:7", state)
            # The entity record and the chunks changed since the last checkpoint: 9
            # changes a second apart fall in at most 3 chunks of 10 s (plus the users row).
            assert written <= 1 + 4
    assert state is not None
    store_state(table, "user:7", state)
    assert store_state(table, "user:7", state) == 1  # nothing changed: the entity record only
    chunks = {k for k in table if ROW_SEP in k}
    expected = {
        f"user:7{ROW_SEP}{t}{ROW_SEP}{chunk_of(e[2])}"
        for t, rows in state["rows"].items()
        for e in rows.values()
    }
    assert chunks == expected
    assert sum(len(table[k]) for k in chunks) == sum(len(r) for r in state["rows"].values())
    rebuilt = rebuild_states(table.items(), lambda key: True)["user:7"]
    assert USER.vector(rebuilt) == USER.vector(state)
    assert (rebuilt["lsn"], rebuilt["rev"]) == (state["lsn"], state["rev"])
    # Replaying the last messages onto the rebuilt state changes nothing.
    for message in stream[-10:]:
        rebuilt, changed = USER.apply(rebuilt, message)
        assert not changed


def test_a_removed_entity_leaves_no_rows_behind() -> None:
    table: dict[str, Any] = {}
    state: EntityState | None = None
    for message in messages(2, 20):
        state, _ = USER.apply(state, message)
    assert state is not None
    store_state(table, "user:7", state)
    gone = {"e": "user", "id": 7, "t": "public.users", "pk": "7", "seq": 0, "lsn": 999}
    state, changed = USER.apply(state, gone | {"ts": T0, "op": "x", "row": None})
    assert changed
    store_state(table, "user:7", state)
    assert [k for k in table if ROW_SEP in k] == []
    assert table["user:7"]["gone"] == [999, 0]


def test_rebuild_keeps_only_owned_entities_and_reads_states_written_whole() -> None:
    whole = {
        "lsn": 5,
        "rev": 1,
        "ts": T0,
        "gone": None,
        "rows": {"public.users": {"8": [5, 0, T0, 0, {"segment": 3}]}},
    }
    table = {
        "user:8": whole,
        "user:9": {"lsn": 6, "rev": 1, "ts": T0, "gone": None},
        f"user:9{ROW_SEP}public.users{ROW_SEP}{chunk_of(T0)}": {"9": [6, 0, T0, 0, {"segment": 1}]},
        checkpoint_key(0): {"at_ms": T0},  # closes a checkpoint: not an entity
    }
    states = rebuild_states(table.items(), lambda key: key != "user:9")
    assert list(states) == ["user:8"]
    assert USER.vector(states["user:8"])["segment"] == 3
    # The rows of a state written whole go out as row records at the next checkpoint.
    store_state(table, "user:8", states["user:8"])
    assert table[f"user:8{ROW_SEP}public.users{ROW_SEP}{chunk_of(T0)}"] == {
        "8": [5, 0, T0, 0, {"segment": 3}]
    }
    assert "rows" not in table["user:8"]
