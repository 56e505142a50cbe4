"""The real pipeline (router + eu-west worker, Faust) watched by the monitor.

A table of the source database feeds a shared entity through Debezium, the
router and the eu-west worker into eu-west's Redis; us-east and ap-southeast
have no worker running, so their messages wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
import yaml
from stackhelpers import drop_slot, unique_name

from connectors import deploy
from connectors.client import ConnectClient
from edgefeed.cli.monitoring import build_config
from edgefeed.devstack import DevStack
from edgefeed.settings import EdgefeedSettings, load_settings
from monitoring import Monitor, Report
from monitoring.model import EntityFreshness

pytestmark = pytest.mark.integration


@dataclass
class Pipeline:
    settings: EdgefeedSettings
    settings_file: Path
    table: str
    router: subprocess.Popen[bytes]
    worker: subprocess.Popen[bytes]

    @property
    def region_group(self) -> str:
        return self.settings.pipeline.region_app_id("eu-west")

    @property
    def router_group(self) -> str:
        return self.settings.pipeline.router_app_id

    def monitor(self) -> Monitor:
        return Monitor(build_config(self.settings, min_interval_s=0.2))


def _start(settings_file: Path, log: Path, *args: str) -> subprocess.Popen[bytes]:
    exe = Path(sys.executable).with_name("edgefeed")
    with log.open("wb") as out:
        return subprocess.Popen(
            [str(exe), "--settings", str(settings_file), "pipeline", "run", *args],
            cwd=log.parent,  # Faust's data folder goes here, not into the checkout
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _stop(process: subprocess.Popen[bytes]) -> None:
    """Stop the worker's whole process group and reap it, however slow the machine."""
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


async def until(
    monitor: Monitor, check: object, what: str, deadline_s: float = 60, logs: Path | None = None
) -> Report:
    deadline = time.monotonic() + deadline_s
    while True:
        report = await monitor.collect()
        if check(report):  # type: ignore[operator]
            return report
        if time.monotonic() > deadline:
            tail = ""
            if logs is not None:
                tail = "\n".join(
                    f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                    for p in sorted(logs.glob("*.log"))
                )
            raise AssertionError(f"{what} within {deadline_s}s; last: {report.problems}\n{tail}")
        await asyncio.sleep(0.3)


def insert(settings: EdgefeedSettings, table: str, ids: range) -> tuple[float, float]:
    """Insert rows in one transaction; returns wall-clock times just before and after."""
    with psycopg.connect(settings.database.dsn(), autocommit=True) as conn:
        before = time.time()
        with conn.transaction():
            for i in ids:
                conn.execute(f"INSERT INTO public.{table} (id, score) VALUES (%s, %s)", (i, i))
        after = time.time()
    return before, after


@pytest.fixture(scope="module")
def pipeline(
    devstack: DevStack, stack_mapping: dict[str, object], state_dir: Path
) -> Iterator[Pipeline]:
    name = unique_name("mon").lower()
    table = f"{name}_prefs"
    mapping = dict(stack_mapping)
    mapping["sources"] = [
        {"name": name, "snapshot_mode": "no_data", "tables": [{"name": table, "key": ["id"]}]}
    ]
    prefix = name.replace("_", "-")
    mapping["pipeline"] = {
        "app_prefix": prefix,
        "region_topic_prefix": f"{prefix}.region",
        "dead_letter_topic": f"{prefix}.deadletter",
        "partitions": 1,
        "commit_interval_s": 0.5,
    }
    mapping["entities"] = [
        {
            "name": "pref",
            "personal": False,
            "tables": {f"public.{table}": "id"},
            "latest": [
                {"name": "score", "table": f"public.{table}", "column": "score", "dtype": "int32"}
            ],
        }
    ]
    folder = state_dir / name
    folder.mkdir()
    settings_file = folder / "edgefeed.yaml"
    settings_file.write_text(yaml.safe_dump(mapping))
    settings = load_settings(settings_file)
    source = settings.sources[0]
    with psycopg.connect(settings.database.dsn(), autocommit=True) as conn:
        conn.execute(f"CREATE TABLE public.{table} (id bigint PRIMARY KEY, score int)")
    # Teardown runs in reverse order and every step runs even if one fails:
    # the workers are stopped and reaped before the connector and table go.
    with contextlib.ExitStack() as cleanup:
        client = cleanup.enter_context(ConnectClient(settings.connect.url, timeout_s=30))

        @cleanup.callback
        def _drop_source() -> None:
            with psycopg.connect(settings.database.dsn(), autocommit=True) as conn:
                drop_slot(conn, source.effective_slot_name, source.effective_publication)
                conn.execute(f"DROP TABLE IF EXISTS public.{table}")

        cleanup.callback(client.delete, source.connector_name)
        deploy.apply(client, settings.database, settings.sources, wait_s=90)
        router = _start(settings_file, folder / "router.log", "--role", "router")
        cleanup.callback(_stop, router)
        worker = _start(settings_file, folder / "eu-west.log", "--region", "eu-west")
        cleanup.callback(_stop, worker)
        yield Pipeline(settings, settings_file, table, router, worker)


