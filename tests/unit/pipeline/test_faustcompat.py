"""pipeline.faustcompat's guards around Faust's consumer: no commit past a message
that was never acknowledged, a skipped message read again, and every message a
rebalance cleared from the streams read again."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace
from typing import Any

from faust.transport.consumer import Consumer
from faust.types import TP
from intervaltree import IntervalTree

from pipeline.faustcompat import (
    StuckHeads,
    head_missing,
    partition_offsets,
    patch_recovery_handover,
    patch_seek_every_partition,
    patch_strict_commits,
    seek_every_partition,
)

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


class FakeKafkaConsumer:
    """What :func:`seek_every_partition` uses of an aiokafka consumer: committed
    offsets as aiokafka reports them, and the seeks asked for."""

    def __init__(self, committed: dict[str, int | None], reset: str = "earliest") -> None:
        from aiokafka.consumer.fetcher import OffsetResetStrategy

        self.committed = committed
        self._fetcher = SimpleNamespace(_default_reset_strategy=OffsetResetStrategy.from_str(reset))
        self.positions: dict[str, int | str] = {}

    async def seek_to_committed(self) -> dict[str, int | None]:
        # aiokafka 0.14: ``if offset and offset > 0: self._fetcher.seek_to(tp, offset)``
        for tp, offset in self.committed.items():
            if offset and offset > 0:
                self.positions[tp] = offset
        return dict(self.committed)

    def seek(self, tp: str, offset: int) -> None:
        self.positions[tp] = offset

    async def seek_to_beginning(self, *tps: str) -> None:
        self.positions.update(dict.fromkeys(tps, "beginning"))

    async def seek_to_end(self, *tps: str) -> None:
        self.positions.update(dict.fromkeys(tps, "end"))


async def test_a_partition_never_committed_is_read_again_from_the_reset_position() -> None:
    kafka = FakeKafkaConsumer({"p0": None, "p1": 0, "p2": 7})
    committed = await seek_every_partition(kafka)
    # Without the patch p0 and p1 kept their fetch positions, past the messages
    # Faust had just cleared from its stream queues.
    assert kafka.positions == {"p0": "beginning", "p1": 0, "p2": 7}
    assert committed == {"p0": None, "p1": 0, "p2": 7}  # what Faust's perform_seek reads


async def test_the_reset_position_follows_auto_offset_reset() -> None:
    kafka = FakeKafkaConsumer({"p0": None}, reset="latest")
    await seek_every_partition(kafka)
    assert kafka.positions == {"p0": "end"}


async def test_faust_seeks_through_the_patch() -> None:
    from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread

    patch_seek_every_partition()
    patch_seek_every_partition()  # idempotent
    kafka = FakeKafkaConsumer({"p0": None})
    calls: list[Any] = []

    async def call_thread(fun: Any, *args: Any) -> Any:
        calls.append(fun)
        return await fun(*args)

    thread = SimpleNamespace(call_thread=call_thread, _ensure_consumer=lambda: kafka)
    assert await AIOKafkaConsumerThread.seek_to_committed(thread) == {"p0": None}  # type: ignore[arg-type]
    assert calls == [seek_every_partition]
    assert kafka.positions == {"p0": "beginning"}


async def test_no_stream_message_is_delivered_while_a_recovery_ends() -> None:
    """Faust's end of recovery seeks, then clears the stream queues: the consumer's
    flow must already be stopped when it begins (the recovery resumes it at its end)."""
    from faust.tables.recovery import Recovery

    patch_recovery_handover()
    patch_recovery_handover()  # idempotent
    flow = SimpleNamespace(active=True, stops=0)

    def stop_flow() -> None:
        flow.active = False
        flow.stops += 1

    seen: list[bool] = []

    async def original(self: Any, generation_id: int = 0) -> None:
        seen.append(flow.active)  # the callbacks, the seek and the clear run here
        self.app.consumer.resume_flow()

    def resume_flow() -> None:
        flow.active = True

    recovery: Any = SimpleNamespace(
        app=SimpleNamespace(consumer=SimpleNamespace(stop_flow=stop_flow, resume_flow=resume_flow))
    )
    klass: Any = Recovery
    saved = klass._edgefeed_original_on_recovery_completed
    klass._edgefeed_original_on_recovery_completed = original
    try:
        await Recovery.on_recovery_completed(recovery, 3)
    finally:
        klass._edgefeed_original_on_recovery_completed = saved
    assert seen == [False]
    assert flow.stops == 1 and flow.active


def test_partition_offsets_read_the_committed_offsets_and_highwaters_of_one_topic() -> None:
    other, changelog = TP(TOPIC.topic, 1), TP("ef-region-eu-west-states-changelog", 0)
    kafka_highwater = {TOPIC: 12, changelog: 99}  # partition 1: not fetched yet

    def highwater(tp: TP) -> int | None:
        return kafka_highwater.get(tp)

    state = consumer(10, [])
    state.assignment = lambda: {TOPIC, other, changelog}
    state.highwater = highwater
    app: Any = SimpleNamespace(_consumer=state)
    assert partition_offsets(app, TOPIC.topic) == {0: (10, 12), 1: (None, None)}
    assert partition_offsets(SimpleNamespace(_consumer=None), TOPIC.topic) == {}  # type: ignore[arg-type]

    def not_started() -> set[TP]:
        raise RuntimeError("ConsumerNotStarted")

    state.assignment = not_started
    assert partition_offsets(app, TOPIC.topic) == {}
