"""Dynamic batching: same answers as unbatched, real batches formed, failures isolated."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from workers_doubles import POISON, Eventually, GatedDouble  # type: ignore[import-not-found]

from workers.batcher import BatchingConfig
from workers.client import WorkerClient
from workers.exceptions import WorkerResponseError
from workers.models import TensorModel, load_served_model
from workers.runtime import ModelRunner, RuntimeConfig
from workers.server import InferenceServer
from workers.synthetic import shape_images
from workers.train_demo import HELD_OUT_SEED


async def _classify_all(
    batching: BatchingConfig, images: np.ndarray
) -> tuple[np.ndarray, list[int]]:
    model = load_served_model("image-classifier")
    async with (
        InferenceServer([model], batching=batching) as server,
        WorkerClient(server.url) as client,
    ):
        answers = await asyncio.gather(
            *(client.classify("image-classifier", image) for image in images)
        )
    logits = np.array([answer.body["predictions"][0]["logits"] for answer in answers])
    return logits, [answer.batch_rows for answer in answers]


async def test_batched_results_equal_unbatched_results() -> None:
    images, _ = shape_images(48, seed=HELD_OUT_SEED)
    alone, alone_rows = await _classify_all(BatchingConfig(max_batch_size=1), images)
    batched, batched_rows = await _classify_all(
        BatchingConfig(max_batch_size=16, max_queue_delay_s=0.05, adaptive_delay=False), images
    )
    assert set(alone_rows) == {1}
    assert max(batched_rows) > 1, "48 concurrent requests never shared a batch"
    np.testing.assert_allclose(batched, alone, rtol=1e-4, atol=1e-4)


def test_runner_splits_rows_back_per_request() -> None:
    model = load_served_model("image-classifier")
    runner = ModelRunner(model.module, RuntimeConfig(device="cpu", max_batch_rows=8))
    images, _ = shape_images(6, seed=3)
    requests = [(images[0:1],), (images[1:4],), (images[4:6],)]
    outputs, seconds = runner.execute(requests)
    assert [out.shape for out in outputs] == [(1, 6), (3, 6), (2, 6)]
    assert seconds > 0
    for request, output in zip(requests, outputs, strict=True):
        alone, _ = runner.execute([request])
        np.testing.assert_allclose(output, alone[0], rtol=1e-4, atol=1e-5)


async def test_requests_with_several_rows_batch_and_come_back_in_order(
    gated: GatedDouble, gated_model: TensorModel, eventually: Eventually
) -> None:
    config = BatchingConfig(max_batch_size=8, max_queue_delay_s=0.0, inline_forward_s=0)
    async with (
        InferenceServer([gated_model], batching=config) as server,
        WorkerClient(server.url) as client,
    ):
        gated.hold()
        first = asyncio.create_task(client.classify("double", np.full((1, 4), 9, np.float32)))
        await eventually(gated.in_forward.is_set, "first batch in flight")
        sizes = (3, 1, 4)
        arrays = [
            np.arange(n * 4, dtype=np.float32).reshape(n, 4) + 100 * i for i, n in enumerate(sizes)
        ]
        tasks = [asyncio.create_task(client.classify("double", a)) for a in arrays]
        await eventually(lambda: server.batcher("double").queue_depth == 3, "3 requests queued")
        gated.release()
        answers = await asyncio.gather(first, *tasks)
    for array, answer in zip(arrays, answers[1:], strict=True):
        assert answer.batch_rows == 8
        np.testing.assert_array_equal(np.array(answer.body["outputs"]), array * 2)
    assert gated.rows_run[-1] == 8


async def test_preferred_batch_size_goes_without_waiting_for_the_queue_delay(
    gated: GatedDouble, gated_model: TensorModel, eventually: Eventually
) -> None:
    # A one-hour queue delay: only the preferred size can make the batch go. Triton's
    # rule (no adaptive cap): with the cap, a lone request waits only the estimated
    # forward pass, and the two requests went alone whenever the second came later.
    config = BatchingConfig(
        max_batch_size=8,
        preferred_batch_sizes=(2,),
        max_queue_delay_s=3600,
        adaptive_delay=False,
        inline_forward_s=0,
    )
    async with (
        InferenceServer([gated_model], batching=config) as server,
        WorkerClient(server.url) as client,
    ):
        answers = await asyncio.gather(
            *(client.classify("double", np.full(4, i, np.float32)) for i in range(2))
        )
    assert [answer.batch_rows for answer in answers] == [2, 2]


async def test_failing_batch_fails_only_its_own_requests(
    gated: GatedDouble, gated_model: TensorModel, eventually: Eventually
) -> None:
    config = BatchingConfig(max_batch_size=2, max_queue_delay_s=0.0, inline_forward_s=0)
    async with (
        InferenceServer([gated_model], batching=config) as server,
        WorkerClient(server.url) as client,
    ):
        gated.hold()
        first = asyncio.create_task(client.classify("double", np.full(4, 1, np.float32)))
        await eventually(gated.in_forward.is_set, "first batch in flight")
        values = [POISON, 2.0, 3.0, 4.0]  # batches: [poison, 2] and [3, 4]
        tasks = []
        batcher = server.batcher("double")
        for count, value in enumerate(values, start=1):
            tasks.append(
                asyncio.create_task(client.classify("double", np.full(4, value, np.float32)))
            )
            # Queue them one by one so the batches are exactly [poison, 2] and [3, 4].
            await eventually(lambda n=count: batcher.queue_depth == n, f"{count} queued")
        gated.release()
        results = await asyncio.gather(first, *tasks, return_exceptions=True)
        after = await client.classify("double", np.full(4, 5, np.float32))
    assert not isinstance(results[0], BaseException)
    for failed in results[1:3]:
        assert isinstance(failed, WorkerResponseError)
        assert failed.status == 500
        assert failed.error_type == "ModelExecutionError"
        assert failed.retryable
        assert "poison row" in str(failed)
    for value, ok in zip((3.0, 4.0), results[3:], strict=True):
        assert not isinstance(ok, BaseException)
        assert ok.body["outputs"] == [[value * 2] * 4]
    assert after.body["outputs"] == [[10.0] * 4]


def test_batching_config_rejects_impossible_values() -> None:
    from workers.exceptions import WorkerConfigError

    with pytest.raises(WorkerConfigError, match="preferred batch sizes \\[64\\]"):
        BatchingConfig(max_batch_size=32, preferred_batch_sizes=(64,))
    with pytest.raises(WorkerConfigError, match="max_batch_size 0"):
        BatchingConfig(max_batch_size=0)


class _BrokenRender(TensorModel):
    def render(self, prepared, output):  # type: ignore[no-untyped-def]
        if float(output[0][0]) == 0.0:
            raise KeyError("label table out of date")
        return super().render(prepared, output)


async def test_a_bug_answering_one_request_is_a_500_and_the_worker_keeps_serving(
    gated: GatedDouble,
) -> None:
    model = _BrokenRender("double", gated, (4,), "float32")
    async with InferenceServer([model]) as server, WorkerClient(server.url) as client:
        with pytest.raises(WorkerResponseError) as error:
            await client.classify("double", np.zeros(4, np.float32))
        answer = await client.classify("double", np.ones(4, np.float32))
    assert error.value.status == 500
    assert "internal error: KeyError" in str(error.value)
    assert answer.body["outputs"] == [[2.0] * 4]
