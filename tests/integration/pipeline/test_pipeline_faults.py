"""Faults on the real stack: hostile Debezium events that once crashed a region (and
crashed it again on every restart), a paused Redis, and a Redis that lost its data.

The workers are real ``edgefeed pipeline run`` processes; Redis is the session's
redis-server (paused with CLIENT PAUSE, emptied with FLUSHDB)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from e2e_harness import EDGEFEED, PipelineRun, pipeline_run  # noqa: F401 - the fixture
from test_pipeline_end_to_end import add_event, caught_up, read_all, redis_of, sql, wait_for
from test_pipeline_end_to_end import vector as read_vector

from edge_cache.exceptions import RegionUnavailableError

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("empty_region_caches")]

T0_MS = 1_780_315_200_000  # 2026-06-01T12:00:00Z


def debezium(run: PipelineRun, table: str, after: dict[str, Any], lsn: int, **source: Any) -> bytes:
    """A Debezium create event as Connect's JSON converter writes it (no schema)."""
    body = {
        "op": "c",
        "before": None,
        "after": after,
        "source": {"ts_ms": T0_MS, "schema": run.schema, "table": table, "lsn": lsn, **source},
        "ts_ms": T0_MS,
    }
    return json.dumps(body).encode()


def vector(run: PipelineRun, region: str, entity: str, entity_id: int) -> dict[str, Any] | None:
    """The entity's vector, or None while the region's Redis does not answer."""
    try:
        return read_vector(run, region, entity, entity_id)
    except RegionUnavailableError:
        return None


def hostile_events(run: PipelineRun) -> list[tuple[str, bytes]]:
    """What passed validation before and failed later, at the Redis or changelog write."""
    user = {"user_id": 2001, "home_region": "eu-west", "country": "DE", "segment": 1}
    item = {"item_id": 601, "category_id": 3, "price": "1.00"}
    event = {"event_id": 9001, "user_id": 2001, "item_id": 601, "category_id": 3,
             "price": "1.00", "home_region": "eu-west", "kind": "view",
             "occurred_at": "2026-06-01T12:00:00Z"}  # fmt: skip
    costly = {"event_id": 9002, "kind": "purchase", "price": "1e300"}
    return [
        ("users", debezium(run, "users", {**user, "segment": 2**40}, 10)),
        ("users", debezium(run, "users", {**user, "segment": "99999999999"}, 11)),
        ("users", debezium(run, "users", {**user, "user_id": 1.5}, 12)),
        ("users", debezium(run, "users", {**user, "user_id": True}, 13)),
        ("users", debezium(run, "users", {**user, "user_id": {}}, 14)),
        ("users", debezium(run, "users", {**user, "user_id": ""}, 15)),
        ("items", debezium(run, "items", {**item, "price": 1e39}, 16)),  # crashed 3 regions
        ("events", debezium(run, "events", {**event, "occurred_at": 1e300}, 17)),
        ("events", debezium(run, "events", {**event, "kind": "v" * 600_000}, 18)),
        ("events", debezium(run, "events", {**event, "blob": 2**70}, 19)),
        ("users", debezium(run, "users", user, 20, ts_ms=10**17)),
        # A price a float32 sum cannot hold: refused, not a missing spend_today all day.
        ("events", debezium(run, "events", {**event, **costly}, 21)),
    ]


