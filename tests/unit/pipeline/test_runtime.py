"""The regional worker's runtime without a broker: batching, checkpoints and ack
ordering (pipeline.runtime), table-driven where the rule is a table."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry

from edge_cache import Delete, Upsert
from edge_cache.exceptions import ForeignValueError, InvalidValueError
from edgefeed.settings import load_settings
from pipeline.exceptions import SinkUnavailableError
from pipeline.features import EntityState, FeatureEngine
from pipeline.messages import RegionalChange, encode_packs
from pipeline.metrics import PipelineMetrics
from pipeline.runtime import (
    BatchPolicy,
    CheckpointLedger,
    Delivery,
    RegionBatch,
    RegionRuntime,
)
from pipeline.runtime.batch import SnapshotLane, Touched

ROOT = Path(__file__).resolve().parents[3]
SETTINGS = load_settings(ROOT / "examples" / "edgefeed.yaml", env={})
T0 = 1_764_000_000_000


# -- batches -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "age_s", "last_flush_s", "due"),
    [
        (0, 10.0, 0.0, False),  # nothing pending: never due
        (10, 0.01, 0.0, False),  # young and small
        (10, 0.021, 0.0, True),  # within_s reached
        (5000, 0.0, 0.0, True),  # max_changes reached, however young
        (10, 0.05, 0.04, False),  # behind: waits catch_up (2) x the last flush (0.08 s)
        (10, 0.081, 0.04, True),
    ],
)
def test_a_batch_is_due_by_size_age_and_catch_up(
    changes: int, age_s: float, last_flush_s: float, due: bool
) -> None:
    batch = RegionBatch(BatchPolicy(max_changes=5000, within_s=0.02, catch_up=2.0))
    batch.flushed(last_flush_s)
    if changes:
        batch.add(Delivery(0, 1), changes, now=100.0)
    assert batch.due(100.0 + age_s) is due


# Backlogs the batch's messages reported, per partition in arrival order -> whether
# the batch, 0.03 s old after a flush of 0.1 s (catch_up 2: 0.2 s when behind), is due.
BACKLOG_CASES = [
    ("every partition taken to its end: keeps up, due at within_s", [(0, 0), (1, 0)], True),
    ("a partition holds more: behind, waits catch_up x the flush", [(0, 0), (1, 3)], False),
    ("the partition's newest message was its last", [(0, 5), (0, 0)], True),
    ("unknown (no consumer figure): as behind", [(0, None)], False),
]


@pytest.mark.parametrize(
    ("backlogs", "due"), [c[1:] for c in BACKLOG_CASES], ids=[c[0] for c in BACKLOG_CASES]
)
def test_a_batch_waits_for_catch_up_only_while_a_partition_holds_more(
    backlogs: list[tuple[int, int | None]], due: bool
) -> None:
    batch = RegionBatch(BatchPolicy(max_changes=5000, within_s=0.02, catch_up=2.0))
    batch.flushed(0.1)
    for offset, (partition, backlog) in enumerate(backlogs):
        batch.add(Delivery(partition, offset, backlog=backlog), 10, now=100.0)
    assert batch.due(100.03) is due
    assert batch.due(100.21)  # behind or not, due after catch_up x the flush


def test_a_reassignment_forgets_the_backlogs_of_the_partitions_before() -> None:
    batch = RegionBatch(BatchPolicy(within_s=0.02, catch_up=2.0))
    batch.flushed(0.1)
    batch.add(Delivery(1, 7, backlog=40), 1, now=10.0)
    assert not batch.due(10.03)
    batch.reassigned()  # partition 1 went to another worker
    batch.add(Delivery(0, 1, backlog=0), 1, now=10.0)
    assert batch.due(10.03)


def test_closing_a_batch_opens_an_empty_one() -> None:
    batch = RegionBatch()
    batch.add(Delivery(0, 1), 3, now=1.0)
    closed = batch.close()
    assert closed.changes == 3 and len(closed.deliveries) == 1
    assert batch.opened_at is None and not batch.deliveries and not batch.due(100.0)


# Touches of one entity in a batch -> whether the batch sets it apart for the lane
# (changed by snapshot reads only).
LANE_CASES = [
    ("snapshot reads only", [True, True], True),
    ("a streamed change only", [False], False),
    ("a snapshot read, then a streamed change", [True, False], False),
    ("a streamed change, then a snapshot read", [False, True], False),
]


@pytest.mark.parametrize(
    ("reads", "apart"), [c[1:] for c in LANE_CASES], ids=[c[0] for c in LANE_CASES]
)
def test_an_entity_only_snapshot_reads_changed_goes_to_the_lane(
    reads: list[bool], apart: bool
) -> None:
    batch = RegionBatch()
    batch.add(Delivery(0, 1), len(reads), now=1.0)
    for read in reads:
        batch.touch("user:7", Touched("user", 7, Delivery(0, 1), {}), snapshot_read=read)
    closed = batch.close()
    assert ("user:7" in closed.read_only) is apart
    assert "user:7" in closed.touched
    assert not batch.read_only  # the next batch starts clean


def test_the_lane_is_due_after_its_time_or_when_full() -> None:
    lane = SnapshotLane(lane_s=1.0, max_entities=2)
    assert lane.due_at() is None
    lane.hold({"user:1": Touched("user", 1, Delivery(0, 1), {})}, [Delivery(0, 1)], now=10.0)
    assert lane.due_at() == 11.0
    lane.hold({"user:2": Touched("user", 2, Delivery(0, 2), {})}, [Delivery(0, 2)], now=10.5)
    assert lane.due_at() == 10.0  # full: at once
    lane.superseded(["user:1"])
    touched, deliveries = lane.take()
    assert list(touched) == ["user:2"]
    assert [d.offset for d in deliveries] == [1, 2]  # held messages stay until taken
    assert lane.due_at() is None


# -- the checkpoint ledger -----------------------------------------------------------------

# Each step: (action, argument); "written" takes offsets whose batch reached the cache,
# "checkpoint" begins and completes one and records what it acked.
LEDGER_CASES: list[tuple[str, list[tuple[str, Any]], list[list[int]], dict[int, int]]] = [
    (
        "only written messages are acked",
        [("receive", [1, 2, 3]), ("written", [1, 2]), ("checkpoint", None)],
        [[1, 2]],
        {0: 3},
    ),
    (
        "a message of an open batch is never acked",
        [("receive", [1]), ("checkpoint", None)],
        [[]],
        {0: 1},
    ),
    (
        "what is written during a checkpoint waits for the next",
        [
            ("receive", [1, 2]),
            ("written", [1]),
            ("begin", None),
            ("written", [2]),
            ("complete", None),
            ("checkpoint", None),
        ],
        [[1], [2]],
        {0: 3},
    ),
    (
        "a failed checkpoint acks nothing and gives everything back",
        [("receive", [1, 2]), ("written", [1, 2]), ("begin", None), ("abort", None)],
        [],
        {0: 1},
    ),
    (
        "after a failure the next checkpoint acks all of it",
        [
            ("receive", [1, 2]),
            ("written", [1]),
            ("begin", None),
            ("abort", None),
            ("written", [2]),
            ("checkpoint", None),
        ],
        [[1, 2]],
        {0: 3},
    ),
]


@pytest.mark.parametrize(
    ("steps", "acked", "safe"), [c[1:] for c in LEDGER_CASES], ids=[c[0] for c in LEDGER_CASES]
)
def test_checkpoint_ledger(
    steps: list[tuple[str, Any]], acked: list[list[int]], safe: dict[int, int]
) -> None:
    ledger = CheckpointLedger(interval_s=0.0)
    deliveries: dict[int, Delivery] = {}
    seen: list[list[int]] = []
    running = None
    for action, argument in steps:
        if action == "receive":
            for offset in argument:
                deliveries[offset] = Delivery(0, offset)
                ledger.received(deliveries[offset])
        elif action == "written":
            batch = [deliveries[o] for o in argument]
            ledger.written(batch, [(f"user:{o}", deliveries[o], {"o": o}) for o in argument])
        elif action == "begin":
            running = ledger.begin(0.0)
        elif action == "complete":
            assert running is not None
            seen.append([d.offset for d in ledger.complete(running)])
        elif action == "abort":
            assert running is not None
            ledger.abort(running)
        else:  # checkpoint
            seen.append([d.offset for d in ledger.complete(ledger.begin(0.0))])
    assert seen == acked
    assert ledger.safe_offsets() == safe


def test_a_failed_checkpoint_keeps_the_newer_state_of_an_entity() -> None:
    ledger = CheckpointLedger()
    first, second = Delivery(0, 1), Delivery(0, 2)
    ledger.written([first], [("user:7", first, "old")])
    checkpoint = ledger.begin(0.0)
    ledger.written([second], [("user:7", second, "new")])
    ledger.abort(checkpoint)
    retried = ledger.begin(1.0)
    assert retried.states == [("user:7", second, "new")]
    assert retried.acks == [first, second]


def test_one_checkpoint_at_a_time() -> None:
    ledger = CheckpointLedger()
    ledger.begin(0.0)
    with pytest.raises(RuntimeError, match="already running"):
        ledger.begin(0.0)


def test_a_checkpoint_is_due_after_its_interval_with_messages_waiting() -> None:
    ledger = CheckpointLedger(interval_s=1.0)
    assert not ledger.due(5.0)  # nothing to ack
    ledger.written([Delivery(0, 1)], [])
    assert ledger.due(5.0)
    ledger.complete(ledger.begin(5.0))
    ledger.written([Delivery(0, 2)], [])
    assert not ledger.due(5.5) and ledger.due(6.0)


# -- the region worker with in-memory ports ------------------------------------------------


class Journal:
    """What the ports saw, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []


