"""The rebalance race (issue 13, scale-out): a late changelog record from a partition's
previous owner must not replace the new owner's states at the next recovery.

The changelog is modelled as the records written to one partition, in order; a
recovery applies them as Faust's memory store does (last record per key wins), through
``fence_recovery``, and rebuilds the working states."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgefeed.settings import load_settings
from pipeline.faustcompat import PartitionWriter, fence_recovery
from pipeline.features import EntityState, FeatureEngine
from pipeline.statestore import (
    EPOCH_HEADER,
    ChangelogFence,
    fence_key,
    rebuild_states,
    store_state,
)

ROOT = Path(__file__).resolve().parents[3]
ENGINE = FeatureEngine(load_settings(ROOT / "examples" / "edgefeed.yaml", env={}).entities)
USER = ENGINE.engine("user")
T0 = 1_764_000_000_000
PARTITION = 2


def view(lsn: int, pk: int) -> dict[str, Any]:
    row = {
        "user_id": 7,
        "item_id": pk,
        "category_id": 1,
        "price": 1.5,
        "kind": "view",
        "occurred_at": (T0 + lsn * 1000) * 1000,
    }
    return {"e": "user", "id": 7, "seq": 0, "t": "public.events", "pk": str(pk), "lsn": lsn} | {
        "ts": T0 + lsn,
        "op": "c",
        "row": row,
    }


@dataclass
class Record:
    """A changelog record as a recovery reads it."""

    key: str
    value: Any
    headers: dict[str, bytes]
    message: Any = None

    def __post_init__(self) -> None:
        self.message = _Message(PARTITION, self.value)


@dataclass
class _Message:
    partition: int
    value: Any


@dataclass
class Changelog:
    """One changelog partition: what workers wrote, in the order the broker got it."""

    records: list[Record] = field(default_factory=list)


class _Topic:
    def __init__(self, log: Changelog) -> None:
        self.log = log

    def send_soon(self, *, key: str, value: Any, headers: dict[str, bytes], **_: Any) -> Any:
        self.log.records.append(Record(key, copy.deepcopy(value), headers))
        return None


class Table:
    """A worker's table: in memory, its changelog shared; recovery as Faust's memory store
    applies it (``apply_changelog_batch``: last record per key wins)."""

    def __init__(self, log: Changelog) -> None:
        self.data: dict[str, Any] = {}
        self.changelog_topic = _Topic(log)
        self.key_serializer = self.value_serializer = None

    def send_changelog(self, partition: int, key: str, value: Any, **_: Any) -> Any:
        self.changelog_topic.log.records.append(Record(key, copy.deepcopy(value), {}))

    def _on_changelog_sent(self, *_: Any) -> None:
        return None

    def apply_changelog_batch(self, batch: list[Record]) -> None:
        for record in batch:
            if record.value is None:
                self.data.pop(record.key, None)
            else:
                self.data[record.key] = record.value


class Worker:
    """A regional worker owning PARTITION: applies changes, checkpoints with its epoch."""

    def __init__(self, log: Changelog, fenced: bool = True) -> None:
        self.log = log
        self.table = Table(log)
        self.fence = ChangelogFence()
        if fenced:
            fence_recovery(self.table, self.fence)
        self.epoch: int | None = None
        self.state: EntityState | None = None

    def recover(self) -> None:
        """Read the whole partition, rebuild the state, open a new epoch (app.py)."""
        self.table.apply_changelog_batch(list(self.log.records))
        states = rebuild_states(self.table.data.items(), lambda key: True)
        self.state = states.get("user:7")
        self.epoch = self.fence.next_epoch(PARTITION)
        self.writer()[fence_key(PARTITION)] = {"epoch": self.epoch}

    def writer(self) -> PartitionWriter:
        return PartitionWriter(self.table, PARTITION, [], self.epoch)

    def apply(self, *changes: dict[str, Any]) -> None:
        for change in changes:
            self.state, _ = USER.apply(self.state, change)

    def checkpoint(self) -> None:
        assert self.state is not None
        store_state(self.writer(), "user:7", self.state)

    def views(self) -> int:
        assert self.state is not None
        return int(USER.vector(self.state)["views_30m"])


def race(fenced: bool) -> Worker:
    """Worker A owns the partition; it stalls past its session timeout with a
    checkpoint pending, B takes the partition over and goes on, then A wakes and
    its checkpoint lands after B's. Then C (or B restarted) recovers."""
    log = Changelog()
    old = Worker(log, fenced)
    old.recover()
    old.apply(view(10, 1), view(11, 2))
    old.checkpoint()  # views: 2, acked and committed
    old.apply(view(12, 3))  # processed, its checkpoint not yet written: A stalls here

    new = Worker(log, fenced)
    new.recover()  # views 2; it processes the uncommitted view 12 again, and more
    new.apply(view(12, 3), view(13, 4), view(14, 5))
    new.checkpoint()  # views: 5
    assert new.views() == 5

    old.checkpoint()  # A wakes: its late checkpoint (views: 3) lands last

    later = Worker(log, fenced)
    later.recover()
    return later


def test_a_late_checkpoint_of_the_previous_owner_is_ignored_at_recovery() -> None:
    assert race(fenced=True).views() == 5


def test_without_epochs_the_late_checkpoint_wins() -> None:
    """The race is real: last-record-wins recovery takes the stale state."""
    assert race(fenced=False).views() == 3


def test_every_record_carries_its_owners_epoch() -> None:
    log = Changelog()
    worker = Worker(log)
    worker.recover()
    worker.apply(view(10, 1))
    worker.checkpoint()
    again = Worker(log)
    again.recover()
    assert [r.headers[EPOCH_HEADER] for r in log.records] == [b"1", b"1", b"1", b"2"]
    assert log.records[0].key == log.records[-1].key == fence_key(PARTITION)


def test_records_without_an_epoch_are_kept() -> None:
    """Changelogs written before epochs existed still recover."""
    fence = ChangelogFence()
    assert fence.admit(0, None)
    assert fence.admit(0, 3)
    assert fence.admit(0, None)
    assert not fence.admit(0, 2)
    assert fence.admit(1, 1)  # per partition
    assert fence.next_epoch(0) == 4


def test_a_partition_that_returns_is_read_again_from_its_start() -> None:
    """A worker that lost a partition forgets its epochs there: when the partition
    returns, its recovery reads every record again, the earlier owners' included."""
    fence = ChangelogFence()
    assert fence.admit(0, 1) and fence.admit(1, 1)
    assert fence.next_epoch(0) == 2
    fence.keep([1])  # partition 0 went to another worker
    assert fence.admit(0, 1)  # read again from the start: the epoch-1 records count
    assert fence.admit(0, 3)
    assert not fence.admit(1, 0)
