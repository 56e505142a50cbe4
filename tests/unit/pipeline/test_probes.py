"""The readiness decisions of the pipeline's processes (pipeline.probes), with plain
values: a regional worker is ready once recovered and caught up, an idle one too,
and a worker behind by more than the bound is not, saying by how much."""

from __future__ import annotations

import pytest

from pipeline.exceptions import PipelineConfigError
from pipeline.probes import PartitionMarks, Readiness, RegionReadiness, partition_marks

NOW = 1_764_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def worker(max_behind_s: float = 30.0) -> tuple[RegionReadiness, Clock]:
    clock = Clock()
    return RegionReadiness(max_behind_s, clock=clock), clock


def test_not_ready_until_the_partitions_are_recovered() -> None:
    readiness, _ = worker()
    assert readiness.check() == (False, "starting: waiting for an assignment of partitions")
    readiness.recovered([0, 1])
    ok, reason = readiness.check()
    assert not ok and "waiting for the first offsets" in reason  # recovered, not yet observed
    readiness.observe({0: PartitionMarks(10, committed=10), 1: PartitionMarks(0)})
    assert readiness.check() == (True, "ready: caught up on 2 partitions")


def test_a_rebalance_makes_it_recover_again() -> None:
    readiness, _ = worker()
    readiness.recovered([0])
    readiness.observe({0: PartitionMarks(5, committed=5)})
    assert readiness.check()[0]
    readiness.rebalancing()
    assert readiness.check() == (False, "recovering partitions (rebalance)")
    readiness.recovered([0, 1])
    assert not readiness.check()[0]  # what was known before the rebalance is forgotten
    readiness.observe({0: PartitionMarks(5, committed=5), 1: PartitionMarks(7, committed=7)})
    assert readiness.check() == (True, "ready: caught up on 2 partitions")


def test_an_idle_worker_is_ready_however_old_its_last_change() -> None:
    readiness, clock = worker()
    readiness.recovered([0])
    # Its last change was committed a day ago and nothing came since: caught up.
    readiness.observe({0: PartitionMarks(42, committed=40, taken=42, newest_commit_s=NOW - 86400)})
    clock.now += 10
    assert readiness.check() == (True, "ready: caught up on 1 partition")


def test_a_recovered_worker_with_an_empty_log_is_ready() -> None:
    readiness, _ = worker()
    readiness.recovered([0, 1, 2])
    # Never committed (None) and nothing in the log (highwater 0).
    readiness.observe({p: PartitionMarks(0, committed=None) for p in (0, 1, 2)})
    assert readiness.check() == (True, "ready: caught up on 3 partitions")


def test_a_worker_keeping_up_is_ready_with_messages_in_flight() -> None:
    readiness, clock = worker()
    readiness.recovered([0])
    # A steady stream: messages always waiting, the newest taken a moment old.
    readiness.observe(
        {0: PartitionMarks(1000, committed=900, taken=990, newest_commit_s=NOW - 0.2)}
    )
    clock.now += 0.5
    ok, reason = readiness.check()
    assert ok, reason
    assert reason == "ready: 1 partition, behind 0.7 s at most (partition 0, 10 messages waiting)"


def test_a_worker_behind_by_more_than_the_bound_is_not_ready_and_says_by_how_much() -> None:
    readiness, clock = worker(max_behind_s=30.0)
    readiness.recovered([0, 1])
    readiness.observe(
        {
            0: PartitionMarks(10, committed=10),  # caught up
            1: PartitionMarks(5000, committed=100, taken=200, newest_commit_s=NOW - 41.5),
        }
    )
    clock.now += 0.5
    assert readiness.check() == (
        False,
        "behind: 42.0 s (partition 1, 4800 messages waiting; bound 30 s)",
    )
    # It catches up: ready again.
    readiness.observe({0: PartitionMarks(10, committed=10), 1: PartitionMarks(5000, taken=5000)})
    assert readiness.check() == (True, "ready: caught up on 2 partitions")


def test_a_restarted_worker_with_a_backlog_is_not_ready_until_it_has_caught_up() -> None:
    readiness, clock = worker()
    readiness.recovered([0])
    readiness.observe({0: PartitionMarks(9000, committed=1000)})  # nothing taken yet
    ok, reason = readiness.check()
    assert not ok
    assert reason == "catching up: 8000 messages waiting on partition 0, none taken yet"
    # Replaying changes an hour old: an hour behind, however long since it recovered.
    for step in range(5):
        clock.now += 20
        readiness.observe(
            {0: PartitionMarks(9000, 1000, 2000 + step * 1000, NOW - 3600 + step * 60)}
        )
        ok, reason = readiness.check()
        assert not ok and reason.startswith("behind: "), reason
    readiness.observe({0: PartitionMarks(9000, 1000, 9000, clock.now - 0.1)})
    assert readiness.check()[0]