class FakeCache:
    def __init__(self, journal: Journal) -> None:
        self.journal = journal
        self.gate: asyncio.Event | None = None  # set: a write blocks until released
        self.entered = asyncio.Event()
        self.vectors: dict[str, Any] = {}
        self.down_for = 0  # the next writes that find the cache unavailable
        self.refuse: set[str] = set()  # entity keys whose values the cache refuses
        self.foreign: set[str] = set()  # entity keys another application holds
        self.lost = False
        self.quarantine_list: dict[str, str] = {}  # what monitoring reads
        self.writes: list[tuple[list[str], bool]] = []  # (entity keys, with freshness)
        self.ops: dict[str, Upsert | Delete] = {}
        self.rebuilds: dict[str, str] = {}  # the rebuilding list (field -> value)

    async def quarantine(self, quarantined: Mapping[str, str], released: Sequence[str]) -> None:
        if self.down_for:
            raise SinkUnavailableError("connection refused")
        for key in released:
            self.quarantine_list.pop(key, None)
        self.quarantine_list.update(quarantined)

    async def rebuilding(self, marks: Mapping[str, str | None]) -> None:
        if self.down_for:
            self.down_for -= 1
            raise SinkUnavailableError("connection refused")
        for field, value in marks.items():
            if value is None:
                self.rebuilds.pop(field, None)
            else:
                self.rebuilds[field] = value
        self.journal.events.append(("rebuilding", sorted(self.rebuilds)))

    async def intact(self) -> bool:
        if self.lost:
            self.lost = False
            return False
        return True

    async def write(
        self, ops: Sequence[Upsert | Delete], now_us: int, *, freshness: bool = True
    ) -> Sequence[bool]:
        self.entered.set()
        self.writes.append((sorted(f"{o.entity}:{o.id}" for o in ops), freshness))
        if self.gate is not None:
            await self.gate.wait()
        if self.down_for:
            self.down_for -= 1
            raise SinkUnavailableError("connection refused")
        for op in ops:
            if f"{op.entity}:{op.id}" in self.refuse:
                raise InvalidValueError(f"feature value of {op.entity}:{op.id} does not fit")
            if f"{op.entity}:{op.id}" in self.foreign:
                raise ForeignValueError(f"key {op.entity}:{op.id} holds another Redis type")
        for op in ops:
            key = f"{op.entity}:{op.id}"
            self.vectors[key] = op.values if isinstance(op, Upsert) else None
            self.ops[key] = op
        self.journal.events.append(("cache", sorted(f"{o.entity}:{o.id}" for o in ops)))
        return [True] * len(ops)


