"""Every answer carries T_data, T_model, T_service; the client adds T_network; metrics agree."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import numpy as np
import pytest
from workers_doubles import metric_value  # type: ignore[import-not-found]

from workers.batcher import BatchingConfig
from workers.bench import closed_loop, latency_table
from workers.client import InferenceAnswer, WorkerClient
from workers.inputs import NPY_TYPE, encode_npy
from workers.models import load_served_model
from workers.server import InferenceServer, ServerConfig
from workers.synthetic import shape_images
from workers.timing import LatencyBreakdown, ServerTiming

IMAGES = shape_images(8, seed=2)[0]


async def test_answer_headers_carry_the_server_terms_and_they_add_up() -> None:
    model = load_served_model("image-classifier")
    async with InferenceServer([model]) as server, aiohttp.ClientSession() as http:
        start = time.perf_counter()
        async with http.post(
            f"{server.url}/v1/models/image-classifier/infer",
            data=encode_npy(IMAGES[0]),
            headers={"Content-Type": NPY_TYPE},
        ) as response:
            await response.read()
            round_trip = time.perf_counter() - start
            headers = response.headers
    timing = ServerTiming.from_headers(headers)
    assert timing is not None
    assert timing.data_s > 0 and timing.model_s > 0 and timing.service_s >= 0
    assert float(headers["X-Edgefeed-T-Server-Ms"]) == pytest.approx(
        float(headers["X-Edgefeed-T-Data-Ms"])
        + float(headers["X-Edgefeed-T-Model-Ms"])
        + float(headers["X-Edgefeed-T-Service-Ms"]),
        abs=0.002,
    )
    assert timing.server_s <= round_trip
    assert headers["Server-Timing"].startswith("data;dur=")
    assert "model;dur=" in headers["Server-Timing"]


async def test_client_breakdown_sums_to_the_round_trip_and_metrics_count_every_term() -> None:
    model = load_served_model("image-classifier")
    async with InferenceServer(
        [model], batching=BatchingConfig(max_batch_size=4), config=ServerConfig(region="eu-west")
    ) as server:
        async with WorkerClient(server.url) as client:
            start = time.perf_counter()
            answer = await client.classify("image-classifier", IMAGES[0])
            round_trip = time.perf_counter() - start
            await asyncio.gather(*(client.classify("image-classifier", im) for im in IMAGES))
        async with aiohttp.ClientSession() as http, http.get(f"{server.url}/metrics") as r:
            metrics = await r.text()
    latency = answer.latency
    assert latency.network_s >= 0
    # T_total is the client's own round trip (measured inside the outer one), split
    # into the server's terms and T_network: the four add up to it exactly.
    assert latency.total_s <= round_trip
    assert latency.total_s == pytest.approx(answer.round_trip_s, abs=1e-6)
    assert latency.network_s == pytest.approx(
        answer.round_trip_s - latency.data_s - latency.model_s - latency.service_s, abs=1e-6
    )
    for term in ("data", "model", "service", "server"):
        count = metric_value(
            metrics,
            "edgefeed_worker_latency_seconds_count",
            term=term,
            model="image-classifier",
            region="eu-west",
        )
        assert count == 9, term
    assert metric_value(metrics, "edgefeed_worker_requests_total", status="200") == 9
    # Every served row is counted once; warm-up batches are not.
    assert metric_value(metrics, "edgefeed_worker_batch_rows_sum") == 9


async def test_closed_loop_reports_all_four_terms() -> None:
    model = load_served_model("image-classifier")

    async def send(c: WorkerClient, n: int) -> InferenceAnswer:
        return await c.classify("image-classifier", IMAGES[n % len(IMAGES)])

    batching = BatchingConfig(max_batch_size=8)
    async with (
        InferenceServer([model], batching=batching) as server,
        WorkerClient(server.url) as client,
    ):
        result = await closed_loop(client, send, concurrency=4, requests=24, warmup_requests=4)
    assert len(result.latencies) == 24 and not result.errors
    rows = latency_table(result)
    assert [row[0] for row in rows] == ["network", "data", "model", "service", "total"]
    for _, p50, p95, p99 in rows:
        assert 0 <= p50 <= p95 <= p99
    summary = result.summary()
    assert summary["requests"] == 24
    assert np.isclose(
        np.median(result.values_ms("total")), summary["latency_ms"]["total"]["p50"], atol=1e-3
    )  # type: ignore[index]


async def test_a_paced_loop_sends_no_request_before_its_slot() -> None:
    sent: dict[int, float] = {}
    in_flight = peak = 0

    async def send(c: WorkerClient, n: int) -> InferenceAnswer:
        nonlocal in_flight, peak
        sent[n] = time.perf_counter()
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0)
        in_flight -= 1
        return InferenceAnswer(body={}, latency=LatencyBreakdown(0.0, 0.0, 0.0, 0.0), batch_rows=1)

    began = time.perf_counter()
    result = await closed_loop(None, send, concurrency=4, requests=20, rate=200.0)  # type: ignore[arg-type]
    assert len(result.latencies) == 20 and sorted(sent) == list(range(20))
    # Request n waits for its slot, n / rate after the start (5 ms apart here):
    # unpaced, all 20 would go within a millisecond.
    for n, at in sent.items():
        assert at - began >= n / 200.0 - 0.002, (n, at - began)
    assert result.elapsed_s >= 19 / 200.0 - 0.002
    assert peak <= 4


async def test_a_rate_that_is_not_positive_is_refused() -> None:
    async def send(c: WorkerClient, n: int) -> InferenceAnswer:
        raise AssertionError("nothing may be sent")

    for rate in (0.0, -5.0, float("nan")):
        with pytest.raises(ValueError, match="must be a positive number"):
            await closed_loop(None, send, concurrency=1, requests=1, rate=rate)  # type: ignore[arg-type]
