"""Snapshot reads (op r) are position-checked upserts: a backfill while streaming
continues neither loses nor double-counts a row."""

from __future__ import annotations

import itertools
import json
import random
from typing import Any

from test_pipeline_logic import ENGINE, envelope, event_message, run, scenario, user_row_message

from pipeline.envelope import decode_change
from pipeline.features import EntityEngine


def as_read(message: dict[str, Any], lsn: int, seq: int = 1) -> dict[str, Any]:
    """The same row as an incremental snapshot reads it: op r, its own position."""
    return dict(message, op="r", lsn=lsn, seq=seq)


def database_rows() -> list[dict[str, Any]]:
    """The rows as a snapshot finds them in the database after the scenario: the
    user row as last updated (segment 3), every event."""
    return [m for m in scenario() if not (m["t"] == "public.users" and m["op"] == "c")]


def test_incremental_snapshot_events_decode_as_reads_ordered_by_offset() -> None:
    body = json.loads(envelope("items", "r", None, {"item_id": 1}, 500))
    body["source"]["snapshot"] = "incremental"
    read = decode_change(json.dumps(body).encode(), offset=42)
    assert read is not None
    assert (read.op, read.lsn, read.seq, read.snapshot) == ("r", 500, 42, "incremental")
    streamed = decode_change(envelope("items", "u", None, {"item_id": 1}, 501), offset=43)
    assert streamed is not None and streamed.snapshot is None and streamed.seq == 0


def test_rereading_rows_the_state_holds_changes_nothing() -> None:
    engine = ENGINE.engine("user")
    expected = run(scenario())
    assert expected is not None
    state = run(scenario())
    # The backfill re-reads every row at a later position (users has no time column:
    # replacing its row would move it to the read's time).
    for i, message in enumerate(database_rows()):
        state, changed = engine.apply(state, as_read(message, lsn=1000, seq=i))
        assert not changed
    assert state is not None
    assert state["rows"] == expected["rows"]
    assert engine.vector(state) == engine.vector(expected)


def test_a_read_older_than_a_streamed_change_is_ignored() -> None:
    engine = ENGINE.engine("user")
    state = run([user_row_message(20, segment=3, op="u")])
    stale = as_read(user_row_message(0, segment=1), lsn=19, seq=5)
    state, changed = engine.apply(state, stale)
    assert not changed and state is not None
    assert engine.vector(state)["segment"] == 3


def test_a_read_with_new_values_at_a_later_position_replaces_the_row() -> None:
    engine = ENGINE.engine("user")
    state = run([user_row_message(10, segment=1)])
    state, changed = engine.apply(state, as_read(user_row_message(0, segment=4), lsn=30))
    assert changed and state is not None
    assert engine.vector(state)["segment"] == 4


def test_reads_bring_back_history_the_state_lacks() -> None:
    """A window the state cannot answer (its rows were never streamed to this
    worker) is filled by the snapshot's reads, exactly once each."""
    engine = ENGINE.engine("user")
    recent = scenario()[4:]  # the state lacks events 1-3
    full = run(scenario())
    assert full is not None
    state = run(recent)
    assert state is not None and engine.vector(state) != engine.vector(full)
    reads = [as_read(m, lsn=100, seq=i) for i, m in enumerate(database_rows())]
    for message in reads + reads:  # a second snapshot of the same rows
        state, _ = engine.apply(state, message)
    assert state is not None
    assert engine.vector(state) == engine.vector(full)


def test_backfill_interleaved_with_streaming_in_any_order_gives_the_streamed_result() -> None:
    """Streaming goes on while the snapshot reads: an update of event 3 and a new
    event 7 arrive after (by position) the reads; however the two sequences
    interleave (each in its own order, as Kafka keeps them), the vector equals
    the one of the stream alone."""
    engine = ENGINE.engine("user")
    history = scenario()
    updated = dict(event_message(3, 60, "click", 102, 6, "30.00", minutes_ago=10), op="u")
    new = event_message(7, 61, "view", 104, 5, "7.00", minutes_ago=1)
    stream_after = [updated, new]
    expected = run([*history, *stream_after])
    assert expected is not None
    reads = [as_read(m, lsn=50, seq=i) for i, m in enumerate(database_rows())]
    rng = random.Random(16)
    for _ in range(40):
        base = rng.randint(0, len(history))
        start = history[:base]  # what the state held when the backfill began
        merged: list[dict[str, Any]] = []
        a, b = list(reads), list(stream_after)
        while a or b:
            pick = a if (a and (not b or rng.random() < 0.6)) else b
            merged.append(pick.pop(0))
        state = run([*start, *merged])
        assert state is not None
        assert engine.vector(state) == engine.vector(expected)


def test_no_read_order_double_counts() -> None:
    engine = ENGINE.engine("user")
    expected = run(scenario())
    assert expected is not None
    reads = [as_read(m, lsn=100, seq=i) for i, m in enumerate(database_rows())]
    for order in itertools.islice(itertools.permutations(reads), 0, 200, 7):
        state = run([*scenario(), *order, *order])
        assert state is not None
        assert engine.vector(state) == engine.vector(expected)


def test_a_new_feature_set_version_rewrites_each_vector_the_snapshot_reads_once() -> None:
    """After `features apply` the workers run the new version; the snapshot's reads of
    rows they hold rewrite each entity's vector once (under the new version), then
    are no-ops again."""
    old = ENGINE.engine("user")
    state = run(scenario())
    assert state is not None and state["v"] == old.schema.version
    newer = EntityEngine(old.settings.model_copy(update={"version": old.schema.version + 1}))
    before = old.write_op(7, state).position
    reads = [as_read(m, lsn=1000, seq=i) for i, m in enumerate(database_rows())]
    state, changed = newer.apply(state, reads[0])
    assert changed and state["v"] == newer.schema.version
    after = newer.write_op(7, state)
    assert (after.position.lsn, after.position.seq) > (before.lsn, before.seq)  # cache takes it
    assert state["rows"] == run(scenario())["rows"]  # type: ignore[index]
    for message in reads[1:]:
        state, changed = newer.apply(state, message)
        assert not changed