def pref_of(report: Report) -> EntityFreshness | None:
    """This module's entity in eu-west's report (the session's Redis may hold others')."""
    region = report.region("eu-west")
    return next((e for e in region.entities if e.entity == "pref"), None) if region else None


async def test_freshness_per_region_reflects_a_postgres_write(pipeline: Pipeline) -> None:
    monitor = pipeline.monitor()
    logs = pipeline.settings_file.parent
    # Warm-up: the first row proves the path is up (workers joined, topics made).
    insert(pipeline.settings, pipeline.table, range(1, 2))
    await until(
        monitor,
        lambda r: r.region("eu-west").freshness_seconds is not None,
        "a first freshness record in eu-west",
        deadline_s=120,
        logs=logs,
    )
    before, after = insert(pipeline.settings, pipeline.table, range(100, 101))
    report = await until(
        monitor,
        lambda r: (
            (e := pref_of(r)) is not None
            and e.freshness_seconds is not None
            and e.freshness_seconds <= r.at - before + 0.05
            # A router that checked its history after the warm-up row rebuilds the
            # table once (pipeline.history: it cannot tell that row was streamed);
            # the region is REBUILDING until that ends.
            and r.region("eu-west").state != "REBUILDING"
        ),
        "eu-west freshness from the new write",
        logs=logs,
    )
    eu = report.region("eu-west")
    assert eu is not None
    pref = next(e for e in eu.entities if e.entity == "pref")
    assert pref.freshness_seconds is not None and pref.write_delay_seconds is not None
    # Counted from the source commit of that write: between the INSERT's start and end.
    assert report.at - after - 0.05 <= pref.freshness_seconds <= report.at - before + 0.05
    assert 0 <= pref.write_delay_seconds < 30
    assert pref.sampled >= 1 and pref.lsn is not None
    assert eu.state in ("OK", "IDLE")
    # No worker runs for us-east: its messages wait and it has nothing.
    us = report.region("us-east")
    assert us is not None and us.freshness_seconds is None and (us.pending or 0) >= 2
    # The exit code for scripts: us-east has no data, the us-east group is missing.
    assert report.severity != "OK"


