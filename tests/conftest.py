"""Session fixtures: the real local stack, started once by the same code as `edgefeed dev up`.

Integration tests ask for ``devstack`` (or a fixture built on it); unit tests
never start a service. Factory fixtures give each test its own topic, table and
clean region caches, so tests stay independent while sharing the services.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
import yaml
from stackhelpers import REGIONS, free_ports, stack_settings_mapping, unique_name

from edgefeed.devstack import DevStack
from edgefeed.settings import EdgefeedSettings, settings_from_mapping

# `make test` runs two pytest-xdist workers: the tests on the session's stack
# (tests/integration) in one, in collection order as in a plain run, and the tests
# that need no shared service in the other: the unit tests, then the benchmarks'
# smoke runs and the short fault suite, which start stacks of their own (scripts
# and benchmarks run as a user would). The second's CPU work fills the
# first's waits (alert `for:` durations, deadlines, app starts). The scheduler is
# xdist's by-scope one with these two scopes (its `--dist loadgroup` marks the
# node ids in a way pytest 9 no longer reads). A plain `pytest` runs as before.
_OWN_STACK = ("_benchmark_smoke.py", "/test_fault_suite_short.py")


def xdist_scope(nodeid: str) -> str:
    """The worker group of a test: "self-contained" or "session-stack"."""
    path = nodeid.split("::", 1)[0]
    if path.startswith("tests/unit/") or path.endswith(_OWN_STACK):
        return "self-contained"
    return "session-stack"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class TwoGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

    return TwoGroups(config, log)


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
