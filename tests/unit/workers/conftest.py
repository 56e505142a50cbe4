"""Fixtures of the workers' unit tests: a controllable model and polling helpers.

The model double (``GatedDouble``) is a real ``torch.nn.Module`` served by the
real runner, batcher and server; only its timing is in the test's hands: a
gate holds a forward pass in flight, so queueing, deadlines, backpressure and
drain are tested by construction, without sleeps or timed assertions.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
from workers_doubles import Eventually, GatedDouble  # type: ignore[import-not-found]

from workers.models import TensorModel


@pytest.fixture
def gated() -> GatedDouble:
    return GatedDouble()


@pytest.fixture
def gated_model(gated: GatedDouble) -> TensorModel:
    return TensorModel("double", gated, (4,), "float32")


@pytest.fixture
def eventually() -> Eventually:
    """Poll ``condition`` until true; fail with ``what`` after 20 s."""

    async def wait(condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + 20
        while not condition():
            if time.monotonic() > deadline:
                pytest.fail(f"timed out waiting for: {what}")
            await asyncio.sleep(0.002)

    return wait
