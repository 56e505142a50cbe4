"""Deadlines, backpressure, drain and readiness under concurrent load."""

from __future__ import annotations

import asyncio
import threading
import time

import aiohttp
import numpy as np
import pytest
from workers_doubles import Eventually, GatedDouble, metric_value  # type: ignore[import-not-found]

from workers.batcher import BatchingConfig, DynamicBatcher
from workers.client import WorkerClient
from workers.exceptions import DeadlineExceededError, DrainingError, WorkerResponseError
from workers.models import TensorModel
from workers.server import InferenceServer, ServerConfig


def _row(value: float) -> np.ndarray:
    return np.full(4, value, np.float32)


async def test_full_queue_answers_429_with_retry_after_and_admitted_requests_complete(
    gated: GatedDouble, gated_model: TensorModel, eventually: Eventually
) -> None:
    config = BatchingConfig(
        max_batch_size=1, max_queue_size=4, max_queue_delay_s=0.0, inline_forward_s=0
    )
    async with (
        InferenceServer([gated_model], batching=config) as server,
        WorkerClient(server.url) as client,
    ):
        gated.hold()
        admitted = [asyncio.create_task(client.classify("double", _row(0)))]
        await eventually(gated.in_forward.is_set, "first request in flight")
        for i in range(1, 5):
            admitted.append(asyncio.create_task(client.classify("double", _row(i))))
        await eventually(lambda: server.batcher("double").queue_depth == 4, "queue full")
        refused = await asyncio.gather(
            *(client.classify("double", _row(99)) for _ in range(6)), return_exceptions=True
        )
        gated.release()
        answers = await asyncio.gather(*admitted)
        async with aiohttp.ClientSession() as http, http.get(f"{server.url}/metrics") as response:
            metrics = await response.text()
    for error in refused:
        assert isinstance(error, WorkerResponseError)
        assert error.status == 429
        assert error.error_type == "QueueFullError"
        assert error.retryable
        assert error.retry_after_s is not None and error.retry_after_s >= 1
        # One truth: the message says to retry when Retry-After says (issue 30).
        assert f"retry after {error.retry_after_s:.0f} s" in str(error), str(error)
    assert [answer.body["outputs"][0][0] for answer in answers] == [0, 2, 4, 6, 8]
    assert 99.0 not in gated.values_run
    assert metric_value(metrics, "edgefeed_worker_rejected_total", reason="queue_full") == 6


async def test_request_that_cannot_meet_its_deadline_is_refused_at_admission() -> None:
    executed: list[int] = []

    def execute(batch):  # type: ignore[no-untyped-def]
        executed.append(len(batch))
        return [inputs[0] for inputs in batch], 0.0

    # The runner's estimate says a forward pass takes 500 ms.
    batcher = DynamicBatcher(execute, BatchingConfig(max_batch_size=4), lambda rows: 0.5)
    batcher.start()
    try:
        with pytest.raises(DeadlineExceededError, match=r"deadline of 100\.0 ms cannot be met"):
            await batcher.submit((np.zeros((1, 4), np.float32),), 1, deadline_s=0.1)
        result = await batcher.submit((np.ones((1, 4), np.float32),), 1, deadline_s=5.0)
    finally:
        await batcher.drain()
    assert executed == [1], "the refused request must never reach the model"
    np.testing.assert_array_equal(result.output, np.ones((1, 4), np.float32))
    assert batcher.stats.rejected_deadline == 1


async def test_queued_request_whose_deadline_passes_is_refused_not_served_late(
    gated: GatedDouble, gated_model: TensorModel, eventually: Eventually
) -> None:
    config = BatchingConfig(max_batch_size=1, max_queue_delay_s=0.0, inline_forward_s=0)
    async with (
        InferenceServer([gated_model], batching=config) as server,
        WorkerClient(server.url) as client,
    ):
        gated.hold()
        first = asyncio.create_task(client.classify("double", _row(1)))
        await eventually(gated.in_forward.is_set, "first request in flight")
        sent = time.monotonic()
        late = asyncio.create_task(client.classify("double", _row(7), deadline_ms=50))
        patient = asyncio.create_task(client.classify("double", _row(8), deadline_ms=60_000))
        await eventually(lambda: server.batcher("double").queue_depth == 2, "both queued")
        await eventually(lambda: time.monotonic() > sent + 0.06, "the 50 ms budget spent")
        gated.release()
        results = await asyncio.gather(first, late, patient, return_exceptions=True)
    error = results[1]
    assert isinstance(error, WorkerResponseError)
    assert error.status == 504
    assert error.error_type == "DeadlineExceededError"
    assert error.retryable
    assert 7.0 not in gated.values_run, "a request past its deadline must not be run"
    assert not isinstance(results[2], BaseException)
    assert results[2].body["outputs"] == [[16.0] * 4]


