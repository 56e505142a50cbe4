"""Lag, freshness, slots and connectors measured on the real local stack."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families
from stackhelpers import drop_slot, unique_name

from connectors.client import ConnectClient
from connectors.config import render_connector_config
from connectors.settings import SourceSettings, TableSettings
from edgefeed.devstack import DevStack
from monitoring import Monitor, MonitorConfig, Report, SourceTarget, serve
from pipeline.names import PipelineNames

pytestmark = pytest.mark.integration


def config_for(devstack: DevStack, **options: object) -> MonitorConfig:
    s = devstack.settings
    defaults: dict[str, object] = {
        "bootstrap_servers": tuple(s.kafka.bootstrap_servers),
        "min_interval_s": 0.2,
        "sample_size": 50,
    }
    defaults.update(options)
    return MonitorConfig(**defaults)  # type: ignore[arg-type]


async def until(
    monitor: Monitor, check: Callable[[Report], bool], what: str, deadline_s: float = 30
) -> Report:
    """Collect rounds (0.25 s apart) until ``check`` holds; fail after ``deadline_s``."""
    deadline = time.monotonic() + deadline_s
    while True:
        report = await monitor.collect()
        if check(report):
            return report
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {deadline_s}s; last: {report.as_dict()}")
        await asyncio.sleep(0.25)


#: ``edgefeed`` with aiokafka made unimportable: a command that still reads Kafka
#: reads it with kafka-python (docs/architecture.md, "Kafka clients").
WITHOUT_AIOKAFKA = (
    "import sys; sys.modules['aiokafka'] = None; sys.argv[0] = 'edgefeed'; "
    "from edgefeed.cli import main; main()"
)


def _edgefeed(
    settings_file: Path, *args: str, without_aiokafka: bool = False
) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("edgefeed")
    command = [sys.executable, "-c", WITHOUT_AIOKAFKA] if without_aiokafka else [str(exe)]
    return subprocess.run(
        [*command, "--settings", str(settings_file), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


async def test_paused_worker_lag_grows_stalls_and_clears_after_resume(
    devstack: DevStack, make_topic: Callable[..., str], stack_settings_file: Path
) -> None:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    bootstrap = devstack.settings.kafka.bootstrap_servers
    topic = make_topic("edgefeed.region.t", partitions=1)
    group = f"edgefeed-region-{unique_name('eu').replace('_', '-').lower()}"
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
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
    await producer.start()
    await consumer.start()
    dead_letters = make_topic("edgefeed.deadletter.t", partitions=1)
    names = PipelineNames(dead_letter_topic=dead_letters)
    monitor = Monitor(config_for(devstack, groups=(group,), names=names))
    try:
        for i in range(5):
            await producer.send_and_wait(topic, f"v{i}".encode())
        consumed = 0
        deadline = time.monotonic() + 30
        while consumed < 5:
            assert time.monotonic() < deadline, "the worker never consumed its first 5 records"
            batch = await consumer.getmany(timeout_ms=200)
            consumed += sum(len(records) for records in batch.values())
        await consumer.commit()
        caught_up = await until(
            monitor, lambda r: (g := r.group(group)) is not None and g.lag == 0, "lag 0"
        )
        group_report = caught_up.group(group)
        assert group_report is not None and group_report.status == "OK"
        assert group_report.partitions[0].committed == 5
        assert caught_up.kafka.deadletters == 0

        # The worker pauses (still a live member: it heartbeats) while the source writes on.
        consumer.pause(*consumer.assignment())
        before_send = time.time()
        for i in range(3):
            await producer.send_and_wait(topic, f"late{i}".encode())
        after_send = time.time()
        first = await until(monitor, lambda r: r.group(group).lag == 3, "lag 3")  # type: ignore[union-attr]
        first_lag_s = first.group(group).lag_seconds  # type: ignore[union-attr]
        produced = next(t for t in first.kafka.topics if t.topic == topic)
        assert produced.produce_rate is not None and produced.produce_rate > 0
        # Read from the timestamp of the record at the committed offset, not guessed.
        assert first.at - after_send - 0.5 <= first_lag_s <= first.at - before_send + 0.5
        for i in range(3):
            await producer.send_and_wait(topic, f"later{i}".encode())
        for i in range(2):
            await producer.send_and_wait(
                dead_letters, f"poison{i}".encode(), headers=[("edgefeed-reason", b"bad-json")]
            )
        poisoned = await until(monitor, lambda r: r.kafka.deadletters == 2, "2 dead letters")
        # Their reasons, read from the records' headers (kafka-python's consumer).
        await until(
            monitor,
            lambda r: r.kafka.deadletters_by_reason == ((dead_letters, "bad-json", 2),),
            "2 dead letters counted by reason",
        )
        # Counted, and new ones within the window are a warning of their own.
        assert poisoned.kafka.deadletters_new == 2
        assert any("2 new dead letter(s)" in problem for problem in poisoned.problems)
        stalled = await until(
            monitor,
            lambda r: (
                r.group(group).status == "STALL"  # type: ignore[union-attr]
                and r.group(group).lag == 6
            ),  # type: ignore[union-attr]
            "status STALL with lag 6",
        )
        g = stalled.group(group)
        assert g is not None
        assert g.severity == "ERR" and stalled.severity == "ERR"
        assert g.lag_seconds > first_lag_s  # seconds grow with the same record unconsumed
        assert g.partitions[0].committed == 5 and g.partitions[0].end == 11
        assert any(group in problem and "STALL" in problem for problem in stalled.problems)

        # The CLI, in its own process, sees the same and says so in its exit code; it
        # reads Kafka with kafka-python (aiokafka cannot even be imported there).
        cli = _edgefeed(
            stack_settings_file,
            *("lag", "--json", "-g", group, "--samples", "3", "--interval", "0.4"),
            without_aiokafka=True,
        )
        assert "aiokafka" not in cli.stderr, cli.stderr
        assert cli.returncode == 4, cli.stderr
        cli_group = next(
            x for x in json.loads(cli.stdout)["kafka"]["groups"] if x["group"] == group
        )
        assert cli_group["status"] == "STALL" and cli_group["lag"] == 6
        assert cli_group["lag_seconds"] > 0

        # Resume: the worker drains and commits; the status clears.
        consumer.resume(*consumer.assignment())
        drained = 0
        deadline = time.monotonic() + 30
        while drained < 6:
            assert time.monotonic() < deadline, "the resumed worker did not drain"
            batch = await consumer.getmany(timeout_ms=200)
            drained += sum(len(records) for records in batch.values())
        await consumer.commit()
        cleared = await until(
            monitor,
            lambda r: r.group(group).lag == 0,
            "lag back to 0",  # type: ignore[union-attr]
        )
        g = cleared.group(group)
        assert g is not None and g.status == "OK" and g.severity == "OK"
        assert g.lag_seconds == 0
        assert g.consume_rate[topic] > 0  # throughput over the window: the drain
    finally:
        await consumer.stop()
        await producer.stop()


async def test_idle_slot_shows_retained_wal(
    devstack: DevStack,
    pg_conn: psycopg.Connection[tuple[object, ...]],
    make_table: Callable[[str, str], str],
) -> None:
    slot = unique_name("idle").lower()
    table = make_table("walfill", "id bigint PRIMARY KEY, pad text")
    pg_conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    try:
        pg_conn.execute(
            f"INSERT INTO {table} SELECT g, repeat('x', 200) FROM generate_series(1, 2000) g"
        )
        monitor = Monitor(
            config_for(
                devstack,
                groups=("none",),
                database_dsn=devstack.settings.database.dsn(),
                sources=(SourceTarget("idle", "edgefeed-idle", slot),),
                slot_wal_bound_bytes=100 * 1024,
            )
        )
        report = await monitor.collect()
        row = report.slot(slot)
        assert row is not None
        assert row.active is False
        assert row.retained_wal_bytes is not None and row.retained_wal_bytes > 400_000
        assert row.source == "idle"
        assert row.severity == "ERR" and "over" in row.reason
        pg_conn.execute(
            f"INSERT INTO {table} SELECT g, repeat('y', 200) FROM generate_series(2001, 4000) g"
        )
        later = (await monitor.collect()).slot(slot)
        assert later is not None and later.retained_wal_bytes is not None
        assert later.retained_wal_bytes > row.retained_wal_bytes
    finally:
        drop_slot(pg_conn, slot, f"no_publication_{slot}")


@pytest.fixture
def connect_client(devstack: DevStack) -> Iterator[ConnectClient]:
    with ConnectClient(devstack.settings.connect.url, timeout_s=30) as client:
        yield client


@pytest.fixture
def cleanup_source(
    connect_client: ConnectClient, pg_conn: psycopg.Connection[tuple[object, ...]]
) -> Iterator[Callable[[SourceSettings], None]]:
    sources: list[SourceSettings] = []
    yield sources.append
    for source in sources:
        connect_client.delete(source.connector_name)
        drop_slot(pg_conn, source.effective_slot_name, source.effective_publication)


async def test_failed_connector_task_shows_in_lag_and_in_the_exporter(
    devstack: DevStack,
    make_table: Callable[[str, str], str],
    connect_client: ConnectClient,
    cleanup_source: Callable[[SourceSettings], None],
) -> None:
    s = devstack.settings
    source = SourceSettings(
        name=unique_name("broken").lower(),
        tables=[TableSettings(name=make_table("acct", "id bigint PRIMARY KEY"), key=["id"])],
        snapshot_mode="no_data",
        # Valid to Connect's validation, but the server has no decoderbufs plugin:
        # the task fails when it starts, as a broken deployment would.
        extra={"plugin.name": "decoderbufs"},
    )
    cleanup_source(source)
    password = s.database.secret()
    connect_client.put_config(source.connector_name, render_connector_config(s.database, source))
    config = config_for(
        devstack,
        groups=("none",),
        connect_url=s.connect.url,
        sources=(SourceTarget(source.name, source.connector_name, source.effective_slot_name),),
        secrets=(password,),
    )
    monitor = Monitor(config)
    report = await until(
        monitor,
        lambda r: (
            (c := r.connector(source.connector_name)) is not None
            and (c.state == "FAILED" or any(t.state == "FAILED" for t in c.tasks))
        ),
        "connector failed",
        deadline_s=60,
    )
    connector = report.connector(source.connector_name)
    assert connector is not None
    assert connector.severity == "ERR"
    assert connector.failure and "decoderbufs" in connector.failure
    assert password not in json.dumps(report.as_dict())
    assert report.severity == "ERR"

    # The exporter shows it too, in a format Prometheus parses.
    stop = asyncio.Event()
    ports: list[int] = []
    server = asyncio.create_task(
        serve(
            Monitor(config),
            host="127.0.0.1",
            port=0,
            interval_s=0.5,
            stop=stop,
            on_ready=ports.append,
        )
    )
    try:
        deadline = time.monotonic() + 30
        while not ports:
            assert time.monotonic() < deadline and not server.done(), "exporter did not start"
            await asyncio.sleep(0.05)
        body = await asyncio.to_thread(
            lambda: requests.get(f"http://127.0.0.1:{ports[0]}/metrics", timeout=10).text
        )
    finally:
        stop.set()
        await server
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
    }
    failed_state = [
        value
        for (name, labels), value in samples.items()
        if name in ("edgefeed_connector_state", "edgefeed_connector_task_state")
        and ("connector", source.connector_name) in labels
        and ("state", "FAILED") in labels
    ]
    assert 1.0 in failed_state
    assert password not in body


def test_watch_json_streams_one_report_per_round_and_exits_with_the_last_status(
    devstack: DevStack, stack_settings_file: Path
) -> None:
    import signal

    exe = Path(sys.executable).with_name("edgefeed")
    group = f"edgefeed-region-{unique_name('w').replace('_', '-').lower()}"
    # The with-block kills and reaps the process and closes its pipes whatever
    # happens, so a failure here cannot leak into later tests as a ResourceWarning.
    with subprocess.Popen(
        [
            str(exe),
            "--settings",
            str(stack_settings_file),
            "lag",
            "--watch",
            "--json",
            "--interval",
            "0.3",
            "-g",
            group,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as process:
        try:
            assert process.stdout is not None
            lines = [process.stdout.readline() for _ in range(3)]
            process.send_signal(signal.SIGINT)
            _, err = process.communicate(timeout=120)  # a deadline for a hang, not a bound
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert "Traceback" not in err, err
    reports = [json.loads(line) for line in lines]
    assert [r["at"] for r in reports] == sorted(r["at"] for r in reports)
    assert len({r["at"] for r in reports}) == 3
    for r in reports:
        # A group asked for but absent is reported, not silently dropped.
        assert [(g["group"], g["status"]) for g in r["kafka"]["groups"]] == [(group, "NOTFOUND")]
    assert process.returncode == {"OK": 0, "WARN": 3, "ERR": 4}[reports[-1]["severity"]]