class FakeChangelog:
    def __init__(self, journal: Journal) -> None:
        self.journal = journal
        self.fail = False
        self.records: dict[str, Any] = {}

    def store(self, key: str, state: EntityState, delivery: Delivery) -> None:
        if self.fail:
            raise ConnectionError("changelog unavailable")
        self.records[key] = orjson.loads(orjson.dumps({k: v for k, v in state.items()}))
        self.journal.events.append(("store", key))

    async def relieve(self) -> None:
        await asyncio.sleep(0)

    async def close(self, partitions: Mapping[int, Delivery]) -> None:
        self.journal.events.append(("close", sorted(partitions)))


class FakeDeadLetters:
    def __init__(self) -> None:
        self.sent: list[tuple[int, int | None, str, bytes]] = []

    async def send(
        self, delivery: Delivery, value: bytes, reason: str, error: str, index: int | None
    ) -> None:
        self.sent.append((delivery.offset, index, reason, value))


class FakeAcker:
    def __init__(self, journal: Journal) -> None:
        self.journal = journal

    async def ack(self, delivery: Delivery) -> None:
        self.journal.events.append(("ack", delivery.offset))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_runtime(
    partition_of: Any = lambda key: 0,
    registry: CollectorRegistry | None = None,
) -> tuple[RegionRuntime, Journal, FakeCache, FakeChangelog, FakeDeadLetters, Clock]:
    journal, clock = Journal(), Clock()
    cache, changelog, dead = FakeCache(journal), FakeChangelog(journal), FakeDeadLetters()
    fatal: list[BaseException] = []

    async def on_fatal(exc: BaseException) -> None:
        fatal.append(exc)

    runtime = RegionRuntime(
        region="eu-west",
        app_id="test-region-eu-west",
        engine=FeatureEngine(SETTINGS.entities),
        partition_of=partition_of,
        cache=cache,
        changelog=changelog,
        dead_letters=dead,
        acker=FakeAcker(journal),
        metrics=PipelineMetrics.create(registry or CollectorRegistry()),
        policy=BatchPolicy(max_changes=1000, within_s=0.02, catch_up=2.0),
        checkpoint_interval_s=1.0,
        on_fatal=on_fatal,
        clock=clock,
        wall=lambda: (T0 + 1000) / 1000 + clock() - 1000.0,
    )
    runtime.fatal = fatal  # type: ignore[attr-defined]
    runtime.retry_first_s = runtime.retry_max_s = 0.001
    return runtime, journal, cache, changelog, dead, clock


def view(event_id: int, user: int, lsn: int, at_ms: int = T0) -> RegionalChange:
    row = {
        "event_id": event_id,
        "user_id": user,
        "item_id": 100 + event_id,
        "category_id": 5,
        "price": "1.50",
        "home_region": "eu-west",
        "kind": "view",
        "occurred_at": at_ms * 1000,
    }
    return RegionalChange("public.events", "c", lsn, 0, T0, "user", user, str(event_id), row)


def pack(*changes: RegionalChange | dict[str, Any]) -> bytes:
    bodies = [c.encode() if isinstance(c, RegionalChange) else orjson.dumps(c) for c in changes]
    (only,) = encode_packs(bodies)
    return only


def acked(journal: Journal) -> list[int]:
    return [offset for kind, offset in journal.events if kind == "ack"]


async def test_acks_come_after_the_cache_and_the_changelog() -> None:
    runtime, journal, cache, _changelog, _dead, clock = make_runtime()
    await runtime.on_message(Delivery(0, 1), pack(view(1, 7, 10), view(2, 8, 11)))
    clock.now += 0.05
    await runtime.tick()  # the batch closes: vectors to the cache
    assert cache.vectors["user:7"]["views_30m"] == 1
    assert acked(journal) == []  # in the cache, not yet in the changelog
    clock.now += 1.0
    await runtime.tick()  # the checkpoint interval passed
    await asyncio.wait_for(runtime._checkpoint_task, 5)  # type: ignore[arg-type]
    kinds = [kind for kind, _ in journal.events]
    assert kinds == ["cache", "store", "store", "close", "ack"]
    assert acked(journal) == [1]


