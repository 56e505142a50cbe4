"""Issue 34 on the real stack: rows the windows need that the stream never carried
(history that begins after them: a lost broker, a retention shorter than a window, a
new deployment over recent rows) are rebuilt by the router without an operator, and
the region says it is rebuilding until they are in its cache."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
from e2e_harness import (
    SAMPLERS,
    FreshnessSampler,
    PipelineRun,
    freshness_line,
    shop_pipeline,
    shop_settings,
    snapshot_span_s,
)
from stackhelpers import unique_name

from connectors.config import notification_topic
from edge_cache import KeyLayout
from edgefeed.devstack import DevStack
from edgefeed.verify import verify
from monitoring.freshness import read_region
from pipeline.history import read_records

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("empty_region_caches")]

REGION = "eu-west"
USERS = range(3001, 3201)  # 200 users of eu-west
# One every 6 min over the last 15 hours, inside the 1d windows: 30,000 rows, the size
# of the feature backfill whose streamed freshness docs/pipeline.md quotes.
EVENTS_PER_USER = 150


@pytest.fixture
def run(
    devstack: DevStack,
    stack_mapping: dict[str, Any],
    tmp_path: Path,
    region_redis: dict[str, redis.Redis],  # flushed before the pipeline starts, not after
) -> Iterator[tuple[PipelineRun, dict[str, Any]]]:
    tag = unique_name("hist").lower()
    schema = f"s_{tag}"
    mapping = shop_settings(stack_mapping, schema, tag)
    anchor = datetime.now(UTC)

    def history(conn: psycopg.Connection[Any]) -> None:
        # Events written before the connector existed: the stream never carries them.
        conn.execute(
            f"INSERT INTO {schema}.events (user_id, item_id, category_id, price, home_region, "
            "kind, occurred_at) SELECT u, 100 + i %% 7, i %% 3, 1.50, %s, "
            "CASE WHEN i %% 4 = 0 THEN 'purchase' ELSE 'view' END, "
            "%s::timestamptz - make_interval(mins => 6 * i) "
            "FROM generate_series(%s::int, %s::int) AS u, generate_series(1, %s::int) AS i",
            (REGION, anchor, USERS.start, USERS.stop - 1, EVENTS_PER_USER),
        )

    with shop_pipeline(mapping, schema, tmp_path, [], seed=history) as pipeline:
        yield pipeline, mapping


class RebuildWatch(threading.Thread):
    """Reads the region as `edgefeed lag` does, every 20 ms, and keeps what it saw."""

    def __init__(self, pipeline: PipelineRun) -> None:
        super().__init__(name="rebuild-watch", daemon=True)
        self.region = pipeline.settings.region(REGION)
        self.seen: set[tuple[str, ...]] = set()
        self.halt = threading.Event()

    def run(self) -> None:
        async def poll() -> None:
            while not self.halt.is_set():
                times = await read_region(
                    REGION,
                    self.region.redis_url,
                    sample_size=0,
                    redis_options=self.region.redis_options("reader"),
                )
                self.seen.add(times.rebuilding)
                await asyncio.sleep(0.02)

        asyncio.run(poll())


@pytest.mark.timeout(900)
def test_rows_the_stream_never_carried_are_rebuilt_without_an_operator(
    run: tuple[PipelineRun, dict[str, Any]], region_redis: dict[str, redis.Redis]
) -> None:
    pipeline, _mapping = run
    settings = pipeline.settings
    watch = RebuildWatch(pipeline)
    test_started = time.time()
    watch.start()
    # Views stream in while the rebuild runs: how fresh they stay is measured.
    sampler = FreshnessSampler(settings, pipeline.schema, REGION)
    try:
        pipeline.start(REGION)
        pipeline.start("router")  # the router checks the history at start
        sampler.start()
        router_log = pipeline.logs / "router.log"
        deadline = time.monotonic() + 300
        # Users: covered, or rebuilt when the router's check saw the sampler's users
        # (rows of a table without windows that its topic does not begin with).
        for done in (
            (f"history of {pipeline.table('events')} rebuilt",),
            (
                f"history of {pipeline.table('users')} covers",
                f"history of {pipeline.table('users')} rebuilt",
            ),
        ):
            while not any(line in router_log.read_text() for line in done):
                assert time.monotonic() < deadline, f"not in the router's log: {done}"
                time.sleep(0.2)
        after_from = time.time()
        # The users stream in (their latest values are not windowed).
        with psycopg.connect(settings.database.dsn(), autocommit=True) as conn:
            conn.execute(
                f"INSERT INTO {pipeline.table('users')} (user_id, home_region, country, "
                "segment, email) SELECT u, %s, 'DE', 1, 'x@example.org' "
                "FROM generate_series(%s::int, %s::int) u",
                (REGION, USERS.start, USERS.stop - 1),
            )
        while time.time() < after_from + 5:  # 5 s of streamed views after the rebuild
            time.sleep(0.2)
        sampler.wait_seen(time.time(), timeout_s=120)
        sampler.stop()
        deadline = time.monotonic() + 300
        while True:
            report = verify(settings, [REGION])
            if report.ok and report.checked[REGION] >= len(USERS) + len(SAMPLERS):
                break
            assert time.monotonic() < deadline, report.to_dict()["mismatches"][:5]
            time.sleep(1)
        # The region is listed as rebuilding only until the rows are in its cache.
        cache = region_redis[REGION]
        end = time.monotonic() + 60
        while cache.hlen(KeyLayout().rebuild_key()) and time.monotonic() < end:
            time.sleep(0.2)
        assert cache.hlen(KeyLayout().rebuild_key()) == 0
    finally:
        if sampler.is_alive():
            sampler.stop()
        watch.halt.set()
        watch.join(timeout=30)
    assert ("item", "user") in watch.seen, watch.seen  # `edgefeed lag` showed the rebuild
    assert () in watch.seen
    # Streamed freshness while the rebuild's snapshots ran (events', then users' when
    # the router's check saw the sampler's users first), and after it (printed for
    # docs/pipeline.md; no timing is asserted).
    notes = notification_topic(settings.sources[0])
    started, completed = snapshot_span_s(
        settings.kafka.bootstrap_servers, notes, since=test_started
    )
    during = [t for wall, t in sampler.samples if started <= wall <= completed]
    after = [t for wall, t in sampler.samples if wall > after_from]
    assert during and after, (started, completed, len(sampler.samples))
    print(freshness_line("while the rebuild ran", during))
    print(freshness_line("after it", after))
    # The router recorded the history complete, and a restart does not rebuild again.
    names = settings.pipeline.names
    records = asyncio.run(read_records(settings.kafka.bootstrap_servers, names.history_topic, {}))
    assert {state["state"] for state in records.values()} == {"complete"}
    record = records[f"{pipeline.table('events')}.occurred_at"]
    assert record["id"].startswith("rebuild-")
    assert len(records) == 3  # events by time; users and items whole
    gap = f"rows of {pipeline.table('events')} that the features of item, user still need"
    log = (pipeline.logs / "router.log").read_text()
    assert log.count(gap) == 1
    pipeline.kill9("router")
    pipeline.start("router")
    recorded = f"history of {pipeline.table('events')} covers its windows (recorded complete)"
    deadline = time.monotonic() + 120
    while recorded not in (pipeline.logs / "router.log").read_text():
        assert time.monotonic() < deadline, "the restarted router did not check its history"
        time.sleep(0.2)
    assert (pipeline.logs / "router.log").read_text().count(gap) == 1  # not again
