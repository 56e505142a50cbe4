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
from stackhelpers import (
    score_pipeline,
    source_with_connector,
    start_pipeline,
    stop_process_group,
    unique_name,
)

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
    mapping.update(score_pipeline(prefix, table))
    folder = state_dir / name
    folder.mkdir()
    settings_file = folder / "edgefeed.yaml"
    settings_file.write_text(yaml.safe_dump(mapping))
    settings = load_settings(settings_file)
    # Teardown runs in reverse order and every step runs even if one fails:
    # the workers are stopped and reaped before the connector and table go.
    with contextlib.ExitStack() as cleanup:
        source_with_connector(cleanup, settings, table)
        router = start_pipeline(settings_file, folder / "router.log", "--role", "router")
        cleanup.callback(stop_process_group, router)
        worker = start_pipeline(settings_file, folder / "eu-west.log", "--region", "eu-west")
        cleanup.callback(stop_process_group, worker)
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


def exporter_command(pipeline: Pipeline, *extra: str) -> list[str]:
    """`edgefeed exporter` on a free loopback port, collecting every second."""
    exe = Path(sys.executable).with_name("edgefeed")
    return [
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
        *extra,
    ]


def test_exporter_command_serves_the_named_metrics_in_prometheus_format(
    pipeline: Pipeline,
) -> None:
    import re

    import requests
    from prometheus_client.parser import text_string_to_metric_families

    # The with-block kills and reaps the process and closes its pipe whatever
    # happens, so a failure here cannot leak into later tests as a ResourceWarning.
    with subprocess.Popen(
        exporter_command(pipeline),
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


def test_local_prometheus_scrapes_the_exporter_with_its_token_and_loads_the_alert_rules(
    pipeline: Pipeline, stack_mapping: dict[str, object], state_dir: Path
) -> None:
    """`edgefeed dev up`'s Prometheus and Alertmanager (monitoring.* ports): the
    checkout's deploy/prometheus/alerts.yml loaded, the exporter scraped through its
    bearer token, its series queryable, the alerts sent to the Alertmanager."""
    import re

    import requests
    from stackhelpers import free_ports

    from edgefeed.localalerts import alert_state
    from edgefeed.settings import settings_from_mapping

    prometheus_port, alertmanager_port = free_ports(2)
    mapping = dict(stack_mapping)
    mapping["monitoring"] = {
        "prometheus_port": prometheus_port,
        "alertmanager_port": alertmanager_port,
        "scrape_interval_s": 1,
    }
    settings = settings_from_mapping(mapping)
    folder = state_dir / unique_name("prom")
    token_file = folder / "exporter.token"
    folder.mkdir()
    token_file.write_text("scrape-9c1f4e7a2b8d6053e1f47a9c2d8b6e05\n")
    stack = DevStack(settings, folder, only=["prometheus", "alertmanager"])
    prometheus = f"http://127.0.0.1:{prometheus_port}"
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(stack.down)
        stack.up()
        process = cleanup.enter_context(
            subprocess.Popen(
                exporter_command(pipeline, "--token-file", str(token_file)),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
        cleanup.callback(lambda: (process.kill(), process.wait()))
        assert process.stdout is not None
        line = process.stdout.readline()
        match = re.search(r"http://127\.0\.0\.1:(\d+)/metrics", line)
        assert match, line
        assert stack.scrape("edgefeed-exporter", "exporter", int(match.group(1)), token="x")
        deadline = time.monotonic() + 60
        while True:  # a wrong token: scraped, and refused
            state = alert_state(settings.monitoring)
            health = {(job, h, e) for job, _, h, e in state.targets if job == "edgefeed-exporter"}
            if health and all(h == "down" for _, h, _ in health):
                break
            assert time.monotonic() < deadline, health
            time.sleep(0.5)
        assert any("401" in error for _, _, error in health), health
        stack.scrape(
            "edgefeed-exporter",
            "exporter",
            int(match.group(1)),
            token="scrape-9c1f4e7a2b8d6053e1f47a9c2d8b6e05",
        )
        topic = pipeline.settings.pipeline.region_topic("eu-west")
        deadline = time.monotonic() + 60
        while True:  # the right token: up, and the exporter's series in Prometheus
            state = alert_state(settings.monitoring)
            answer = requests.get(
                f"{prometheus}/api/v1/query",
                params={"query": f'kafka_topic_partition_current_offset{{topic="{topic}"}}'},
                timeout=5,
            ).json()
            up = [h for job, _, h, _ in state.targets if job == "edgefeed-exporter"]
            if up == ["up"] and answer["data"]["result"]:
                break
            assert time.monotonic() < deadline, (state.targets, answer)
            time.sleep(0.5)
        rules = requests.get(f"{prometheus}/api/v1/rules", timeout=5).json()["data"]["groups"]
        loaded = {rule["name"] for group_ in rules for rule in group_["rules"]}
        alerts_file = Path(__file__).resolve().parents[3] / "deploy" / "prometheus" / "alerts.yml"
        declared = {
            rule.get("alert") or rule["record"]
            for group_ in yaml.safe_load(alerts_file.read_text())["groups"]
            for rule in group_["rules"]
        }
        assert declared and loaded == declared
        managers = requests.get(f"{prometheus}/api/v1/alertmanagers", timeout=5).json()
        assert [m["url"] for m in managers["data"]["activeAlertmanagers"]] == [
            f"http://127.0.0.1:{alertmanager_port}/api/v2/alerts"
        ]
        assert state.delivered is not None  # the Alertmanager's API answers
    assert not (folder / "run" / "prometheus.pid").exists()
    assert not (folder / "run" / "alertmanager.pid").exists()
