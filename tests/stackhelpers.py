"""Helpers shared by the tests: free ports, unique names, the stack's settings,
reading topics. An importable module (``from stackhelpers import ...``), since
``conftest`` names several modules in this tree."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from connectors.database import drop_slot
from edgefeed.devstack.ports import free_ports

if TYPE_CHECKING:
    from connectors.client import ConnectClient
    from edgefeed.devstack import DevStack
    from edgefeed.settings import EdgefeedSettings

__all__ = [
    "PG_PASSWORD",
    "REGIONS",
    "drop_slot",
    "free_ports",
    "read_topic",
    "source_with_connector",
    "stack_settings_mapping",
    "start_pipeline",
    "start_service",
    "stop_process_group",
    "stop_service",
    "unique_name",
]

REGIONS = (("eu-west", "eu"), ("us-east", "us"), ("ap-southeast", "apac"))
PG_PASSWORD = "edgefeed-test-secret"


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


_unique = itertools.count()


def unique_name(prefix: str) -> str:
    return f"{prefix}_{os.getpid()}_{next(_unique)}_{uuid.uuid4().hex[:6]}"


def score_pipeline(prefix: str, table: str) -> dict[str, object]:
    """The settings' ``pipeline`` (topics and groups named after ``prefix``, one
    partition) and ``entities`` for the pipeline tests' one entity: ``pref``, not
    personal, keyed by ``id``, whose int32 ``score`` is the latest value of
    ``public.<table>.score``."""
    source = f"public.{table}"
    return {
        "pipeline": {
            "app_prefix": prefix,
            "region_topic_prefix": f"{prefix}.region",
            "dead_letter_topic": f"{prefix}.deadletter",
            "partitions": 1,
            "commit_interval_s": 0.5,
        },
        "entities": [
            {
                "name": "pref",
                "personal": False,
                "tables": {source: "id"},
                "latest": [{"name": "score", "table": source, "column": "score", "dtype": "int32"}],
            }
        ],
    }


def source_with_connector(
    cleanup: contextlib.ExitStack, settings: EdgefeedSettings, table: str, *, score: str = "int"
) -> ConnectClient:
    """Create ``public.<table>`` (id bigint, score of the SQL type ``score``) and the
    settings' sources' Debezium connectors, running; ``cleanup`` deletes the
    connector, then drops the first source's slot, publication and the table, and
    closes the returned client."""
    import psycopg

    from connectors import deploy
    from connectors.client import ConnectClient

    source = settings.sources[0]
    with psycopg.connect(settings.database.dsn(), autocommit=True) as conn:
        conn.execute(f"CREATE TABLE public.{table} (id bigint PRIMARY KEY, score {score})")
    client = cleanup.enter_context(ConnectClient(settings.connect.url, timeout_s=30))

    @cleanup.callback
    def _drop_source() -> None:
        with psycopg.connect(settings.database.dsn(), autocommit=True) as conn:
            drop_slot(conn, source.effective_slot_name, source.effective_publication)
            conn.execute(f"DROP TABLE IF EXISTS public.{table}")

    cleanup.callback(client.delete, source.connector_name)
    deploy.apply(client, settings.database, settings.sources, wait_s=90)
    return client


def start_pipeline(settings_file: Path, log: Path, *args: str) -> subprocess.Popen[bytes]:
    """``edgefeed pipeline run *args`` in a process group of its own, logging to ``log``
    (its folder is the worker's: Faust's data folder goes there, not into the checkout)."""
    exe = Path(sys.executable).with_name("edgefeed")
    with log.open("ab") as out:
        return subprocess.Popen(
            [str(exe), "--settings", str(settings_file), "pipeline", "run", *args],
            cwd=log.parent,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def stop_process_group(process: subprocess.Popen[bytes]) -> None:
    """Stop the worker's whole process group and reap it, however slow the machine
    (a no-op for one already gone)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGCONT)  # a paused worker cannot handle SIGTERM
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=60)
    # Whatever is left of the group (Faust may fork helpers) goes too; SIGKILL
    # cannot be ignored, so the wait below ends.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def stop_service(stack: DevStack, name: str) -> None:
    """Stop the stack's service ``name`` (e.g. ``redis-ap-southeast``) as `dev down`
    would, leaving the rest running: a fault. :func:`start_service` starts it again."""
    from edgefeed.devstack.process import read_pid, stop_pid

    path = stack.pid_path(name)
    record = read_pid(path)
    if record is not None:
        stop_pid(record, sig=stack.service(name).stop_signal)
    path.unlink(missing_ok=True)


def start_service(stack: DevStack, name: str) -> None:
    """Start the stack's service ``name`` again and wait until it is healthy (a no-op
    when it runs), with the same code as `edgefeed dev up`."""
    from edgefeed.devstack import DevStack

    DevStack(stack.settings, stack.state_dir, only=[name]).up()


async def read_topic(
    bootstrap: list[str], topic: str, *, count: int, deadline_s: float = 60
) -> list[tuple[bytes | None, bytes | None]]:
    """Read ``count`` records (key, value) from the start of ``topic``, waiting for it to exist."""
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