def test_a_rare_change_on_a_quiet_partition_does_not_look_late() -> None:
    readiness, clock = worker()
    readiness.recovered([0])
    readiness.observe({0: PartitionMarks(7, committed=7, taken=7, newest_commit_s=NOW - 600)})
    clock.now += 1
    # A change came: the consumer saw the new end before the worker took it. The last
    # change taken is 10 minutes old, but the partition was caught up a second ago.
    readiness.observe({0: PartitionMarks(8, committed=7, taken=7, newest_commit_s=NOW - 600)})
    ok, reason = readiness.check()
    assert ok, reason
    assert reason == "ready: 1 partition, behind 1.0 s at most (partition 0, 1 message waiting)"


def test_a_stalled_worker_becomes_not_ready_once_past_the_bound() -> None:
    readiness, clock = worker(max_behind_s=30.0)
    readiness.recovered([0])
    readiness.observe({0: PartitionMarks(50, committed=50, taken=50, newest_commit_s=NOW - 1)})
    # The cache stopped answering: the worker takes nothing while messages arrive.
    for _ in range(40):
        clock.now += 1
        readiness.observe({0: PartitionMarks(60, committed=50, taken=50, newest_commit_s=NOW - 1)})
    ok, reason = readiness.check()
    assert not ok and reason.startswith("behind: 40.0 s"), reason


def test_the_seconds_shown_past_the_bound_are_past_it() -> None:
    # 2.04 s behind a 2 s bound once read "behind: 2.0 s (...; bound 2 s)": tenths
    # are rounded up when not ready.
    readiness, clock = worker(max_behind_s=2.0)
    readiness.recovered([0])
    readiness.observe({0: PartitionMarks(9, committed=5, taken=5, newest_commit_s=NOW)})
    clock.now += 2.04
    readiness.observe({0: PartitionMarks(9, committed=5, taken=5, newest_commit_s=NOW)})
    assert readiness.check() == (
        False,
        "behind: 2.1 s (partition 0, 4 messages waiting; bound 2 s)",
    )
    clock.now += 2.01  # and no report since
    assert readiness.check() == (False, "no progress report for 2.1 s (event loop blocked?)")


def test_no_report_for_longer_than_the_bound_is_not_ready() -> None:
    readiness, clock = worker(max_behind_s=30.0)
    readiness.recovered([0])
    readiness.observe({0: PartitionMarks(5, committed=5)})
    clock.now += 29
    assert readiness.check()[0]
    clock.now += 2  # the event loop stopped reporting
    assert readiness.check() == (False, "no progress report for 31.0 s (event loop blocked?)")


def test_a_partition_not_fetched_yet_is_not_ready() -> None:
    readiness, _ = worker()
    readiness.recovered([0, 1])
    readiness.observe({0: PartitionMarks(5, committed=5), 1: PartitionMarks(None, committed=3)})
    assert readiness.check() == (False, "catching up: partition 1 not fetched yet")
    readiness.observe({0: PartitionMarks(5, committed=5)})  # not in the consumer's assignment
    assert readiness.check() == (False, "catching up: partition 1 not fetched yet")


def test_a_worker_without_partitions_is_ready_once_recovered() -> None:
    readiness, _ = worker()
    readiness.recovered([])
    assert readiness.check() == (
        True,
        "ready: no partitions assigned (more workers than partitions)",
    )


def test_the_bound_must_be_positive() -> None:
    with pytest.raises(PipelineConfigError, match="ready_max_behind_s 0"):
        RegionReadiness(0)


@pytest.mark.parametrize(
    ("mark", "waiting"),
    [
        (PartitionMarks(None, committed=5), None),
        (PartitionMarks(10, committed=None), 10),  # never committed: from offset 0
        (PartitionMarks(10, committed=4, taken=8), 2),  # taken beyond the committed offset
        (PartitionMarks(10, committed=6, taken=3), 4),  # taken before a seek back: committed
        (PartitionMarks(10, committed=12), 0),  # a stale highwater never counts below 0
    ],
)
def test_messages_waiting(mark: PartitionMarks, waiting: int | None) -> None:
    assert mark.waiting == waiting


def test_partition_marks_join_the_consumer_offsets_and_the_workers_progress() -> None:
    marks = partition_marks({0: (5, 9), 1: (None, 0)}, {0: (8, 1_764_000_000_500), 3: (1, 1)})
    assert marks == {
        0: PartitionMarks(9, 5, 8, 1_764_000_000.5),
        1: PartitionMarks(0, None, None, None),  # nothing taken since the recovery
    }


def test_a_process_flag_says_why_until_set() -> None:
    readiness = Readiness("starting: connecting")
    assert readiness.check() == (False, "starting: connecting")
    readiness.set(True, "ready: forwarding region eu-west")
    assert readiness.check() == (True, "ready: forwarding region eu-west")
