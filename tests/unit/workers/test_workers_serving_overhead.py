"""T_service broken down by phase, and what cut it: small batches on the event loop,
a queue delay no longer than the forward pass it could save, frozen start-up objects."""

from __future__ import annotations

import asyncio
import gc
import threading

import aiohttp
import numpy as np
import pytest
from workers_doubles import metric_value  # type: ignore[import-not-found]

from workers.batcher import BatchingConfig, DynamicBatcher
from workers.client import WorkerClient
from workers.inputs import NPY_TYPE, encode_npy
from workers.models import load_served_model
from workers.server import InferenceServer, ServerConfig
from workers.synthetic import shape_images
from workers.timing import HEADER_TIMING_DETAIL, SERVICE_PHASES, ServerTiming

IMAGES = shape_images(4, seed=5)[0]


async def test_answers_break_t_service_down_by_phase_when_asked_and_metrics_always() -> None:
    model = load_served_model("image-classifier")
    async with InferenceServer([model], config=ServerConfig(region="eu-west")) as server:
        async with WorkerClient(server.url) as client:
            plain = await client.classify("image-classifier", IMAGES[0])
            body = np.ascontiguousarray(IMAGES[1])
            detailed = await client.infer(
                "image-classifier", encode_npy(body), NPY_TYPE, headers={HEADER_TIMING_DETAIL: "1"}
            )
        async with aiohttp.ClientSession() as http, http.get(f"{server.url}/metrics") as r:
            metrics = await r.text()
    assert plain.phases_ms == {}, "the detail header is sent only when asked for"
    assert list(detailed.phases_ms) == list(SERVICE_PHASES)
    assert all(ms >= 0 for ms in detailed.phases_ms.values())
    # The phases are T_service, cut into pieces (3 decimals per header value).
    assert sum(detailed.phases_ms.values()) == pytest.approx(
        detailed.latency.service_s * 1e3, abs=0.01
    )
    for phase in SERVICE_PHASES:
        count = metric_value(
            metrics, "edgefeed_worker_phase_seconds_count", phase=phase, region="eu-west"
        )
        assert count == 2, phase


def test_phase_header_round_trips_and_a_malformed_one_is_ignored() -> None:
    timing = ServerTiming(0.001, 0.002, 0.003, 4, (("http", 0.0005), ("queue", 0.0025)))
    parsed = ServerTiming.from_headers(timing.headers(detail=True))
    assert parsed is not None
    assert parsed.phases == (("http", 0.0005), ("queue", 0.0025))
    assert "X-Edgefeed-T-Phases-Ms" not in timing.headers()
    broken = {**timing.headers(detail=True), "X-Edgefeed-T-Phases-Ms": "http"}
    assert ServerTiming.from_headers(broken) is None


async def test_small_batches_run_on_the_event_loop_and_large_ones_on_the_model_thread() -> None:
    threads: list[int] = []

    def execute(batch):  # type: ignore[no-untyped-def]
        threads.append(threading.get_ident())
        return [inputs[0] * 2 for inputs in batch], 0.0001

    # The estimate: 1 row 0.1 ms (under the 1 ms inline limit), 2 rows or more 5 ms.
    def estimate(rows: int) -> float:
        return 0.0001 if rows <= 1 else 0.005

    config = BatchingConfig(max_batch_size=4, max_queue_delay_s=0.0)
    batcher = DynamicBatcher(execute, config, estimate, inline=True)
    try:
        small = await batcher.submit((np.ones((1, 2), np.float32),), 1)
        large = await batcher.submit((np.ones((3, 2), np.float32),), 3)
    finally:
        await batcher.drain()
    loop_thread = threading.get_ident()
    assert threads[0] == loop_thread
    assert threads[1] != loop_thread
    np.testing.assert_array_equal(small.output, np.full((1, 2), 2, np.float32))
    np.testing.assert_array_equal(large.output, np.full((3, 2), 2, np.float32))


async def test_without_inline_every_batch_runs_on_the_model_thread() -> None:
    threads: list[int] = []

    def execute(batch):  # type: ignore[no-untyped-def]
        threads.append(threading.get_ident())
        return [inputs[0] for inputs in batch], 0.0

    config = BatchingConfig(max_batch_size=4, max_queue_delay_s=0.0, inline_forward_s=0)
    batcher = DynamicBatcher(execute, config, lambda rows: 0.0001, inline=True)
    try:
        await batcher.submit((np.ones((1, 2), np.float32),), 1)
    finally:
        await batcher.drain()
    assert threads == [threads[0]] and threads[0] != threading.get_ident()


async def test_a_lone_request_waits_no_longer_than_the_forward_pass_it_could_save() -> None:
    def execute(batch):  # type: ignore[no-untyped-def]
        return [inputs[0] for inputs in batch], 0.0001

    # An hour of queue delay; the model takes 0.1 ms. Waiting is capped at the
    # estimate, so the request is answered (with a fixed delay it would wait an hour).
    adaptive = BatchingConfig(max_batch_size=8, max_queue_delay_s=3600)
    batcher = DynamicBatcher(execute, adaptive, lambda rows: 0.0001)
    try:
        result = await asyncio.wait_for(batcher.submit((np.ones((1, 2)),), 1), timeout=60)
    finally:
        await batcher.drain()
    assert result.batch_rows == 1

    fixed = BatchingConfig(max_batch_size=8, max_queue_delay_s=3600, adaptive_delay=False)
    batcher = DynamicBatcher(execute, fixed, lambda rows: 0.0001)
    try:
        waiting = asyncio.ensure_future(batcher.submit((np.ones((1, 2)),), 1))
        await asyncio.sleep(0.2)
        assert not waiting.done(), "a fixed window waits for partners"
        assert batcher.queue_depth == 1
    finally:
        await batcher.drain(timeout_s=30)  # draining sends what is queued
    assert (await waiting).batch_rows == 1


async def test_server_freezes_start_up_objects_and_counts_gc_pauses() -> None:
    model = load_served_model("image-classifier")
    gc.unfreeze()
    try:
        async with InferenceServer([model], config=ServerConfig(region="eu-west")) as server:
            frozen = gc.get_freeze_count()
            gc.collect(0)
            async with aiohttp.ClientSession() as http, http.get(f"{server.url}/metrics") as r:
                metrics = await r.text()
        assert frozen > 10_000, "torch and the model are out of the collector's reach"
        pauses = metric_value(
            metrics, "edgefeed_worker_gc_pause_seconds_count", generation="0", region="eu-west"
        )
        assert pauses is not None and pauses >= 1
    finally:
        gc.unfreeze()
