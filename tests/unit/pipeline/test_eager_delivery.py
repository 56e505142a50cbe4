"""pipeline.faustcompat's eager delivery: the router's fetch loop hands a message to
the streams without a task per message when the hand-over completes at once, and
with the original's semantics (a suspended flow cuts it short, errors propagate, a
stopped consumer is stopped) when it does not; every other app and call is Faust's.

``Consumer.wait_first`` here is Faust 0.15.3's, patched, called on a stand-in
holding the events it reads (a real consumer starts a thread with a loop of its
own)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from faust.transport.consumer import Consumer

from edgefeed.pipeline_config import pipeline_config
from edgefeed.settings import load_settings
from pipeline.app import build_region_app, build_router_app
from pipeline.faustcompat import LeanMonitor, patch_eager_delivery

patch_eager_delivery()


class StandIn(SimpleNamespace):
    """What ``wait_first`` reads of a consumer: its events and its loop."""

    async def wait_first(self, *coros: Any, timeout: Any = None) -> Any:
        return await Consumer.wait_first(self, *coros, timeout=timeout)


def make_consumer(eager: bool = True) -> Any:
    return StandIn(
        app=SimpleNamespace(edgefeed_eager_delivery=eager),
        _stopped=asyncio.Event(),
        _crashed=asyncio.Event(),
        suspend_flow=asyncio.Event(),
        loop=asyncio.get_running_loop(),
    )


def tasks_of(consumer: Any, *extra: Any) -> tuple[list[Any], Any]:
    """A hand-over that notes the task it ran in, and the call's other waitables."""
    ran_in: list[Any] = []

    async def deliver() -> int:
        ran_in.append(asyncio.current_task())
        return 7

    return ran_in, consumer.wait_first(deliver(), consumer.suspend_flow.wait(), *extra)


async def test_a_hand_over_that_completes_at_once_runs_in_the_fetch_loop() -> None:
    consumer = make_consumer()
    caller = asyncio.current_task()
    ran_in: list[Any] = []

    async def deliver() -> int:
        ran_in.append(asyncio.current_task())
        return 7

    results = await consumer.wait_first(deliver(), consumer.suspend_flow.wait())
    assert ran_in == [caller]  # no task of its own
    assert results.results == [7] and not results.stopped
    assert len(results.done) == 1


async def test_a_hand_over_that_suspends_is_driven_to_its_end() -> None:
    consumer = make_consumer()
    loop = asyncio.get_running_loop()
    first: asyncio.Future[str] = loop.create_future()
    second: asyncio.Future[str] = loop.create_future()
    steps: list[str] = []

    async def deliver() -> str:
        steps.append(await first)
        await asyncio.sleep(0)  # a bare yield on the way
        steps.append(await second)
        return "delivered"

    loop.call_soon(first.set_result, "a")
    loop.call_later(0.01, second.set_result, "b")
    results = await consumer.wait_first(deliver(), consumer.suspend_flow.wait())
    assert steps == ["a", "b"]
    assert results.results == ["delivered"] and not results.stopped


async def test_a_suspended_flow_still_cuts_a_waiting_hand_over_short() -> None:
    consumer = make_consumer()
    loop = asyncio.get_running_loop()
    never: asyncio.Future[None] = loop.create_future()
    cancelled: list[bool] = []

    async def deliver() -> None:
        try:
            await never  # a full stream queue
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    loop.call_later(0.01, consumer.suspend_flow.set)  # a rebalance
    suspended = consumer.suspend_flow.wait()
    results = await asyncio.wait_for(consumer.wait_first(deliver(), suspended), timeout=5)
    assert not results.stopped
    assert results.done == [suspended]  # the flow won; the hand-over did not finish
    await asyncio.sleep(0)  # the cancellation reaches the hand-over
    assert cancelled == [True]
    assert never.cancelled()


@pytest.mark.parametrize("suspends", [False, True])
async def test_an_error_in_the_hand_over_reaches_the_fetch_loop(suspends: bool) -> None:
    consumer = make_consumer()

    async def deliver() -> None:
        if suspends:
            await asyncio.sleep(0.001)
        raise ValueError("undecodable")

    with pytest.raises(ValueError, match="undecodable"):
        await consumer.wait_first(deliver(), consumer.suspend_flow.wait())


async def test_a_stopped_consumer_answers_stopped_as_before() -> None:
    consumer = make_consumer()
    consumer._stopped.set()
    ran_in, call = tasks_of(consumer)
    results = await call
    assert results.stopped
    assert results.done == [] and results.results == []
    assert asyncio.current_task() not in ran_in  # the original's tasks, if it ran at all


async def test_an_app_that_does_not_ask_gets_the_original() -> None:
    consumer = make_consumer(eager=False)  # a regional worker
    ran_in, call = tasks_of(consumer)
    results = await call
    assert results.results == [7]
    assert len(ran_in) == 1 and ran_in[0] is not asyncio.current_task()


async def test_other_calls_are_the_originals() -> None:
    consumer = make_consumer()
    event = asyncio.Event()
    asyncio.get_running_loop().call_soon(event.set)
    results = await consumer.wait_first(event)  # one waitable, not a coroutine
    assert results.done == [event] and not results.stopped
    # three waitables
    ran_in, call = tasks_of(consumer, asyncio.sleep(5))
    assert (await call).results == [7]
    assert ran_in[0] is not asyncio.current_task()
    # two, the first not a coroutine
    future = asyncio.get_running_loop().create_future()
    future.set_result(3)
    suspended = consumer.suspend_flow.wait()
    results = await consumer.wait_first(future, suspended)
    assert results.done == [future] and results.results == [3]


def test_only_the_router_asks_and_both_use_the_lean_monitor() -> None:
    root = Path(__file__).resolve().parents[3]
    settings = load_settings(root / "examples" / "edgefeed.yaml", env={})
    config = pipeline_config(settings, check_database=False)
    router = build_router_app(config)
    region = build_region_app(config, config.region_names[0])
    assert router.edgefeed_eager_delivery is True
    assert region.edgefeed_eager_delivery is False
    assert isinstance(router.monitor, LeanMonitor) and isinstance(region.monitor, LeanMonitor)


def test_the_lean_monitor_keeps_what_faust_reads_back() -> None:
    monitor = LeanMonitor()
    tp = ("shop.public.events", 0)
    monitor.on_message_in(tp, 41, object())
    assert monitor.on_stream_event_in(tp, 41, object(), object()) is None
    monitor.on_stream_event_out(tp, 41, object(), object(), None)
    monitor.on_message_out(tp, 41, object())
    assert monitor.tp_read_offsets[tp] == 41
    assert tp in monitor.stream_inbound_time  # Faust's slow-processing warnings read it
    assert monitor.events_total == 0 and monitor.messages_received_total == 0
