"""Dead letters counted by reason, from their ``edgefeed-reason`` header.

Every dead letter the pipeline writes carries its reason in a header
(pipeline.runtime.router.dead_letter_headers). The offsets say how many there
are; the reasons need the records. A :class:`ReasonTally` lives as long as its
monitor and reads each dead-letter partition from where it stopped the round
before, so a round reads only the new dead letters, never the whole topic again,
and a round that cannot finish (a huge backlog, a slow broker) goes on the next.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

__all__ = ["NO_REASON", "REASON_HEADER", "ReasonTally"]

REASON_HEADER = "edgefeed-reason"
NO_REASON = "(no reason header)"

TopicPartitionKey = tuple[str, int]


class ReasonTally:
    """Counts per dead-letter topic and reason, read incrementally.

    Args:
        topics: The dead-letter topics to count.
        max_records: Records read per round at most (the rest wait for the next).
    """

    def __init__(self, topics: list[str], *, max_records: int = 20_000) -> None:
        self.topics = frozenset(topics)
        self._max_records = max_records
        self._next: dict[TopicPartitionKey, int] = {}
        self._end: dict[TopicPartitionKey, int] = {}
        self._counts: dict[TopicPartitionKey, Counter[str]] = {}

    def counts(self) -> tuple[tuple[str, str, int], ...]:
        """``(topic, reason, count)`` of every dead letter read so far, by topic and reason."""
        total: Counter[tuple[str, str]] = Counter()
        for (topic, _partition), reasons in self._counts.items():
            for reason, count in reasons.items():
                total[(topic, reason)] += count
        return tuple((t, r, n) for (t, r), n in sorted(total.items()))

    def to_read(
        self, oldest: Mapping[TopicPartitionKey, int], end: Mapping[TopicPartitionKey, int]
    ) -> dict[TopicPartitionKey, int]:
        """The partitions that may hold unread dead letters, with the offset to read from.

        A partition whose end offset went down (the topic was deleted and made
        again: a live partition's end never does) starts over, its old counts
        dropped; one whose oldest offset passed what was read (retention) resumes
        at the oldest.
        """
        wanted: dict[TopicPartitionKey, int] = {}
        for key, end_offset in end.items():
            if key[0] not in self.topics:
                continue
            start = oldest.get(key, 0)
            position = self._next.get(key)
            if position is None or end_offset < self._end.get(key, 0):
                self._counts.pop(key, None)
                position = start
            self._end[key] = end_offset
            position = max(position, start)
            self._next[key] = position
            # ">=": some Kafka-protocol brokers (Tansu) report a partition's end as
            # the start of its last record batch, so records may lie past it.
            if end_offset >= position and end_offset > start:
                wanted[key] = position
        for key in [k for k in self._next if k not in end]:
            del self._next[key]
            self._end.pop(key, None)
            self._counts.pop(key, None)
        return wanted

    def add(self, key: TopicPartitionKey, offset: int, headers: Any) -> None:
        """Count one record of ``key`` at ``offset`` (records before the position are skipped)."""
        if offset < self._next.get(key, 0):
            return
        reason = NO_REASON
        for name, value in headers or ():
            if name == REASON_HEADER and value:
                reason = bytes(value).decode("utf-8", "replace")
                break
        self._counts.setdefault(key, Counter())[reason] += 1
        self._next[key] = offset + 1

    def read(
        self, consumer: Any, wanted: Mapping[TopicPartitionKey, int], deadline_s: float
    ) -> None:
        """Read ``wanted`` partitions from their offsets with ``consumer`` (kafka-python's
        ``KafkaConsumer``, group-less) until nothing more comes, ``max_records`` or
        the deadline."""
        from kafka import TopicPartition

        if not wanted:
            return
        tps = {TopicPartition(t, p): (t, p) for t, p in wanted}
        consumer.assign(list(tps))
        for tp, key in tps.items():
            consumer.seek(tp, wanted[key])
        read = 0
        deadline = time.monotonic() + deadline_s
        while read < self._max_records and time.monotonic() < deadline:
            batch = consumer.poll(timeout_ms=200, max_records=min(1000, self._max_records - read))
            if not batch:
                break
            for tp, records in batch.items():
                key = tps[tp]
                for record in records:
                    self.add(key, record.offset, record.headers)
                    read += 1