async def test_invalid_deadline_header_is_a_400(gated_model: TensorModel) -> None:
    async with InferenceServer([gated_model]) as server, aiohttp.ClientSession() as http:
        for bad in ("soon", "-5", "0", "nan"):
            async with http.post(
                f"{server.url}/v1/models/double/infer",
                data=_row(1).tobytes(),
                headers={
                    "Content-Type": "application/octet-stream",
                    "X-Tensor-Shape": "4",
                    "X-Tensor-Dtype": "float32",
                    "X-Edgefeed-Deadline-Ms": bad,
                },
            ) as response:
                body = await response.json()
                assert response.status == 400, bad
                assert "X-Edgefeed-Deadline-Ms" in body["error"]["message"]


async def test_drain_finishes_queued_requests_and_refuses_new_ones(
    gated: GatedDouble, gated_model: TensorModel, eventually: Eventually
) -> None:
    config = BatchingConfig(max_batch_size=2, max_queue_delay_s=0.0, inline_forward_s=0)
    server = InferenceServer(
        [gated_model], batching=config, config=ServerConfig(drain_timeout_s=30)
    )
    await server.start()
    client = WorkerClient(server.url)
    try:
        gated.hold()
        admitted = [asyncio.create_task(client.classify("double", _row(0)))]
        await eventually(gated.in_forward.is_set, "first batch in flight")
        admitted += [asyncio.create_task(client.classify("double", _row(i))) for i in (1, 2, 3)]
        await eventually(lambda: server.batcher("double").queue_depth == 3, "3 queued")
        stopping = asyncio.create_task(server.stop())
        await eventually(lambda: server.batcher("double").draining, "drain started")
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{server.url}/readyz") as response:
                assert response.status == 503
                assert (await response.json())["reason"] == "draining"
            async with http.get(f"{server.url}/healthz") as response:
                assert response.status == 200
        with pytest.raises(WorkerResponseError) as refused:
            await client.classify("double", _row(9))
        assert refused.value.status == 503
        assert refused.value.error_type == "DrainingError"
        assert refused.value.retry_after_s is not None
        assert not stopping.done()
        gated.release()
        answers = await asyncio.gather(*admitted)
        await stopping
    finally:
        gated.release()
        await client.aclose()
        await server.stop()
    assert [answer.body["outputs"][0][0] for answer in answers] == [0, 2, 4, 6]
    assert 9.0 not in gated.values_run


async def test_drain_timeout_fails_what_is_still_queued(eventually: Eventually) -> None:
    release = threading.Event()

    def execute(batch):  # type: ignore[no-untyped-def]
        release.wait(timeout=30)
        return [inputs[0] for inputs in batch], 0.0

    batcher = DynamicBatcher(execute, BatchingConfig(max_batch_size=1, max_queue_delay_s=0))
    first = asyncio.create_task(batcher.submit((np.zeros((1, 1)),), 1))
    second = asyncio.create_task(batcher.submit((np.ones((1, 1)),), 1))
    try:
        await eventually(
            lambda: batcher.stats.admitted == 2 and batcher.queue_depth == 1,
            "one request running, one queued",
        )
        assert not await batcher.drain(timeout_s=0.05)
        with pytest.raises(DrainingError, match="drain timeout"):
            await second
        with pytest.raises(DrainingError, match="while this request's batch was running"):
            await first
    finally:
        release.set()


async def test_readiness_turns_200_only_after_warm_up(
    gated: GatedDouble, gated_model: TensorModel, eventually: Eventually
) -> None:
    gated.hold()  # warm-up blocks in the first forward pass
    server = InferenceServer([gated_model])
    await server.start(wait_ready=False)
    try:
        async with aiohttp.ClientSession() as http:
            await eventually(gated.in_forward.is_set, "warm-up running")
            async with http.get(f"{server.url}/readyz") as response:
                assert response.status == 503
                assert (await response.json())["reason"] == "warming up"
            async with http.get(f"{server.url}/healthz") as response:
                assert response.status == 200
            async with http.post(f"{server.url}/v1/models/double/infer", data=b"") as response:
                assert response.status == 503
                assert response.headers["Retry-After"] == "1"
            gated.release()
            await eventually(lambda: server.ready, "ready")
            async with http.get(f"{server.url}/readyz") as response:
                assert response.status == 200
    finally:
        gated.release()
        await server.stop()
