"""pipeline.faustcompat's guards around Faust's consumer: no commit past a message
that was never acknowledged, and a skipped message read again."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace
from typing import Any

from faust.transport.consumer import Consumer
from faust.types import TP
from intervaltree import IntervalTree

from pipeline.faustcompat import StuckHeads, head_missing, patch_strict_commits

TOPIC = TP("ef.shop.region.eu-west", 0)
DEBEZIUM = TP("shop.public.events", 0)  # may hold transaction markers: Faust's rules
patch_strict_commits([TOPIC.topic])


def consumer(
    committed: int | None, acked: list[int], gap: tuple[int, int] | None = None, tp: TP = TOPIC
) -> Any:
    """The bookkeeping Faust's ``Consumer._new_offset`` reads, for one partition."""
    state = SimpleNamespace(
        _committed_offset=defaultdict(lambda: None),
        _acked=defaultdict(list),
        _acked_index=defaultdict(set),
        _gap=defaultdict(IntervalTree),
        perform_seek_calls=0,
    )
    state._committed_offset[tp] = committed
    state._acked[tp] = list(acked)
    state._acked_index[tp] = set(acked)
    if gap is not None:
        state._gap[tp].addi(*gap)

    async def perform_seek() -> None:
        state.perform_seek_calls += 1

    state.perform_seek = perform_seek
    return state


def test_the_head_of_the_acked_offsets_must_be_the_committed_offset() -> None:
    assert head_missing(consumer(5, [6, 7]), TOPIC)
    assert not head_missing(consumer(5, [5, 6, 7]), TOPIC)
    assert not head_missing(consumer(5, [6, 7], gap=(5, 6)), TOPIC)  # 5 is not in the log
    assert not head_missing(consumer(None, [6, 7]), TOPIC)  # unknown: Faust's own rules
    assert not head_missing(consumer(5, []), TOPIC)
    assert not head_missing(consumer(5, [6, 7], tp=DEBEZIUM), DEBEZIUM)  # not a strict topic


def test_no_commit_past_a_message_that_was_never_acknowledged() -> None:
    patch_strict_commits([TOPIC.topic])  # idempotent (whatever patched it before this test)
    original: Any = Consumer._edgefeed_original_new_offset  # type: ignore[attr-defined]
    assert original is not Consumer._new_offset
    # Faust 0.15.3 as shipped: one unacknowledged message at the head is committed past.
    assert original(consumer(5, [6, 7]), TOPIC) == 8
    patched = Consumer._new_offset
    assert patched(consumer(5, [6, 7]), TOPIC) is None  # waits for offset 5
    assert patched(consumer(5, [5, 6, 7]), TOPIC) == 8
    assert patched(consumer(5, [6, 7], gap=(5, 6)), TOPIC) == 8
    assert patched(consumer(5, [5, 6, 9]), TOPIC) == 7  # the first consecutive run
    assert patched(consumer(5, [6, 7], tp=DEBEZIUM), DEBEZIUM) == 8  # Faust's own rule


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_a_skipped_message_is_read_again_after_a_while() -> None:
    state = consumer(5, [6, 7])
    clock = Clock()
    heads = StuckHeads(SimpleNamespace(_consumer=state), after_s=15.0, clock=clock)  # type: ignore[arg-type]
    await heads.tick()
    clock.now += 14.0
    await heads.tick()
    assert state.perform_seek_calls == 0  # acks may lag deliveries for a while
    clock.now += 1.0
    await heads.tick()
    assert state.perform_seek_calls == 1 and heads.reseeks == 1
    await heads.tick()
    assert state.perform_seek_calls == 1  # the clock starts again
    state._acked[TOPIC] = [5, 6, 7]  # read again and acknowledged
    clock.now += 30.0
    await heads.tick()
    assert state.perform_seek_calls == 1 and heads.since == {}


async def test_a_consumer_not_started_yet_is_left_alone() -> None:
    heads = StuckHeads(SimpleNamespace(_consumer=None))  # type: ignore[arg-type]
    await heads.tick()
    assert heads.reseeks == 0
