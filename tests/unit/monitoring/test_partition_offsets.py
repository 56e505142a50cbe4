"""The monitor's offset reads survive a topic that vanishes mid-collection."""

from __future__ import annotations

from typing import Any

from kafka import TopicPartition

from monitoring.kafka import partition_offsets

LIVE = {TopicPartition("orders", 0): 7, TopicPartition("orders", 1): 3}
GONE = TopicPartition("mon-router-history", 0)


def broker(calls: list[list[Any]]) -> Any:
    """kafka-python's end_offsets against a broker whose ListOffsets answer lacks a
    partition DescribeTopics listed (a topic deleted in between): KeyError."""

    def end_offsets(tps: list[Any]) -> dict[Any, int]:
        calls.append(list(tps))
        answer: dict[Any, int] = {}
        for tp in tps:
            answer[tp] = LIVE[tp]  # KeyError for the vanished one, as kafka-python raises
        return answer

    return end_offsets


def test_a_vanished_partition_is_left_out_and_every_other_is_read() -> None:
    calls: list[list[Any]] = []
    got = partition_offsets(broker(calls), [*LIVE, GONE])
    assert got == LIVE
    assert calls[0] == [*LIVE, GONE]  # one request first; one by one only after the race


def test_no_race_is_one_request() -> None:
    calls: list[list[Any]] = []
    assert partition_offsets(broker(calls), list(LIVE)) == LIVE
    assert len(calls) == 1


def test_no_partitions_asks_nothing() -> None:
    calls: list[list[Any]] = []
    assert partition_offsets(broker(calls), []) == {}
    assert calls == []