def test_hostile_values_are_dead_lettered_and_never_crash_a_region(
    pipeline_run: PipelineRun,
) -> None:
    run = pipeline_run
    bootstrap = run.settings.kafka.bootstrap_servers
    source = run.settings.sources[0]
    poison = hostile_events(run)

    async def produce() -> None:
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, max_request_size=4 * 2**20)
        await producer.start()
        try:
            for table, value in poison:
                await producer.send_and_wait(source.topic_for(run.table(table)), value)
        finally:
            await producer.stop()

    asyncio.run(produce())
    sql(
        run,
        "INSERT INTO {s}.users (user_id, home_region, country, segment, email) VALUES "
        "(2002, 'eu-west', 'FR', 4, 'd@example.org')",
    )
    add_event(run, 2002, 601, 3, "2.00", "eu-west", "view", 1)
    wait_for(
        "user 2002 after the hostile events",
        lambda: (vector(run, "eu-west", "user", 2002) or {}).get("views_30m") == 1,
    )
    for name, proc in run.procs.items():
        assert proc.poll() is None, f"{name} exited"

    names = run.settings.pipeline.names
    by_topic = {
        topic: asyncio.run(read_all(bootstrap, topic))
        for topic in names.dead_letter_topics(run.settings.region_names)
    }
    dead = [r for records in by_topic.values() for r in records]
    reasons = sorted(
        dict(r.headers)["edgefeed-reason"].decode()
        for r in dead
        if dict(r.headers).get("edgefeed-offset") is not None and r.value != b"{this is not json"
    )
    # Every hostile event is dead-lettered once, by the router or by a region.
    assert len(reasons) >= len(poison)
    assert {"out-of-range", "bad-id", "too-large", "unencodable", "undecodable"} <= set(reasons)
    # Residency: every hostile personal row names eu-west: none of them in another
    # region's dead letters (the shared item's are in every region's), and no
    # personal row in the central ones.
    personal_topics = {source.topic_for(run.table(t)) for t in ("users", "events")}
    for region in run.settings.region_names:
        if region != "eu-west":
            for record in by_topic[names.region_dead_letter_topic(region)]:
                assert json.loads(record.value)["t"].endswith(".items"), region
    for record in by_topic[names.dead_letter_topic]:
        if dict(record.headers)["edgefeed-topic"].decode() in personal_topics:
            assert b"withheld" in record.value, "a personal row in the central dead letters"

    # A restart replays the changelog's tail after what its state folder holds, and
    # whatever was not acked: nothing crashes again.
    run.kill9("eu-west")
    restarted = started_log(run, "eu-west")
    assert "reading the changelog's tail after it" in restarted
    assert "rebuilding it from the changelog" not in restarted
    add_event(run, 2002, 601, 3, "2.00", "eu-west", "view", 0.5)
    wait_for(
        "user 2002 after a restart",
        lambda: (vector(run, "eu-west", "user", 2002) or {}).get("views_30m") == 2,
    )
    assert run.procs["eu-west"].poll() is None


def test_a_paused_redis_is_waited_for_and_nothing_is_lost(pipeline_run: PipelineRun) -> None:
    run = pipeline_run
    cache = redis_of(run, "us-east")
    sql(
        run,
        "INSERT INTO {s}.users (user_id, home_region, country, segment, email) VALUES "
        "(2101, 'us-east', 'US', 1, 'e@example.org')",
    )
    wait_for("user 2101", lambda: vector(run, "us-east", "user", 2101) is not None)
    # Redis answers nothing for 7 s (longer than the writer's 5 s socket timeout).
    cache.execute_command("CLIENT", "PAUSE", 7000, "ALL")
    for minutes in (3, 2, 1):
        add_event(run, 2101, 601, 3, "2.00", "us-east", "view", minutes)
    wait_for(
        "user 2101's three views after the pause",
        lambda: (vector(run, "us-east", "user", 2101) or {}).get("views_30m") == 3,
    )
    assert run.procs["us-east"].poll() is None


def test_a_redis_that_lost_its_data_is_refilled(pipeline_run: PipelineRun) -> None:
    run = pipeline_run
    sql(
        run,
        "INSERT INTO {s}.users (user_id, home_region, country, segment, email) VALUES "
        "(2201, 'ap-southeast', 'SG', 3, 'f@example.org')",
    )
    add_event(run, 2201, 601, 3, "2.00", "ap-southeast", "view", 1)
    wait_for(
        "user 2201",
        lambda: (vector(run, "ap-southeast", "user", 2201) or {}).get("views_30m") == 1,
    )
    redis_of(run, "ap-southeast").flushdb()  # a restart without persistence
    # No new event for the user: the worker notices the empty cache and writes its states.
    wait_for(
        "user 2201 written again",
        lambda: (vector(run, "ap-southeast", "user", 2201) or {}).get("segment") == 3,
        timeout_s=60,
    )
    assert (vector(run, "ap-southeast", "user", 2201) or {}).get("views_30m") == 1