async def test_a_checkpoint_never_acks_a_batch_still_being_written() -> None:
    """The bug that once slipped through: a checkpoint running beside the stream
    acked messages whose batch had not reached Redis yet."""
    runtime, journal, cache, _changelog, _dead, clock = make_runtime()
    await runtime.on_message(Delivery(0, 1), pack(view(1, 7, 10)))
    clock.now += 0.05
    await runtime.flush()  # batch 1 written
    await runtime.on_message(Delivery(0, 2), pack(view(2, 7, 11)))
    cache.gate, cache.entered = asyncio.Event(), asyncio.Event()
    clock.now += 0.05
    writing = asyncio.ensure_future(runtime.flush())  # batch 2: blocked inside the cache
    await asyncio.wait_for(cache.entered.wait(), 5)
    clock.now += 1.0
    await runtime.checkpoint()  # runs while batch 2 is in flight
    assert acked(journal) == [1]
    cache.gate.set()
    await writing
    clock.now += 1.0
    await runtime.checkpoint()
    assert acked(journal) == [1, 2]
    assert runtime.ledger.safe_offsets() == {0: 3}


async def test_a_failed_checkpoint_acks_nothing_and_stops_the_worker() -> None:
    runtime, journal, _cache, changelog, _dead, clock = make_runtime()
    await runtime.on_message(Delivery(0, 1), pack(view(1, 7, 10)))
    clock.now += 0.05
    await runtime.flush()
    changelog.fail = True
    clock.now += 1.0
    await runtime.tick()
    await asyncio.wait_for(runtime._checkpoint_task, 5)  # type: ignore[arg-type]
    assert acked(journal) == []
    assert [type(e) for e in runtime.fatal] == [ConnectionError]  # type: ignore[attr-defined]
    assert runtime.ledger.dirty and runtime.ledger.ready  # given back, not lost
    changelog.fail = False
    await runtime.checkpoint()
    assert acked(journal) == [1]


async def test_poison_in_a_pack_is_dead_lettered_and_the_rest_applies() -> None:
    runtime, journal, cache, _changelog, dead, clock = make_runtime()
    good = view(1, 7, 10)
    bad_id = {**good.to_wire(), "id": 1.5, "pk": "2", "lsn": 11}
    bad_op = {**good.to_wire(), "op": "z", "pk": "3", "lsn": 12}
    await runtime.on_message(Delivery(0, 1), pack(good, bad_id, bad_op, view(4, 8, 13)))
    await runtime.on_message(Delivery(0, 2), b"{not json")
    clock.now += 0.05
    await runtime.tick()
    assert [(o, i, r) for o, i, r, _ in dead.sent] == [
        (1, 1, "bad-id"),
        (1, 2, "undecodable"),
        (2, None, "undecodable"),
    ]
    assert orjson.loads(dead.sent[0][3])["id"] == 1.5  # the change itself, for replay
    assert set(cache.vectors) == {"user:7", "user:8"}
    clock.now += 1.0
    await runtime.checkpoint()
    assert acked(journal) == [1, 2]  # dead-lettered messages are acked like the rest


async def test_revoke_checkpoints_everything_before_partitions_move() -> None:
    runtime, journal, _cache, changelog, _dead, _clock = make_runtime()
    await runtime.on_message(Delivery(0, 1), pack(view(1, 7, 10)))
    await runtime.on_revoke()  # no time passed: the batch and checkpoint are forced
    assert acked(journal) == [1]
    assert "user:7" in changelog.records


async def test_a_truncate_touches_only_its_own_partition() -> None:
    runtime, _journal, cache, _changelog, _dead, clock = make_runtime(
        partition_of=lambda key: 0 if key == "user:7" else 1
    )
    await runtime.on_message(Delivery(0, 1), pack(view(1, 7, 10)))
    await runtime.on_message(Delivery(1, 1), pack(view(2, 8, 11)))
    clock.now += 0.05
    await runtime.flush()
    truncate = RegionalChange("public.events", "t", 20, 0, T0)
    await runtime.on_message(Delivery(0, 2), pack(truncate))
    clock.now += 0.05
    await runtime.flush()
    assert cache.vectors["user:7"]["views_30m"] == 0
    assert cache.vectors["user:8"]["views_30m"] == 1  # partition 1's copy handles it


async def test_duplicates_write_nothing_new() -> None:
    runtime, journal, _cache, _changelog, _dead, clock = make_runtime()
    await runtime.on_message(Delivery(0, 1), pack(view(1, 7, 10)))
    clock.now += 0.05
    await runtime.flush()
    await runtime.on_message(Delivery(0, 2), pack(view(1, 7, 10)))  # redelivered
    clock.now += 0.05
    await runtime.flush()
    assert [kind for kind, _ in journal.events] == ["cache"]


