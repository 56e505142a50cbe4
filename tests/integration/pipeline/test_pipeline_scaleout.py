"""Scale-out on the real stack (issue 13): a region run by two, then three workers, one
of them killed -9 while changes flow, and a partition's previous owner writing a late
changelog record; every region ends equal to a recomputation from PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from typing import Any

import psycopg
import pytest
from aiokafka import AIOKafkaProducer
from e2e_harness import PipelineRun, pipeline_run  # noqa: F401 - the fixture
from test_pipeline_end_to_end import add_event, read_all, sql, wait_for
from test_pipeline_faults import verify

from pipeline.statestore import EPOCH_HEADER, ROW_SEP

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("empty_region_caches")]

REGIONS = ("eu-west", "us-east", "ap-southeast")
USERS = {region: [4000 + 100 * i + n for n in range(12)] for i, region in enumerate(REGIONS)}
ITEMS = list(range(701, 709))


class Load:
    """Inserts, updates and deletes events in a thread until stopped (about 60 changes
    a second: enough for every partition to have work in flight at each fault)."""

    def __init__(self, run: PipelineRun) -> None:
        self.run = run
        self.done = threading.Event()
        self.changes = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        rng = random.Random(13)
        schema = self.run.schema
        try:
            with psycopg.connect(self.run.settings.database.dsn(), autocommit=True) as conn:
                while not self.done.is_set():
                    region = rng.choice(REGIONS)
                    user, item = rng.choice(USERS[region]), rng.choice(ITEMS)
                    kind = rng.choice(("view", "view", "click", "purchase", "add_to_cart"))
                    conn.execute(
                        f"INSERT INTO {schema}.events (user_id, item_id, category_id, price, "
                        "home_region, kind, occurred_at) VALUES (%s, %s, %s, 2.50, %s, %s, "
                        "now() - make_interval(secs => %s))",
                        (user, item, item % 3, region, kind, rng.randrange(600)),
                    )
                    if rng.random() < 0.15:  # an older event changes or goes
                        verb = rng.choice(("UPDATE", "DELETE"))
                        target = (
                            f"event_id = (SELECT min(event_id) FROM {schema}.events "
                            "WHERE user_id = %s)"
                        )
                        if verb == "UPDATE":
                            conn.execute(
                                f"UPDATE {schema}.events SET kind = 'click' WHERE {target}", (user,)
                            )
                        else:
                            conn.execute(f"DELETE FROM {schema}.events WHERE {target}", (user,))
                    self.changes += 1
                    time.sleep(0.015)
        except BaseException as exc:  # surfaced by the test
            self.error = exc

    def start(self) -> None:
        self.thread.start()

    def wait_for_more(self, count: int) -> None:
        """Block until ``count`` more changes were made (the load keeps going)."""
        target = self.changes + count
        wait_for(f"{count} more changes", lambda: self.changes >= target or bool(self.error))
        assert self.error is None, self.error

    def stop(self) -> None:
        self.done.set()
        self.thread.join(timeout=60)
        assert not self.thread.is_alive()
        assert self.error is None, self.error


def settled(run: PipelineRun, what: str, timeout_s: float = 420) -> None:
    """Poll ``edgefeed pipeline verify`` until every region equals the recomputation."""
    last: dict[str, Any] = {}

    def equal() -> bool:
        nonlocal last
        code, last = verify(run)
        return code == 0

    try:
        wait_for(what, equal, timeout_s=timeout_s)
    except AssertionError as exc:
        found = last.get("mismatches", last)
        raise AssertionError(f"{exc}; differences: {found!s:.3000}") from None


async def replay_as_old_owner(run: PipelineRun, user: int) -> int:
    """Append to eu-west's changelog the first records of ``user`` again, as the owner of
    epoch 1 would if it had stalled with them in flight: a late, older state. Returns how
    many records were appended."""
    bootstrap = run.settings.kafka.bootstrap_servers
    topic = run.settings.pipeline.names.changelog_topic("eu-west")
    first: dict[bytes, Any] = {}
    for record in await read_all(bootstrap, topic):
        key = record.key or b""
        text = json.loads(key) if key.startswith(b'"') else key.decode()
        if text.split(ROW_SEP)[0] == f"user:{user}" and record.value:
            first.setdefault(key, record)
    assert first, f"user {user} has no records in {topic}"
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        for key, record in first.items():
            await producer.send_and_wait(
                topic,
                record.value,
                key=key,
                partition=record.partition,
                headers=[(EPOCH_HEADER, b"1")],
            )
    finally:
        await producer.stop()
    return len(first)


@pytest.mark.timeout(1800)
def test_two_then_three_workers_a_kill_and_a_late_old_owner_equal_a_recomputation(
    pipeline_run: PipelineRun,
) -> None:
    run = pipeline_run
    for region, users in USERS.items():
        for user in users:
            sql(
                run,
                "INSERT INTO {s}.users (user_id, home_region, country, segment, email) "
                "VALUES (%s, %s, 'XX', 1, 's@example.org')",
                (user, region),
            )
    for item in ITEMS:
        sql(
            run,
            "INSERT INTO {s}.items (item_id, category_id, price) VALUES (%s, %s, 2.50)",
            (item, item % 3),
        )
    run.start("eu-west-2", region="eu-west")  # eu-west: two workers
    load = Load(run)
    load.start()
    try:
        load.wait_for_more(300)
        run.start("eu-west-3", region="eu-west")  # a third joins under load
        load.wait_for_more(300)
        run.kill9("eu-west-2")  # one is killed under load
        load.wait_for_more(300)
    finally:
        load.stop()
    settled(run, "two, then three workers, one killed -9")

    # A previous owner's late checkpoint: the first records of a user who has had
    # several events since, written again under epoch 1. The next owner's recovery
    # must ignore them; had it taken them, the user's next change would be computed
    # on that older state and its vector would differ from the recomputation.
    user = USERS["eu-west"][0]
    add_event(run, user, ITEMS[0], 1, "2.50", "eu-west", "view", 1)
    assert asyncio.run(replay_as_old_owner(run, user)) >= 2
    run.kill9("eu-west")
    run.kill9("eu-west-3")
    run.start("eu-west")
    for minutes in (0.5, 0.25):
        add_event(run, user, ITEMS[1], 2, "2.50", "eu-west", "view", minutes)
    settled(run, "a late record of a previous owner")