def test_a_worker_killed_during_a_redis_outage_consumes_every_partitions_backlog(
    pipeline_run: PipelineRun,
) -> None:
    """Once, a worker restarted after a Redis-outage crash left one partition's backlog
    unread (committed offset stuck) until another restart."""
    run = pipeline_run
    bootstrap = run.settings.kafka.bootstrap_servers
    users = list(range(2301, 2311))  # keyed user:<id>: spread over both partitions
    sql(
        run,
        "INSERT INTO {s}.users (user_id, home_region, country, segment, email) "
        "SELECT u, 'eu-west', 'DE', 1, 'g@example.org' FROM unnest(%s::bigint[]) AS u",
        (users,),
    )
    wait_for("the new users", lambda: all(vector(run, "eu-west", "user", u) for u in users))
    redis_of(run, "eu-west").execute_command("CLIENT", "PAUSE", 8000, "WRITE")
    for user in users:
        add_event(run, user, 601, 3, "2.00", "eu-west", "view", 2)
    time.sleep(1.0)  # let the worker take some of them into a batch it cannot write
    run.kill9("eu-west")
    for user in users:
        add_event(run, user, 601, 3, "2.00", "eu-west", "click", 1)
    # Its host lost the state folder too (a new node): rebuilt from the changelog,
    # and it says so; the last test of this module checks every vector after it.
    shutil.rmtree(state_folder(run, "eu-west"))
    restarted = started_log(run, "eu-west")
    assert "no local state in" in restarted and "rebuilding it from the changelog" in restarted
    wait_for(
        "every user's view and click after the restart",
        lambda: all(
            (v := vector(run, "eu-west", "user", u)) is not None
            and (v["views_30m"], v["clicks_30m"]) == (1, 1)
            for u in users
        ),
        timeout_s=240,  # a restart and a recovery on a busy machine
    )
    group = run.settings.pipeline.region_app_id("eu-west")
    topic = run.settings.pipeline.region_topic("eu-west")
    wait_for(
        "the group's committed offset at the end of every partition",
        lambda: asyncio.run(caught_up(bootstrap, group, topic)),
        timeout_s=60,
    )


def state_folder(run: PipelineRun, region: str) -> Path:
    """The region's state folders on this host (pipeline.state_dir, relative to the
    workers' folder)."""
    state_dir = Path(run.settings.pipeline.state_dir or "")
    root = state_dir if state_dir.is_absolute() else run.logs / state_dir
    folder = root / run.settings.pipeline.region_app_id(region)
    assert folder.is_dir(), folder
    return folder


def started_log(run: PipelineRun, name: str) -> str:
    """Start ``name`` again; what its log says from this start until it is ready."""
    offset = run.spawn(name)
    run.wait_started(name, offset)
    with open(run.logs / f"{name}.log", "rb") as log:
        log.seek(offset)
        return log.read().decode("utf-8", "replace")


def verify(run: PipelineRun) -> tuple[int, dict[str, Any]]:
    done = subprocess.run(
        [EDGEFEED, "--settings", str(run.settings_file), "pipeline", "verify", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode in (0, 3), done.stdout + done.stderr
    return done.returncode, json.loads(done.stdout)


def test_after_every_fault_each_cache_equals_a_recomputation_from_postgres(
    pipeline_run: PipelineRun,
) -> None:
    """Runs last in this module: after the hostile events, the pause, the flush and the
    kill -9, every vector in every region equals the recomputation."""
    run = pipeline_run
    deadline = time.monotonic() + 90
    while True:
        code, report = verify(run)
        if code == 0 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert code == 0, [(m["region"], m["entity"], m["id"], m["what"]) for m in report["mismatches"]]
    assert report["checked"]["eu-west"] > 0 and report["unverifiable"] == []
    # The oracle can fail: a vector gone from eu-west and a personal vector that
    # leaked into us-east are both reported.
    eu, us = redis_of(run, "eu-west"), redis_of(run, "us-east")
    key = "ef:{user:2002}"
    leaked = eu.dump(key)
    assert leaked is not None
    us.restore(key, 0, leaked, replace=True)
    eu.delete(key)
    code, report = verify(run)
    assert code == 3
    found = {(m["region"], m["id"], m["what"]) for m in report["mismatches"]}
    assert found == {("eu-west", "2002", "missing"), ("us-east", "2002", "unexpected")}