async def test_an_unavailable_cache_is_retried_and_nothing_is_acked_meanwhile() -> None:
    runtime, journal, cache, _changelog, _dead, clock = make_runtime()
    await runtime.on_message(Delivery(0, 1), pack(view(1, 7, 10)))
    cache.down_for = 3  # a Redis blip: three refused writes
    clock.now += 0.05
    await runtime.flush()  # returns once written: the blip cost time, not data
    assert cache.vectors["user:7"]["views_30m"] == 1 and cache.down_for == 0
    assert runtime.fatal == []  # type: ignore[attr-defined]
    clock.now += 1.0
    await runtime.checkpoint()
    assert acked(journal) == [1]


async def test_a_key_another_application_holds_quarantines_its_entity_not_the_region() -> None:
    """A foreign value (or another Redis type) under one entity's key is refused by the
    writer for that key alone: the entity is set aside, the others are written and
    acked, and nothing is retried as if Redis were down."""
    runtime, journal, cache, _changelog, _dead, clock = make_runtime()
    cache.foreign = {"user:8"}
    await runtime.on_message(Delivery(0, 1), pack(view(1, 7, 10), view(2, 8, 11), view(3, 9, 12)))
    clock.now += 0.05
    await runtime.flush()
    assert set(cache.vectors) == {"user:7", "user:9"}
    assert set(runtime.quarantined) == {"user:8"}
    assert "another Redis type" in runtime.quarantined["user:8"]
    assert runtime.fatal == []  # type: ignore[attr-defined]
    clock.now += 1.0
    await runtime.checkpoint()
    assert acked(journal) == [1]
    cache.foreign = set()  # the other application's key removed: the next change heals it
    await runtime.on_message(Delivery(0, 2), pack(view(4, 8, 13)))
    clock.now += 0.05
    await runtime.flush()
    assert cache.vectors["user:8"]["views_30m"] == 2 and runtime.quarantined == {}


async def test_an_entity_the_cache_refuses_is_quarantined_and_the_rest_flows() -> None:
    runtime, journal, cache, _changelog, _dead, clock = make_runtime()
    cache.refuse = {"user:8"}
    await runtime.on_message(Delivery(0, 1), pack(view(1, 7, 10), view(2, 8, 11), view(3, 9, 12)))
    clock.now += 0.05
    await runtime.flush()
    assert set(cache.vectors) == {"user:7", "user:9"}
    assert set(runtime.quarantined) == {"user:8"}
    assert "does not fit" in runtime.quarantined["user:8"]
    assert set(cache.quarantine_list) == {"user:8"}  # listed where `edgefeed lag` reads
    await runtime.on_message(Delivery(0, 2), pack(view(4, 8, 13), view(5, 7, 14)))
    clock.now += 0.05
    await runtime.flush()  # tried alone: it still fails, the rest is written
    assert cache.vectors["user:7"]["views_30m"] == 2
    assert "user:8" not in cache.vectors and set(runtime.quarantined) == {"user:8"}
    clock.now += 1.0
    await runtime.checkpoint()
    assert acked(journal) == [1, 2]  # nothing waits on the quarantined entity


async def test_a_quarantined_entity_is_released_once_a_change_makes_it_writable() -> None:
    runtime, _journal, cache, _changelog, _dead, clock = make_runtime()
    cache.refuse = {"user:8"}
    await runtime.on_message(Delivery(0, 1), pack(view(1, 8, 10)))
    clock.now += 0.05
    await runtime.flush()
    assert set(runtime.quarantined) == {"user:8"}
    cache.refuse = set()  # e.g. the offending value was corrected at the source
    await runtime.on_message(Delivery(0, 2), pack(view(2, 8, 11)))
    clock.now += 0.05
    await runtime.flush()
    assert runtime.quarantined == {} and cache.quarantine_list == {}
    assert cache.vectors["user:8"]["views_30m"] == 2  # the state kept every change


async def test_the_quarantine_list_reaches_a_cache_that_was_down_or_lost_its_data() -> None:
    runtime, _journal, cache, _changelog, _dead, clock = make_runtime()
    cache.refuse = {"user:8"}
    await runtime.on_message(Delivery(0, 1), pack(view(1, 8, 10), view(2, 7, 11)))
    clock.now += 0.05
    await runtime.flush()
    cache.quarantine_list.clear()  # redis-server restarted without persistence
    cache.lost = True
    assert await runtime.check_cache()
    assert set(cache.quarantine_list) == {"user:8"}


async def test_a_cache_that_lost_its_data_is_refilled_from_the_states() -> None:
    runtime, _journal, cache, _changelog, _dead, clock = make_runtime()
    await runtime.on_message(Delivery(0, 1), pack(view(1, 7, 10), view(2, 8, 11)))
    clock.now += 0.05
    await runtime.flush()
    cache.vectors.clear()  # redis-server restarted without persistence
    cache.lost = True
    assert await runtime.check_cache()
    assert cache.vectors["user:7"]["views_30m"] == 1 and cache.vectors["user:8"]["views_30m"] == 1
    assert not await runtime.check_cache()  # intact again: nothing rewritten


# -- the duty loop: an idle worker sleeps, a message wakes it -----------------------------


async def _settle() -> None:
    for _ in range(10):  # let woken tasks run (no time passes on the test clock)
        await asyncio.sleep(0)


