"""The router's batches: by count or age, and no timer at all while the stream is quiet."""

from __future__ import annotations

import asyncio
import time

import pytest

from pipeline.runtime import QuietBatches


class Recorder:
    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    async def __call__(self, items: list[int]) -> None:
        await asyncio.sleep(0)
        self.batches.append(items)


async def until(condition: object, deadline_s: float = 10.0) -> None:
    end = time.monotonic() + deadline_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < end, "condition not met before the deadline"
        await asyncio.sleep(0.005)


async def test_a_full_batch_is_handed_over_at_once_in_order() -> None:
    handled = Recorder()
    batches = QuietBatches(3, 60.0, handled)
    for item in range(7):
        await batches.add(item)
    assert handled.batches == [[0, 1, 2], [3, 4, 5]]
    await batches.flush()
    assert handled.batches[-1] == [6]


async def test_a_batch_that_stops_growing_is_handed_over_once_it_is_within_old() -> None:
    handled = Recorder()
    batches = QuietBatches(100, 0.02, handled)
    task = asyncio.ensure_future(batches.run())
    try:
        await batches.add(1)
        await batches.add(2)
        await until(lambda: handled.batches == [[1, 2]])
        await batches.add(3)  # a new batch opens after a quiet spell
        await until(lambda: handled.batches == [[1, 2], [3]])
    finally:
        task.cancel()


async def test_a_quiet_stream_leaves_the_timer_asleep() -> None:
    calls = 0

    def clock() -> float:
        nonlocal calls
        calls += 1
        return time.monotonic()

    handled = Recorder()
    batches = QuietBatches(100, 0.001, handled, clock=clock)
    task = asyncio.ensure_future(batches.run())
    try:
        await asyncio.sleep(0.01)
        seen = calls
        await asyncio.sleep(0.1)  # a hundred of its batch windows
        assert calls == seen  # it never woke to look
        assert not task.done()
        await batches.add(1)
        await until(lambda: handled.batches == [[1]])
    finally:
        task.cancel()


def test_bad_limits_are_refused() -> None:
    with pytest.raises(ValueError, match="max_items 0"):
        QuietBatches(0, 0.02, Recorder())