async def test_paused_regional_worker_stalls_then_clears_after_resume(
    pipeline: Pipeline,
) -> None:
    monitor = pipeline.monitor()
    logs = pipeline.settings_file.parent
    group = pipeline.region_group
    before, _ = insert(pipeline.settings, pipeline.table, range(200, 201))
    await until(
        monitor,
        lambda r: (
            (g := r.group(group)) is not None
            and bool(g.partitions)
            and g.lag == 0
            and (e := pref_of(r)) is not None
            and e.freshness_seconds is not None
            and e.freshness_seconds <= r.at - before + 0.05
        ),
        "the eu-west worker caught up with row 200",
        deadline_s=120,
        logs=logs,
    )
    os.killpg(pipeline.worker.pid, signal.SIGSTOP)
    try:
        insert(pipeline.settings, pipeline.table, range(300, 305))
        first = await until(
            monitor,
            lambda r: r.group(group).lag > 0,  # type: ignore[union-attr]
            "eu-west lag while its worker is paused",
            logs=logs,
        )
        g0 = first.group(group)
        assert g0 is not None
        insert(pipeline.settings, pipeline.table, range(305, 310))
        stalled = await until(
            monitor,
            lambda r: (
                r.group(group).lag > g0.lag  # type: ignore[union-attr]
                and r.group(group).status in ("STALL", "STOP")
            ),  # type: ignore[union-attr]
            "eu-west lag growing and STALL (STOP once a coordinator evicts it)",
            logs=logs,
        )
        g = stalled.group(group)
        assert g is not None
        assert g.lag_seconds > g0.lag_seconds > 0
        assert g.partitions[0].committed == g0.partitions[0].committed
        assert g.severity == "ERR"
        router = stalled.group(pipeline.router_group)
        assert router is not None and router.status == "OK"  # only the paused region is behind
        eu = stalled.region("eu-west")
        assert eu is not None and eu.pending is not None and eu.pending >= g.lag
    finally:
        os.killpg(pipeline.worker.pid, signal.SIGCONT)
    cleared = await until(
        monitor,
        lambda r: r.group(group).lag == 0,  # type: ignore[union-attr]
        "eu-west drained after resume",
        deadline_s=90,
        logs=logs,
    )
    g = cleared.group(group)
    assert g is not None and g.status == "OK" and g.lag_seconds == 0


def test_exporter_command_serves_the_named_metrics_in_prometheus_format(
    pipeline: Pipeline,
) -> None:
    import re

    import requests
    from prometheus_client.parser import text_string_to_metric_families

    exe = Path(sys.executable).with_name("edgefeed")
    # The with-block kills and reaps the process and closes its pipe whatever
    # happens, so a failure here cannot leak into later tests as a ResourceWarning.
    with subprocess.Popen(
        [
            str(exe),
            "--settings",
            str(pipeline.settings_file),
            "exporter",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--interval",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as process:
        try:
            assert process.stdout is not None
            line = process.stdout.readline()  # printed once the first report is in
            match = re.search(r"http://127\.0\.0\.1:(\d+)/metrics", line)
            assert match, line + (process.stdout.read() if process.poll() is not None else "")
            body = requests.get(f"http://127.0.0.1:{match.group(1)}/metrics", timeout=10).text
            process.send_signal(signal.SIGTERM)
            process.communicate(timeout=120)  # a deadline for a hang, not a bound
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert process.returncode == 0  # SIGTERM stops it cleanly
    samples: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample.labels)
    group = pipeline.region_group
    region_topic = pipeline.settings.pipeline.region_topic("eu-west")
    for name in (
        "kafka_consumergroup_lag",
        "kafka_consumergroup_current_offset",
        "edgefeed_consumergroup_lag_seconds",
    ):
        assert {"consumergroup": group, "topic": region_topic, "partition": "0"}.items() <= next(
            labels.items() for labels in samples[name] if labels.get("consumergroup") == group
        ), name
    assert {"consumergroup": group, "topic": region_topic} in samples["kafka_consumergroup_lag_sum"]
    assert {"topic": region_topic, "partition": "0"} in samples[
        "kafka_topic_partition_current_offset"
    ]
    assert {"region": "eu-west", "entity": "pref"} in samples["edgefeed_cache_freshness_seconds"]
    slot = pipeline.settings.sources[0].effective_slot_name
    assert any(x["slot"] == slot for x in samples["edgefeed_replication_slot_retained_wal_bytes"])
    connector = pipeline.settings.sources[0].connector_name
    assert {"connector": connector, "state": "RUNNING"} in samples["edgefeed_connector_state"]
    assert {"topic": pipeline.settings.pipeline.dead_letter_topic} in samples[
        "edgefeed_deadletter_messages_total"
    ]