async def test_an_idle_worker_sleeps_a_second_and_a_message_wakes_it_for_its_batch() -> None:
    runtime, journal, cache, _changelog, _dead, clock = make_runtime()
    assert runtime.seconds_to_duty() == pytest.approx(1.0)  # nothing open: the idle tick
    waiter = asyncio.ensure_future(runtime.wait_for_duty())
    await _settle()
    assert not waiter.done()
    await runtime.on_message(Delivery(0, 1), pack(view(1, 7, 10)))
    await _settle()
    assert waiter.done()  # woken at once, not after the idle second
    assert runtime.seconds_to_duty() == pytest.approx(0.02)  # the batch window
    clock.now += 0.02
    assert runtime.seconds_to_duty() == 0
    await runtime.tick()
    assert cache.vectors["user:7"]["views_30m"] == 1
    assert acked(journal) == []  # written: the checkpoint is the next duty
    assert runtime.seconds_to_duty() == pytest.approx(1.0 - 0.02)
    clock.now += 0.98
    await runtime.tick()
    await _settle()
    assert acked(journal) == [1]
    assert runtime.seconds_to_duty() == pytest.approx(1.0)  # idle again


async def test_a_cache_check_skipped_during_a_retrying_write_is_asked_again_soon() -> None:
    runtime, _journal, cache, _changelog, _dead, clock = make_runtime()
    clock.now += 5.0  # the cache check is due
    async with runtime._flush_lock:  # a write is retrying
        await runtime.tick()
        assert runtime.seconds_to_duty() == pytest.approx(1.0)  # not 0: no busy loop
    clock.now += 1.0
    cache.lost = True
    await runtime.tick()
    assert not cache.lost  # checked now that the lock is free


async def test_a_checkpoint_started_by_a_duty_lets_the_event_loop_run() -> None:
    """Until a started checkpoint task begins, the ledger still shows the checkpoint
    due: the duty loop once started another one on every tick without ever awaiting,
    and spun (the worker's event loop stalled) until the next cache check."""
    runtime, journal, cache, _changelog, _dead, clock = make_runtime()
    await runtime.on_message(Delivery(0, 1), pack(view(1, 7, 10)))
    clock.now += 0.02
    await runtime.tick()  # the batch is written
    assert cache.vectors["user:7"]["views_30m"] == 1
    clock.now += 1.0
    await runtime.tick()  # the checkpoint falls due: one task started
    first = runtime._checkpoint_task
    assert first is not None and not first.done()
    # Not a duty any more: the duty loop sleeps (yields) instead of spinning.
    assert runtime.seconds_to_duty() > 0
    await runtime.tick()
    assert runtime._checkpoint_task is first  # no second task
    await asyncio.wait_for(runtime.wait_for_duty(), 2.0)  # woken when it ends
    assert first.done() and acked(journal) == [1]


# -- windows read as of the read time: renewals ------------------------------------------------


