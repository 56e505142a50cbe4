"""The batcher's stats are counters: bounded for the server's life, and read."""

from __future__ import annotations

import dataclasses

import numpy as np
from workers_doubles import GatedDouble  # type: ignore[import-not-found]

from workers.batcher import BatcherStats, BatchingConfig
from workers.client import WorkerClient
from workers.models import TensorModel
from workers.server import InferenceServer


def test_batcher_stats_hold_only_counters() -> None:
    # A list field would grow by one entry per batch for as long as the server runs.
    kinds = {field.name: field.type for field in dataclasses.fields(BatcherStats)}
    assert set(kinds.values()) == {"int"}, kinds


async def test_rows_add_up_over_batches_and_show_in_the_models_listing(
    gated: GatedDouble, gated_model: TensorModel
) -> None:
    config = BatchingConfig(max_batch_size=8, max_queue_delay_s=0.0, inline_forward_s=0)
    async with (
        InferenceServer([gated_model], batching=config) as server,
        WorkerClient(server.url) as client,
    ):
        sizes = (3, 1, 4, 2)
        for n in sizes:  # one request at a time: one batch each
            await client.classify("double", np.zeros((n, 4), np.float32))
        stats = server.batcher("double").stats
        assert stats.rows == sum(sizes)
        listing = await client.models()
    batching = listing["models"][0]["batching"]
    assert batching["rows"] == stats.rows
    assert batching["batches"] == stats.batches
