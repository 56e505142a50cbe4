"""Session fixtures: the real local stack, started once by the same code as `edgefeed dev up`.

Integration tests ask for ``devstack`` (or a fixture built on it); unit tests
never start a service. Factory fixtures give each test its own topic, table and
clean region caches, so tests stay independent while sharing the services.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import shutil
import socket
import tempfile
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psycopg
import pytest
import redis
import yaml

from edgefeed.devstack import DevStack
from edgefeed.settings import EdgefeedSettings, settings_from_mapping

REGIONS = (("eu-west", "eu"), ("us-east", "us"), ("ap-southeast", "apac"))
PG_PASSWORD = "edgefeed-test-secret"


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int, *, also_free_offset: int | None = None) -> list[int]:
    """Ports free right now, distinct, below the kernel's ephemeral range (32768+).

    Args:
        also_free_offset: Also require ``port + offset`` to be free (a Redis
            Cluster node uses its port + 10000 for the cluster bus).
    """
    rng = random.Random()
    ports: list[int] = []
    while len(ports) < count:
        port = rng.randrange(20000, 32000)
        if port in ports or not _bindable(port):
            continue
        if also_free_offset is not None and not _bindable(port + also_free_offset):
            continue
        ports.append(port)
    return ports


def stack_settings_mapping(ports: list[int]) -> dict[str, object]:
    broker, connect, pg, *redis_ports = ports
    return {
        "kafka": {
            "bootstrap_servers": f"127.0.0.1:{broker}",
            "session_timeout_ms": 6000,
            "fetch_max_wait_ms": 20,
        },
        "connect": {"url": f"http://127.0.0.1:{connect}", "timeout_s": 15},
        "database": {
            "host": "127.0.0.1",
            "port": pg,
            "dbname": "edgefeed",
            "user": "postgres",
            "password": PG_PASSWORD,
        },
        "regions": [
            {
                "name": name,
                "redis_url": f"redis://127.0.0.1:{port}/0",
                "residency_zone": zone,
                "failover": [other for other, _ in REGIONS if other != name],
            }
            for (name, zone), port in zip(REGIONS, redis_ports, strict=True)
        ],
    }


@pytest.fixture(scope="session")
def state_dir() -> Iterator[Path]:
    # Not pytest's tmp_path: PostgreSQL runs as 'postgres' when tests run as root and
    # must be able to enter every parent folder.
    path = Path(tempfile.mkdtemp(prefix="edgefeed-test-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def stack_mapping() -> dict[str, object]:
    return stack_settings_mapping(free_ports(3 + len(REGIONS)))


@pytest.fixture(scope="session")
def stack_settings(stack_mapping: dict[str, object]) -> EdgefeedSettings:
    return settings_from_mapping(stack_mapping)


@pytest.fixture(scope="session")
def stack_settings_file(stack_mapping: dict[str, object], state_dir: Path) -> Path:
    """The session stack's settings as an edgefeed.yaml, for CLI tests."""
    path = state_dir / "edgefeed.yaml"
    path.write_text(yaml.safe_dump(stack_mapping))
    return path


@pytest.fixture(scope="session")
def redis_cluster_ports() -> list[int]:
    return free_ports(3, also_free_offset=10000)


@pytest.fixture(scope="session")
def devstack(
    stack_settings: EdgefeedSettings, state_dir: Path, redis_cluster_ports: list[int]
) -> Iterator[DevStack]:
    """The whole local stack, up for the session, down at its end (even on failure)."""
    stack = DevStack(stack_settings, state_dir, redis_cluster_ports=redis_cluster_ports)
    try:
        stack.up()
        yield stack
    finally:
        stack.down()


@pytest.fixture(scope="session")
def redis_cluster_url(devstack: DevStack, redis_cluster_ports: list[int]) -> str:
    """URL of one node of the session's 3-node Redis Cluster."""
    return f"redis://127.0.0.1:{redis_cluster_ports[0]}/0"


@pytest.fixture
def region_redis(devstack: DevStack) -> Iterator[dict[str, redis.Redis]]:
    """A client per region, each cache flushed before the test."""
    clients = {
        region.name: redis.Redis.from_url(region.redis_url) for region in devstack.settings.regions
    }
    for client in clients.values():
        client.flushdb()
    yield clients
    for client in clients.values():
        client.close()


_unique = itertools.count()


def unique_name(prefix: str) -> str:
    return f"{prefix}_{os.getpid()}_{next(_unique)}_{uuid.uuid4().hex[:6]}"


@pytest.fixture
def make_topic(devstack: DevStack) -> Iterator[Callable[..., str]]:
    """Create topics with explicit partition counts (never rely on auto-creation)."""
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    bootstrap = ",".join(devstack.settings.kafka.bootstrap_servers)

    async def create(name: str, partitions: int) -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        try:
            await admin.create_topics(
                [NewTopic(name=name, num_partitions=partitions, replication_factor=1)]
            )
        finally:
            await admin.close()

    def factory(prefix: str = "t", partitions: int = 1) -> str:
        name = unique_name(prefix)
        # A thread of its own: the factory is also called from async tests' running loop.
        with ThreadPoolExecutor(max_workers=1) as pool:
            pool.submit(asyncio.run, create(name, partitions)).result()
        return name

    yield factory


@pytest.fixture
def pg_conn(devstack: DevStack) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    """An autocommit connection to the source database."""
    with psycopg.connect(devstack.settings.database.dsn(), autocommit=True) as conn:
        yield conn


@pytest.fixture
def make_table(
    pg_conn: psycopg.Connection[tuple[object, ...]],
) -> Iterator[Callable[[str, str], str]]:
    """Create a uniquely named table from a column list; dropped after the test."""
    created: list[str] = []

    def factory(prefix: str, columns: str) -> str:
        name = unique_name(prefix).lower()
        pg_conn.execute(f"CREATE TABLE public.{name} ({columns})")
        created.append(name)
        return name

    yield factory
    for name in created:
        pg_conn.execute(f"DROP TABLE IF EXISTS public.{name}")


async def read_topic(
    bootstrap: list[str], topic: str, *, count: int, deadline_s: float = 60
) -> list[tuple[bytes | None, bytes | None]]:
    """Read ``count`` records (key, value) from the start of ``topic``, waiting for it to exist."""
    import time

    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        auto_offset_reset="earliest",
        fetch_max_wait_ms=20,
        enable_auto_commit=False,
    )
    await consumer.start()
    records: list[tuple[bytes | None, bytes | None]] = []
    try:
        deadline = time.monotonic() + deadline_s
        while topic not in await consumer.topics():
            if time.monotonic() > deadline:
                raise AssertionError(f"topic {topic} did not appear within {deadline_s}s")
            await asyncio.sleep(0.2)
        consumer.subscribe([topic])
        while len(records) < count:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{len(records)} of {count} records on {topic} within {deadline_s}s"
                )
            batch = await consumer.getmany(timeout_ms=300)
            for partition_records in batch.values():
                records.extend((r.key, r.value) for r in partition_records)
    finally:
        await consumer.stop()
    return records


def drop_slot(conn: psycopg.Connection[tuple[object, ...]], slot: str, publication: str) -> None:
    """Drop a replication slot (waiting for its connector to let go) and its publication."""
    import time

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
            break
        except psycopg.errors.ObjectInUse:
            time.sleep(0.2)
        except psycopg.errors.UndefinedObject:
            break
    conn.execute(f'DROP PUBLICATION IF EXISTS "{publication}"')
