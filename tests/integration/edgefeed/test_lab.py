"""A short latency lab on the real local stack: every topology deployed, every term
read from the client and the workers' headers, and the terms adding up."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import psycopg
import pytest
import redis
from psycopg_pool import AsyncConnectionPool

from edge_cache import AsyncFeatureClient
from edgefeed.devstack import DevStack
from edgefeed.lab import LabOptions
from edgefeed.lab.data import ITEM_QUERY, USER_QUERY, LabData, seed_events, write_edge_cache
from edgefeed.lab.report import render_html
from edgefeed.lab.run import run_lab
from workers.distill import LAB_STUDENT
from workers.features import EdgeCacheFeatureSource
from workers.sqlfeatures import SqlFeatureSource

pytestmark = pytest.mark.integration


@pytest.fixture
def lab_stack(devstack: DevStack) -> Iterator[DevStack]:
    """The session stack; the lab's schema and its keys in the region's Redis (vectors,
    schemas, freshness records, which other modules' monitors would report) are
    removed afterwards."""
    yield devstack
    with psycopg.connect(devstack.settings.database.dsn(), autocommit=True) as conn:
        conn.execute("DROP SCHEMA IF EXISTS edgefeed_lab CASCADE")
    region = devstack.settings.region(LabOptions().region)
    with redis.Redis.from_url(region.redis_url) as client:
        for entity in (LAB_STUDENT.user_entity, LAB_STUDENT.item_entity):
            for key in client.scan_iter(match=f"*{entity}*"):
                client.delete(key)


async def test_a_short_lab_measures_every_term_of_every_topology(lab_stack: DevStack) -> None:
    options = LabOptions(requests=4, warmup=1, image_requests=2, users=200, items=100, events=5000)
    result = await run_lab(lab_stack.settings, options)

    assert [s.key for s in result.ranking] == ["central", "edge-sql", "edge-edgefeed"]
    assert [s.key for s in result.images] == ["image-raw", "image-edge-pre", "image-edge"]
    for summary in result.ranking:
        assert summary.requests == 4
        assert set(summary.terms) == {"network", "data", "model", "service", "total"}
    for key, samples in result.samples.items():
        for sample in samples:
            # The four terms add up to the measured total (the client's clock, plus the
            # edge's preprocessing before the upload)...
            assert sample.total_ms == pytest.approx(sample.measured_ms, abs=1.0), key
            # ...which the lab's outer clock contains.
            assert sample.wall_ms >= sample.measured_ms, key
            assert min(sample.network_ms, sample.data_ms, sample.model_ms) > 0, key
            assert sample.service_ms >= 0, key
            assert sample.wire_bytes > 0, key
    wan = {s.key: s.wan_bytes for s in result.ranking}
    assert wan["edge-sql"] > 0, "the edge without cache queries PostgreSQL across the WAN"
    assert wan["central"] == 0 and wan["edge-edgefeed"] == 0
    image = {s.key: s for s in result.images}
    assert image["image-raw"].wire_bytes > result.photo_bytes, "the whole JPEG crossed"
    assert image["image-edge-pre"].wire_bytes < result.photo_bytes / 10, "the envelope crossed"
    assert result.ratio is not None
    assert set(result.accuracy) == {"teacher_fp32", "student_fp32", "student_int8"}

    html = render_html(result.ranking, result.images, ratio=result.ratio)
    for key in ("central", "edge-sql", "edge-edgefeed", "image-raw"):
        assert f'class="topology" data-key="{key}"' in html


async def test_the_edge_cache_holds_what_the_per_request_sql_computes(lab_stack: DevStack) -> None:
    settings = lab_stack.settings
    dsn = settings.database.dsn()
    data = LabData(users=50, items=40)
    position = seed_events(dsn, data, 3000)
    user_schema, item_schema = LAB_STUDENT.schemas()
    written = await write_edge_cache(
        dsn, settings.region("eu-west"), user_schema, item_schema, data, position
    )
    assert written == 90

    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        dsn, min_size=1, max_size=1, open=False, kwargs={"autocommit": True}
    )
    await pool.open(wait=True, timeout=30)
    sql = SqlFeatureSource(pool, {"lab_user": USER_QUERY, "lab_item": ITEM_QUERY})
    cache = EdgeCacheFeatureSource(
        AsyncFeatureClient.from_settings(settings, "eu-west", [user_schema, item_schema])
    )
    try:
        for entity, ids in (("lab_user", data.user_ids()), ("lab_item", data.item_ids())):
            from_sql, sql_missing = await sql.get(entity, ids)
            from_cache, cache_missing = await cache.get(entity, ids)
            assert not sql_missing.any() and not cache_missing.any()
            np.testing.assert_allclose(from_cache, from_sql, rtol=1e-6)
        assert from_sql[:, 1].sum() > 0, "items were viewed in the last 30 minutes"
        unknown, missing = await sql.get("lab_item", ["no-such-item"])
        assert missing.all() and np.isnan(unknown).all()
    finally:
        await sql.aclose()
        await cache.aclose()
