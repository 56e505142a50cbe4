"""The local stack's services, proven for real: broker, Debezium via Connect, Redis per region."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
import redis
import requests
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import TopicPartition
from stackhelpers import drop_slot, free_ports, read_topic, stack_settings_mapping, unique_name

from edgefeed.devstack import DevStack, MissingBinaryError, PortInUseError
from edgefeed.devstack.process import read_pid, stop_pid
from edgefeed.settings import settings_from_mapping

pytestmark = pytest.mark.integration


def test_every_service_is_running_and_healthy(devstack: DevStack) -> None:
    statuses = devstack.status()
    assert {s.name for s in statuses} >= {
        "broker",
        "postgres",
        "connect",
        "redis-eu-west",
        "redis-us-east",
        "redis-ap-southeast",
    }
    assert [s.name for s in statuses if s.state != "running"] == []


def test_up_again_is_idempotent(devstack: DevStack) -> None:
    before = {s.name: s.pid for s in devstack.status()}
    after = {s.name: s.pid for s in devstack.up()}
    assert after == before


async def test_broker_produce_and_consume_with_a_group(
    devstack: DevStack, make_topic: Callable[..., str]
) -> None:
    topic = make_topic("orders", partitions=2)
    bootstrap = devstack.settings.kafka.bootstrap_servers
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        for i in range(20):
            await producer.send_and_wait(topic, f"v{i}".encode(), key=f"k{i % 4}".encode())
    finally:
        await producer.stop()

    group = unique_name("group")
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=group,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        session_timeout_ms=6000,
        heartbeat_interval_ms=1000,
        fetch_max_wait_ms=20,
    )
    await consumer.start()
    got: dict[bytes, list[bytes]] = {}
    try:
        deadline = time.monotonic() + 60
        while sum(len(v) for v in got.values()) < 20 and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=500)
            for records in batch.values():
                for record in records:
                    assert record.key is not None and record.value is not None
                    got.setdefault(record.key, []).append(record.value)
        await consumer.commit()
        committed = {
            tp.partition: await consumer.committed(tp)
            for tp in (TopicPartition(topic, 0), TopicPartition(topic, 1))
        }
    finally:
        await consumer.stop()
    assert sum(len(v) for v in got.values()) == 20
    # Per key, order is kept (one key lives in one partition).
    for key, values in got.items():
        expected = [f"v{i}".encode() for i in range(20) if f"k{i % 4}".encode() == key]
        assert values == expected
    assert sum(offset or 0 for offset in committed.values()) == 20


def _wait_connector_running(base: str, name: str, deadline_s: float = 60) -> dict[str, object]:
    deadline = time.monotonic() + deadline_s
    status: dict[str, object] = {}
    while time.monotonic() < deadline:
        response = requests.get(f"{base}/connectors/{name}/status", timeout=5)
        if response.status_code == 200:
            status = response.json()
            tasks = status.get("tasks") or []
            assert isinstance(tasks, list)
            if tasks and all(t["state"] == "RUNNING" for t in tasks):
                return status
            if any(t["state"] == "FAILED" for t in tasks):
                pytest.fail(f"connector task failed: {json.dumps(status)[:2000]}")
        time.sleep(0.2)
    pytest.fail(f"connector {name} not RUNNING in {deadline_s}s: {status}")


async def test_debezium_connector_delivers_an_insert(
    devstack: DevStack,
    make_table: Callable[[str, str], str],
    pg_conn: psycopg.Connection[tuple[object, ...]],
) -> None:
    table = make_table("users", "id bigint PRIMARY KEY, name text NOT NULL")
    name = unique_name("dbz").replace("_", "-")
    slot = unique_name("slot").lower()
    prefix = unique_name("cdc").lower()
    db = devstack.settings.database
    config = {
        "connector.class": "io.debezium.connector.postgresql.PostgresConnector",
        "plugin.name": "pgoutput",
        "database.hostname": db.host,
        "database.port": str(db.port),
        "database.user": db.user,
        "database.password": db.password.get_secret_value(),
        "database.dbname": db.dbname,
        "topic.prefix": prefix,
        "table.include.list": f"public.{table}",
        "slot.name": slot,
        "publication.name": f"pub_{slot}",
        "publication.autocreate.mode": "filtered",
        "snapshot.mode": "no_data",
        "topic.creation.default.partitions": "1",
        "topic.creation.default.replication.factor": "1",
        "key.converter": "org.apache.kafka.connect.json.JsonConverter",
        "value.converter": "org.apache.kafka.connect.json.JsonConverter",
        "key.converter.schemas.enable": "false",
        "value.converter.schemas.enable": "false",
    }
    base = devstack.settings.connect.url
    response = requests.put(f"{base}/connectors/{name}/config", json=config, timeout=30)
    assert response.status_code in (200, 201), response.text
    try:
        _wait_connector_running(base, name)
        pg_conn.execute(f"INSERT INTO public.{table} (id, name) VALUES (7, 'ada')")
        [(_, value)] = await read_topic(
            devstack.settings.kafka.bootstrap_servers, f"{prefix}.public.{table}", count=1
        )
    finally:
        requests.delete(f"{base}/connectors/{name}", timeout=30)
        drop_slot(pg_conn, slot, f"pub_{slot}")
    assert value is not None
    event = json.loads(value)
    assert event["op"] == "c", event
    assert event["after"] == {"id": 7, "name": "ada"}
    assert event["source"]["table"] == table
    assert isinstance(event["source"]["lsn"], int)


def test_each_region_cache_answers(
    devstack: DevStack, region_redis: dict[str, redis.Redis]
) -> None:
    assert set(region_redis) == {"eu-west", "us-east", "ap-southeast"}
    for name, client in region_redis.items():
        client.set("edgefeed:probe", name)
    # Each region is its own server: no write leaks into another.
    for name, client in region_redis.items():
        assert client.get("edgefeed:probe") == name.encode()


def test_redis_cluster_is_formed(redis_cluster_url: str) -> None:
    cluster = redis.RedisCluster.from_url(redis_cluster_url)
    try:
        assert len(cluster.get_primaries()) == 3
        for i in range(30):
            cluster.set(f"k{i}", i)
        assert [int(cluster.get(f"k{i}") or -1) for i in range(30)] == list(range(30))
    finally:
        cluster.close()


# -- bad input and crashes, on small stacks of their own ---------------------------------


def _small_stack(state_dir: Path, **kwargs: object) -> DevStack:
    settings = settings_from_mapping(stack_settings_mapping(free_ports(6)))
    return DevStack(settings, state_dir, **kwargs)  # type: ignore[arg-type]


def test_port_taken_by_a_foreign_process_is_a_clear_error(tmp_path: Path) -> None:
    stack = _small_stack(tmp_path, only=["redis-eu-west"])
    port = stack.service("redis-eu-west").port
    blocker = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import socket,time;s=socket.socket();s.bind(('127.0.0.1',{port}));s.listen();"
            "print('ok',flush=True);time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert blocker.stdout is not None and blocker.stdout.readline() == b"ok\n"
        with pytest.raises(PortInUseError) as info:
            stack.up()
        message = str(info.value)
        assert str(port) in message
        assert "regions[eu-west].redis_url" in message
        assert blocker.poll() is None  # the foreign process is untouched
        assert read_pid(stack.pid_path("redis-eu-west")) is None
    finally:
        blocker.kill()
        blocker.wait()
        assert blocker.stdout is not None
        blocker.stdout.close()


def test_missing_binary_names_the_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    stack = _small_stack(tmp_path / "state", only=["redis-eu-west"])
    with pytest.raises(MissingBinaryError, match="apt-get install redis-server"):
        stack.up()


def test_down_after_a_crash_cleans_stale_pid_files_and_spares_foreign_processes(
    tmp_path: Path,
) -> None:
    stack = _small_stack(tmp_path, only=["redis-eu-west", "redis-us-east"])
    stack.up()
    crashed = read_pid(stack.pid_path("redis-eu-west"))
    assert crashed is not None
    os.kill(crashed.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while crashed.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert {s.name: s.state for s in stack.status()}["redis-eu-west"] == "stopped"

    # A foreign process that happens to have the pid of the second service's pid file.
    survivor = read_pid(stack.pid_path("redis-us-east"))
    assert survivor is not None
    foreign = subprocess.Popen(["sleep", "60"])
    try:
        stack.pid_path("redis-us-east").write_text(
            json.dumps({"pid": foreign.pid, "start_ticks": 1, "argv": ["redis-server"]})
        )
        outcome = stack.down()
        assert outcome["redis-eu-west"] == "stale pid file removed"
        assert outcome["redis-us-east"] == "stale pid file removed"
        assert foreign.poll() is None, "dev down killed a process it did not start"
        assert not stack.pid_path("redis-eu-west").exists()
        assert not stack.pid_path("redis-us-east").exists()
    finally:
        foreign.kill()
        foreign.wait()
        stop_pid(survivor, sig=signal.SIGKILL)  # killed and reaped, not left a zombie


def _edgefeed(*args: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("edgefeed")
    return subprocess.run(
        [str(exe), *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_cli_status_and_logs_on_the_running_stack(
    devstack: DevStack, stack_settings_file: Path
) -> None:
    common = ["--settings", str(stack_settings_file)]
    state = ["--state-dir", str(devstack.state_dir)]
    result = _edgefeed(*common, "dev", "status", "--json", *state)
    assert result.returncode == 0, result.stderr
    statuses = json.loads(result.stdout)
    assert {s["name"]: s["state"] for s in statuses}["connect"] == "running"
    assert all(s["state"] == "running" for s in statuses)
    logs = _edgefeed(*common, "dev", "logs", "broker", "-n", "5", *state)
    assert logs.returncode == 0
    assert "tansu" in logs.stdout.lower()
    unknown = _edgefeed(*common, "dev", "logs", "nope", *state)
    assert unknown.returncode == 1
    assert "no service 'nope'" in unknown.stderr
    assert "broker" in unknown.stderr
