"""Dead letters counted by reason (monitoring.deadletters): each round reads only the
new records, a recreated topic starts over, retention skips ahead.

The reads themselves run against the real broker in the sites test
(tests/integration/pipeline/test_sites.py, the status page's dead letters); here
a scripted consumer stands in for kafka-python's to pin the bookkeeping."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from monitoring.deadletters import NO_REASON, ReasonTally

CENTRAL, EU = "edgefeed.deadletter", "edgefeed.deadletter.eu-west"


def headers(reason: str | None) -> list[tuple[str, bytes]]:
    found = [("edgefeed-stage", b"router"), ("edgefeed-topic", b"src")]
    if reason is not None:
        found.insert(1, ("edgefeed-reason", reason.encode()))
    return found


@dataclass
class Record:
    offset: int
    headers: list[tuple[str, bytes]]


@dataclass
class Consumer:
    """kafka-python's ``KafkaConsumer`` assign/seek/poll over in-memory partitions."""

    logs: dict[tuple[str, int], list[Record]]
    positions: dict[Any, int] = field(default_factory=dict)
    seeks: list[tuple[str, int, int]] = field(default_factory=list)

    def assign(self, partitions: list[Any]) -> None:
        self.positions = {tp: 0 for tp in partitions}

    def seek(self, tp: Any, offset: int) -> None:
        self.positions[tp] = offset
        self.seeks.append((tp.topic, tp.partition, offset))

    def poll(self, timeout_ms: int = 0, max_records: int | None = None) -> dict[Any, list[Record]]:
        batch = {}
        for tp, position in self.positions.items():
            records = [
                r for r in self.logs.get((tp.topic, tp.partition), []) if r.offset >= position
            ]
            records = records[:2]  # small batches: several polls
            if records:
                batch[tp] = records
                self.positions[tp] = records[-1].offset + 1
        return batch


def log(*reasons: str | None, start: int = 0) -> list[Record]:
    return [Record(start + i, headers(reason)) for i, reason in enumerate(reasons)]


def round_(
    tally: ReasonTally, consumer: Consumer, oldest: dict[Any, int], end: dict[Any, int]
) -> None:
    tally.read(consumer, tally.to_read(oldest, end), deadline_s=5)


def test_reasons_are_counted_per_topic_across_partitions_and_only_new_ones_are_read() -> None:
    logs = {
        (CENTRAL, 0): log("unknown-region", "bad-json", "unknown-region"),
        (CENTRAL, 1): log("unknown-region"),
        (EU, 0): log("missing-key", None),
        ("edgefeed.region.eu-west", 0): log("not a dead letter"),
    }
    consumer = Consumer(logs)
    tally = ReasonTally([CENTRAL, EU])
    end = {key: len(records) for key, records in logs.items()}
    round_(tally, consumer, {}, end)
    assert tally.counts() == (
        (CENTRAL, "bad-json", 1),
        (CENTRAL, "unknown-region", 3),
        (EU, NO_REASON, 1),
        (EU, "missing-key", 1),
    )
    assert {(t, p) for t, p, _ in consumer.seeks} == {(CENTRAL, 0), (CENTRAL, 1), (EU, 0)}
    # Two new dead letters on one partition: every partition is read from where the
    # last round stopped (one at its end offset too: a broker may report the end
    # short, below), none from its start again.
    logs[(CENTRAL, 1)] += log("bad-json", "bad-json", start=1)
    end[(CENTRAL, 1)] = 3
    consumer.seeks.clear()
    round_(tally, consumer, {}, end)
    assert sorted(consumer.seeks) == [(CENTRAL, 0, 3), (CENTRAL, 1, 1), (EU, 0, 2)]
    assert dict(((t, r), n) for t, r, n in tally.counts())[(CENTRAL, "bad-json")] == 3
    # Nothing new: nothing counted twice.
    round_(tally, consumer, {}, end)
    assert sum(n for _t, _r, n in tally.counts()) == 8


def test_records_past_a_reported_end_are_counted_once() -> None:
    # Tansu reports a partition's end as the start of its last record batch.
    logs = {(CENTRAL, 0): log("a", "b", "c")}
    consumer = Consumer(logs)
    tally = ReasonTally([CENTRAL])
    round_(tally, consumer, {}, {(CENTRAL, 0): 1})
    assert tally.counts() == ((CENTRAL, "a", 1), (CENTRAL, "b", 1), (CENTRAL, "c", 1))
    round_(tally, consumer, {}, {(CENTRAL, 0): 1})
    round_(tally, consumer, {}, {(CENTRAL, 0): 2})
    assert sum(n for _t, _r, n in tally.counts()) == 3


def test_a_recreated_topic_starts_over_and_retention_skips_ahead() -> None:
    logs = {(CENTRAL, 0): log("a", "a", "a")}
    consumer = Consumer(logs)
    tally = ReasonTally([CENTRAL])
    round_(tally, consumer, {}, {(CENTRAL, 0): 3})
    assert tally.counts() == ((CENTRAL, "a", 3),)
    # Deleted and made again: its end went down; the old counts go, the new ones count.
    logs[(CENTRAL, 0)] = log("b")
    round_(tally, consumer, {}, {(CENTRAL, 0): 1})
    assert tally.counts() == ((CENTRAL, "b", 1),)
    # Retention removed offsets 1..9 before they were read: reading resumes at 10.
    logs[(CENTRAL, 0)] = log("c", "c", start=10)
    consumer.seeks.clear()
    round_(tally, consumer, {(CENTRAL, 0): 10}, {(CENTRAL, 0): 12})
    assert consumer.seeks == [(CENTRAL, 0, 10)]
    assert tally.counts() == ((CENTRAL, "b", 1), (CENTRAL, "c", 2))
    # The topic gone: its counts go with it.
    round_(tally, consumer, {}, {})
    assert tally.counts() == ()


def test_a_round_reads_at_most_max_records_and_the_next_goes_on() -> None:
    logs = {(CENTRAL, 0): log(*["a"] * 7)}
    consumer = Consumer(logs)
    tally = ReasonTally([CENTRAL], max_records=4)
    round_(tally, consumer, {}, {(CENTRAL, 0): 7})
    assert tally.counts() == ((CENTRAL, "a", 4),)
    round_(tally, consumer, {}, {(CENTRAL, 0): 7})
    assert tally.counts() == ((CENTRAL, "a", 7),)


def test_an_empty_topic_is_not_read() -> None:
    consumer = Consumer({})
    tally = ReasonTally([CENTRAL])
    round_(tally, consumer, {(CENTRAL, 0): 0}, {(CENTRAL, 0): 0})
    assert consumer.seeks == [] and tally.counts() == ()