async def test_a_vector_is_written_again_when_its_schedule_runs_out() -> None:
    runtime, _journal, cache, _changelog, _dead, clock = make_runtime()
    wall = runtime.wall
    # Views a minute apart: more window changes lie ahead than a value has slots.
    views = [view(i, 7, 10 + i, T0 - i * 60_000) for i in range(8)]
    await runtime.on_message(Delivery(0, 1), pack(*views))
    clock.now += 0.05
    await runtime.tick()
    first = cache.ops["user:7"]
    assert isinstance(first, Upsert) and first.schedule is not None
    until = first.schedule.until_us
    assert until is not None and first.values["views_30m"] == 8
    assert cache.writes == [(["user:7"], True)]
    # Nothing to renew before the schedule's end; the duty loop wakes for it.
    clock.now += (until / 1e6 - wall()) - 0.5
    await runtime.tick()
    assert len(cache.writes) == 1
    assert runtime.seconds_to_duty() == pytest.approx(0.5, abs=0.01)
    clock.now += 0.5
    await runtime.tick()
    renewed = cache.ops["user:7"]
    assert isinstance(renewed, Upsert) and renewed.position == first.position
    assert cache.writes[-1] == (["user:7"], False)  # written again: not news, no freshness
    engine = runtime.engine.engine("user")
    assert renewed.values == engine.vector(runtime.live["user:7"], until // 1000)
    assert renewed.values["views_30m"] < 8  # the oldest views left the window
    assert renewed.schedule is not None and renewed.schedule.until_us != until


async def test_the_renewal_lag_runs_until_the_renewal_is_in_the_cache() -> None:
    """edgefeed_pipeline_renewal_lag_seconds is how long a read could see a schedule's
    last vector past its time: it ends when the renewal lands, so a slow cache write
    counts (it was measured from when the renewal was computed)."""
    registry = CollectorRegistry()
    runtime, _journal, cache, _changelog, _dead, clock = make_runtime(registry=registry)
    views = [view(i, 7, 10 + i, T0 - i * 60_000) for i in range(8)]
    await runtime.on_message(Delivery(0, 1), pack(*views))
    clock.now += 0.05
    await runtime.tick()
    first = cache.ops["user:7"]
    assert isinstance(first, Upsert) and first.schedule is not None
    until = first.schedule.until_us
    assert until is not None
    clock.now += (until / 1e6 - runtime.wall()) + 0.25  # the duty runs 0.25 s late
    cache.gate, cache.entered = asyncio.Event(), asyncio.Event()
    duty = asyncio.create_task(runtime.tick())
    await asyncio.wait_for(cache.entered.wait(), 2.0)
    clock.now += 2.0  # the cache takes 2 s to take the renewal
    cache.gate.set()
    await asyncio.wait_for(duty, 2.0)
    assert cache.writes[-1] == (["user:7"], False)
    labels = {"region": "eu-west"}
    assert registry.get_sample_value("edgefeed_pipeline_renewal_lag_seconds_count", labels) == 1
    lag = registry.get_sample_value("edgefeed_pipeline_renewal_lag_seconds_sum", labels)
    assert lag == pytest.approx(2.25, abs=0.01)


async def checkpointed(runtime: RegionRuntime, clock: Clock) -> None:
    clock.now += 1.5
    await runtime.tick()
    await asyncio.wait_for(runtime._checkpoint_task, 5)  # type: ignore[arg-type]


async def test_after_recovery_a_vector_the_cache_holds_is_renewed_when_it_runs_out() -> None:
    """Recovered from the changelog: what the cache holds is not written again at once,
    only when its schedule runs out (a restart does not rewrite the whole cache)."""
    runtime, _journal, cache, changelog, _dead, clock = make_runtime()
    # Views a minute apart: each leaves views_30m at its own time, more than a
    # schedule's slots hold, so the schedule has an end.
    views = [view(i, 7, 10 + i, at_ms=T0 - i * 60_000) for i in range(8)]
    await runtime.on_message(Delivery(0, 1), pack(*views, view(9, 8, 30)))
    clock.now += 0.05
    await runtime.tick()
    await checkpointed(runtime, clock)
    until = runtime._renew_at["user:7"]
    cache.writes.clear()
    restarted, _journal2, cache2, _changelog2, _dead2, clock2 = make_runtime()
    clock2.now = clock.now
    restarted.recovered({key: EntityState(record) for key, record in changelog.records.items()})
    await restarted.tick()
    assert cache2.writes == []
    assert restarted._renew_at["user:7"] == until
    clock2.now += (until - restarted._now_us()) / 1e6 + 0.001  # its schedule ran out
    await restarted.tick()
    assert ["user:7"] in [keys for keys, _ in cache2.writes]


async def test_after_recovery_a_state_ahead_of_the_cache_is_written_at_once() -> None:
    """A checkpoint stores a state as it stands: a change applied after its vector was
    written is in it; replayed, that change is a no-op, so recovery must write it."""
    runtime, _journal, _cache, changelog, _dead, clock = make_runtime()
    await runtime.on_message(Delivery(0, 1), pack(view(1, 7, 10)))
    clock.now += 0.05
    await runtime.tick()  # user 7 written
    await runtime.on_message(Delivery(0, 2), pack(view(2, 7, 11)))  # applied, not written
    changelog.store("user:7", runtime.live["user:7"], Delivery(0, 2))  # as a checkpoint may
    restarted, _journal2, cache2, _changelog2, _dead2, clock2 = make_runtime()
    clock2.now = clock.now
    restarted.recovered({"user:7": EntityState(changelog.records["user:7"])})
    await restarted.tick()
    assert cache2.vectors["user:7"]["views_30m"] == 2


async def test_after_recovery_a_record_without_its_write_revision_is_written_at_once() -> None:
    """Records written before the revision was kept (and quarantined entities, whose
    vector is not in the cache) are written again, as every one was before."""
    runtime, _journal, cache, _changelog, _dead, clock = make_runtime()
    await runtime.on_message(Delivery(0, 1), pack(view(1, 7, 10), view(2, 8, 11)))
    clock.now += 0.05
    await runtime.tick()
    states = {key: EntityState(state) for key, state in runtime.live.items()}
    del states["user:7"]["wrev"]
    states["user:8"]["v"] = "an older feature set"
    cache.writes.clear()
    runtime.recovered(states)
    await runtime.tick()
    assert cache.writes == [(["user:7", "user:8"], False)]


# -- history rebuild markers (pipeline.history) ----------------------------------------------


def marker(state: str, rebuild_id: str = "rebuild-1") -> dict[str, Any]:
    row = {"state": state, "id": rebuild_id, "entities": ["user", "item"]}
    return {"t": "public.events", "op": "h", "lsn": 0, "seq": 0, "ts": T0, "row": row}


def snapshot_read(change: RegionalChange) -> RegionalChange:
    """``change`` as an incremental snapshot reads it (op ``r``)."""
    return RegionalChange(
        change.table,
        "r",
        change.lsn,
        change.seq,
        change.commit_ms,
        change.entity,
        change.entity_id,
        change.pk,
        change.row,
    )


async def test_snapshot_reads_are_written_from_the_lane_and_acked_only_after() -> None:
    runtime, journal, cache, _changelog, _dead, clock = make_runtime()
    # A snapshot chunk (user 7's rows) and a streamed view of user 8 in one batch.
    await runtime.on_message(
        Delivery(0, 1), pack(snapshot_read(view(1, 7, 10)), snapshot_read(view(2, 7, 11)))
    )
    await runtime.on_message(Delivery(0, 2), pack(view(3, 8, 12)))
    clock.now += 0.05
    await runtime.tick()
    assert cache.writes == [(["user:8"], True)]  # the streamed view at once
    # More of the snapshot: user 7 is written once, when the lane falls due.
    await runtime.on_message(Delivery(0, 3), pack(snapshot_read(view(4, 7, 13))))
    clock.now += 0.05
    await runtime.tick()
    assert "user:7" not in cache.vectors
    clock.now += 0.5  # a checkpoint may run: what the lane holds is not acked
    await runtime.tick()
    if runtime._checkpoint_task is not None:
        await asyncio.wait_for(runtime._checkpoint_task, 5)
    assert 1 not in acked(journal) and 3 not in acked(journal)
    clock.now += 1.0
    assert runtime.seconds_to_duty() == 0.0
    await runtime.tick()
    assert cache.vectors["user:7"]["views_30m"] == 3
    assert [keys for keys, _ in cache.writes].count(["user:7"]) == 1
    clock.now += 1.0
    await runtime.tick()
    await asyncio.wait_for(runtime._checkpoint_task, 5)  # type: ignore[arg-type]
    assert sorted(acked(journal)) == [1, 2, 3]


async def test_a_streamed_change_takes_its_entity_out_of_the_lane() -> None:
    runtime, _journal, cache, _changelog, _dead, clock = make_runtime()
    await runtime.on_message(Delivery(0, 1), pack(snapshot_read(view(1, 7, 10))))
    clock.now += 0.05
    await runtime.tick()
    await runtime.on_message(Delivery(0, 2), pack(view(2, 7, 11)))  # streamed
    clock.now += 0.05
    await runtime.tick()
    assert cache.vectors["user:7"]["views_30m"] == 2  # both rows, written now
    clock.now += 1.0
    await runtime.tick()
    assert [keys for keys, _ in cache.writes].count(["user:7"]) == 1  # not again


async def test_a_rebuild_end_marker_writes_what_the_lane_holds_first() -> None:
    runtime, journal, cache, _changelog, _dead, _clock = make_runtime()
    await runtime.on_message(Delivery(1, 1), pack(marker("begin")))
    await runtime.on_message(Delivery(1, 2), pack(snapshot_read(view(1, 7, 10))))
    await runtime.on_message(Delivery(1, 3), pack(marker("end")))
    kinds = [kind for kind, _ in journal.events]
    assert kinds == ["rebuilding", "cache", "rebuilding"]
    assert cache.vectors["user:7"]["views_30m"] == 1


async def test_revoke_writes_and_acks_what_the_lane_holds() -> None:
    runtime, journal, cache, _changelog, _dead, _clock = make_runtime()
    await runtime.on_message(Delivery(0, 1), pack(snapshot_read(view(1, 7, 10))))
    await runtime.on_revoke()
    assert cache.vectors["user:7"]["views_30m"] == 1
    assert acked(journal) == [1]


async def test_a_rebuild_is_listed_from_its_begin_marker_to_its_end_marker() -> None:
    runtime, journal, cache, _changelog, dead, clock = make_runtime()
    await runtime.on_message(Delivery(1, 1), pack(marker("begin")))
    assert sorted(cache.rebuilds) == ["item|1", "user|1"]
    assert orjson.loads(cache.rebuilds["user|1"])["id"] == "rebuild-1"
    await runtime.on_message(Delivery(1, 2), pack(view(1, 7, 10)))  # a rebuilt row
    await runtime.on_message(Delivery(1, 3), pack(marker("end")))
    # The row before the end marker reached the cache before the listing ended.
    kinds = [kind for kind, _ in journal.events]
    assert kinds == ["rebuilding", "cache", "rebuilding"]
    assert cache.vectors["user:7"]["views_30m"] == 1
    assert cache.rebuilds == {}
    assert dead.sent == []
    clock.now += 2.0
    await runtime.tick()
    await asyncio.wait_for(runtime._checkpoint_task, 5)  # type: ignore[arg-type]
    assert acked(journal) == [1, 2, 3]  # the markers are acked like any message


async def test_a_rebuild_marker_waits_for_a_cache_that_does_not_answer() -> None:
    runtime, _journal, cache, _changelog, dead, _clock = make_runtime()
    cache.down_for = 2
    await runtime.on_message(Delivery(0, 1), pack(marker("begin")))
    assert sorted(cache.rebuilds) == ["item|0", "user|0"]
    assert dead.sent == []


@pytest.mark.parametrize(
    "row",
    [
        None,
        {"state": "maybe", "id": "x", "entities": ["user"]},
        {"state": "begin", "id": 7, "entities": ["user"]},
        {"state": "begin", "id": "x", "entities": "user"},
        {"state": "end", "id": "", "entities": ["user"]},
    ],
)
async def test_a_malformed_rebuild_marker_is_dead_lettered(row: Any) -> None:
    runtime, _journal, cache, _changelog, dead, _clock = make_runtime()
    bad = {"t": "public.events", "op": "h", "lsn": 0, "seq": 0, "ts": T0, "row": row}
    await runtime.on_message(Delivery(0, 1), pack(bad))
    assert cache.rebuilds == {}
    assert [(offset, reason) for offset, _i, reason, _v in dead.sent] == [(1, "undecodable")]


async def test_progress_says_what_was_taken_per_partition_for_the_readiness_probe() -> None:
    runtime, *_ = make_runtime(partition_of=lambda key: int(key.endswith("8")))
    later = replace(view(2, 7, 11), commit_ms=T0 + 5000)
    await runtime.on_message(Delivery(0, 40), pack(later, view(1, 7, 10)))
    await runtime.on_message(Delivery(1, 3), pack(view(3, 8, 12)))
    # The offset after each partition's newest message, and its newest commit time.
    assert runtime.progress == {0: (41, T0 + 5000), 1: (4, T0)}
    await runtime.on_message(Delivery(0, 41), b"not a pack")  # dead-lettered: still taken
    assert runtime.progress[0] == (42, T0 + 5000)
    runtime.recovered({})
    assert runtime.progress == {}  # a new assignment: nothing taken yet
