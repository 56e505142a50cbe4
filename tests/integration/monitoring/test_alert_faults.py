"""Alerts driven by real faults on the real stack, read from the local Alertmanager.

One Prometheus and one Alertmanager (`edgefeed dev up`'s, on free ports, scraping
every second) watch two exporters with their bearer tokens, and two sources with
their Debezium connectors: one only watched, one feeding the real pipeline (a
router and the eu-west and us-east workers, `edgefeed pipeline run`) while a
writer inserts a row every 0.2 s. The faults start at once and one deadline covers
them all (the longest `for:` plus scrapes and evaluations):

- the watched connector is deleted (EdgefeedConnectorTaskFailed: a declared
  connector ABSENT; a paused one would be neither FAILED nor ABSENT and does not fire);
- one exporter is killed (EdgefeedMonitorDown);
- the eu-west worker is killed with SIGKILL while rows keep coming
  (EdgefeedConsumerStalled for its group, EdgefeedFreshnessOverBudget and
  EdgefeedRegionBehind for eu-west; us-east, whose worker runs, is named by none);
- a row whose score is out of its feature's int32 range is written: the running
  us-east worker dead-letters it (EdgefeedDeadLettersRising for us-east's
  dead-letter topic, the reason `out-of-range` in the exporter's reason counter).

Each alert must reach the Alertmanager naming its connector, exporter, consumer
group, region or topic and its runbook, and all but the dead-letter alert must
resolve after the heal (the connector applied again, the dead exporter's target
removed, the worker started again). EdgefeedDeadLettersRising resolves only when
`increase(...[10m])` falls to 0, ten minutes after the last dead letter: its
resolution is proven by promtool's rule tests (deploy/prometheus/tests), not here.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
import requests
import yaml
from stackhelpers import (
    free_ports,
    source_with_connector,
    start_pipeline,
    stop_process_group,
    unique_name,
)

from connectors import deploy
from connectors.client import ConnectClient
from edgefeed.devstack import DevStack
from edgefeed.settings import EdgefeedSettings, load_settings

pytestmark = pytest.mark.integration

TOKEN = "scrape-4d2b7e91c0a35f68e1b2"
# The longest `for:` here (2m) plus scrapes, evaluations and the Alertmanager's
# group_wait; a deadline for a hang, not a bound.
DEADLINE_S = 120 + 60
# Startup of the router and two Faust workers on a busy machine; a deadline, not a bound.
START_DEADLINE_S = 180
REGIONS = ("eu-west", "us-east")
# The exporters' --freshness-budget: a region whose worker is dead passes it within
# seconds of the kill; a running one stays far below it on a busy machine.
BUDGET_S = 10


@dataclass
class Watched:
    """The stack under watch: its settings and the pipeline's processes."""

    stack: DevStack
    settings_file: Path
    settings: EdgefeedSettings
    table: str
    router: subprocess.Popen[bytes]
    workers: dict[str, subprocess.Popen[bytes]]
    alertmanager: str
    prometheus: str

    @property
    def folder(self) -> Path:
        return self.settings_file.parent

    def start_worker(self, region: str) -> None:
        """Start ``region``'s worker (:meth:`stop_pipeline` stops it)."""
        worker = start_pipeline(
            self.settings_file, self.folder / f"{region}.log", "--region", region
        )
        self.workers[region] = worker

    def stop_pipeline(self) -> None:
        """Stop the router and the workers together (each stop waits for Faust's
        graceful shutdown: one after the other, they would add up)."""
        with ThreadPoolExecutor(max_workers=1 + len(self.workers)) as pool:
            list(pool.map(stop_process_group, [self.router, *self.workers.values()]))


@dataclass
class Writer:
    """Inserts a row into the pipeline's table every 0.2 s until stopped."""

    dsn: str
    table: str
    error: BaseException | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="row-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                row = 0
                while not self._stop.wait(0.2):
                    row += 1
                    conn.execute(
                        f"INSERT INTO public.{self.table} (id, score) VALUES (%s, %s)",
                        (row, row % 1000),
                    )
        except BaseException as exc:  # re-raised by stop(): the test must not hide it
            self.error = exc

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.error is not None:
            raise self.error


def _exporter(
    settings_file: Path, token_file: Path, *groups: str
) -> tuple[subprocess.Popen[str], int]:
    exe = Path(sys.executable).with_name("edgefeed")
    process = subprocess.Popen(
        [
            str(exe),
            "--settings",
            str(settings_file),
            "exporter",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--interval",
            "1",
            "--window",
            "5",
            "--freshness-budget",
            str(BUDGET_S),
            "--token-file",
            str(token_file),
            *(arg for group in groups for arg in ("--group", group)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert process.stdout is not None
    line = process.stdout.readline()  # printed once the first report is in
    match = re.search(r"http://127\.0\.0\.1:(\d+)/metrics", line)
    if match is None:
        process.kill()
        rest, _ = process.communicate()
        raise AssertionError(line + rest)
    return process, int(match.group(1))


def _kill(process: subprocess.Popen[str]) -> None:
    """Kill and reap the process and close its pipe (again: a no-op)."""
    if process.poll() is None:
        process.kill()
    if process.stdout is not None and not process.stdout.closed:
        process.communicate()
    process.wait()


def _alerts(alertmanager: str) -> list[dict[str, Any]]:
    answer = requests.get(f"{alertmanager}/api/v2/alerts", params={"active": "true"}, timeout=5)
    answer.raise_for_status()
    alerts: list[dict[str, Any]] = answer.json()
    return alerts


def _query(prometheus: str, query: str) -> list[dict[str, Any]]:
    answer = requests.get(f"{prometheus}/api/v1/query", params={"query": query}, timeout=5)
    answer.raise_for_status()
    result: list[dict[str, Any]] = answer.json()["data"]["result"]
    return result


def _until(
    alertmanager: str, done: Callable[[list[dict[str, Any]]], bool], what: str
) -> list[dict[str, Any]]:
    deadline = time.monotonic() + DEADLINE_S
    while True:
        alerts = _alerts(alertmanager)
        if done(alerts):
            return alerts
        assert time.monotonic() < deadline, (
            f"{what} within {DEADLINE_S}s; the Alertmanager holds "
            f"{[(a['labels'], a['status']['state']) for a in alerts]}"
        )
        time.sleep(0.5)


def _find(alerts: list[dict[str, Any]], name: str, **labels: str) -> dict[str, Any] | None:
    return next(
        (
            a
            for a in alerts
            if a["labels"].get("alertname") == name
            and all(a["labels"].get(k) == v for k, v in labels.items())
        ),
        None,
    )


def _logs(folder: Path) -> str:
    return "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
        for p in sorted(folder.glob("*.log"))
    )


def _empty_caches(settings: EdgefeedSettings) -> None:
    """The regions' vectors and freshness records go with the module: a later module
    (test_pipeline_lag) reads us-east, where it runs no worker, as holding nothing."""
    for region in settings.regions:
        with redis.Redis.from_url(region.redis_url) as client:
            client.flushdb()


@pytest.fixture
def watched(
    devstack: DevStack, stack_mapping: dict[str, Any], state_dir: Path
) -> Iterator[Watched]:
    prometheus_port, alertmanager_port = free_ports(2)
    name = unique_name("alf").lower()
    table = f"{name}_rows"
    prefix = name.replace("_", "-")
    mapping = dict(stack_mapping)
    mapping["monitoring"] = {
        "prometheus_port": prometheus_port,
        "alertmanager_port": alertmanager_port,
        "scrape_interval_s": 1,
    }
    # Two regions, both with a worker: the one not killed must not be named.
    mapping["regions"] = [
        {**r, "failover": [o for o in r["failover"] if o in REGIONS]}
        for r in stack_mapping["regions"]
        if r["name"] in REGIONS
    ]
    mapping["sources"] = [
        {"name": name, "snapshot_mode": "no_data", "tables": [{"name": table, "key": ["id"]}]},
        {
            "name": f"{name}_p",
            "snapshot_mode": "no_data",
            "tables": [{"name": f"{table}_p", "key": ["id"]}],
        },
    ]
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
            "tables": {f"public.{table}_p": "id"},
            "latest": [
                {
                    "name": "score",
                    "table": f"public.{table}_p",
                    "column": "score",
                    "dtype": "int32",
                }
            ],
        }
    ]
    folder = state_dir / name
    folder.mkdir()
    settings_file = folder / "edgefeed.yaml"
    settings_file.write_text(yaml.safe_dump(mapping))
    settings = load_settings(settings_file)
    watched_only = settings.model_copy(update={"sources": settings.sources[:1]})
    piped = settings.model_copy(update={"sources": settings.sources[1:]})
    stack = DevStack(settings, folder, only=["prometheus", "alertmanager"])
    # Teardown runs in reverse order and every step runs even if one fails: the
    # processes stop before the caches, connectors and tables go.
    with contextlib.ExitStack() as cleanup:
        source_with_connector(cleanup, watched_only, table)
        # bigint: a score PostgreSQL takes and the feature's int32 cannot hold.
        source_with_connector(cleanup, piped, f"{table}_p", score="bigint")
        cleanup.callback(_empty_caches, settings)
        cleanup.callback(stack.down)
        router = start_pipeline(settings_file, folder / "router.log", "--role", "router")
        result = Watched(
            stack,
            settings_file,
            settings,
            f"{table}_p",
            router,
            {},
            f"http://127.0.0.1:{alertmanager_port}",
            f"http://127.0.0.1:{prometheus_port}",
        )
        cleanup.callback(result.stop_pipeline)
        for region in REGIONS:
            result.start_worker(region)
        stack.up()
        yield result
    assert not (folder / "run" / "prometheus.pid").exists()


def test_connector_exporter_worker_and_dead_letter_faults_page_and_resolve(
    watched: Watched,
) -> None:
    stack, settings, alertmanager, prometheus = (
        watched.stack,
        watched.settings,
        watched.alertmanager,
        watched.prometheus,
    )
    connector = settings.sources[0].connector_name
    names = settings.pipeline.names
    groups = {r: names.region_group(r) for r in REGIONS}
    dead_letters = names.region_dead_letter_topic("us-east")
    token_file = watched.folder / "exporter.token"
    token_file.write_text(TOKEN + "\n")
    writer = Writer(settings.database.dsn(), watched.table)
    with contextlib.ExitStack() as cleanup:
        main, main_port = _exporter(
            watched.settings_file, token_file, names.router_group, *groups.values()
        )
        cleanup.callback(_kill, main)
        doomed, doomed_port = _exporter(
            watched.settings_file, token_file, names.router_group, *groups.values()
        )
        cleanup.callback(_kill, doomed)
        stack.scrape("edgefeed-exporter", "exporter", main_port, token=TOKEN)
        stack.scrape("edgefeed-exporter", "exporter-doomed", doomed_port, token=TOKEN)
        doomed_instance = f"127.0.0.1:{doomed_port}"
        writer.start()
        cleanup.callback(writer.stop)

        # Healthy first, as Prometheus sees it: the connector RUNNING, both regions
        # fresh within the budget and both groups OK, the dead-letter counters at 0
        # (an increase needs a sample before the dead letter).
        regions, group_names = "|".join(REGIONS), "|".join(groups.values())
        queries = {
            "connector": f'edgefeed_connector_state{{connector="{connector}"}} == 1',
            "fresh": f'edgefeed_region_freshness_seconds{{region=~"{regions}"}} < {BUDGET_S}',
            "ok": "max by (consumergroup) "
            f'(edgefeed_consumergroup_status{{consumergroup=~"{group_names}"}}) == 1',
            "dead": f'edgefeed_deadletter_messages_total{{topic="{dead_letters}"}} == 0',
        }
        deadline = time.monotonic() + START_DEADLINE_S
        while True:
            seen = {what: _query(prometheus, q) for what, q in queries.items()}
            if (
                {r["metric"]["state"] for r in seen["connector"]} == {"RUNNING"}
                and {r["metric"]["region"] for r in seen["fresh"]} == set(REGIONS)
                and {r["metric"]["consumergroup"] for r in seen["ok"]} == set(groups.values())
                and seen["dead"]
            ):
                break
            assert time.monotonic() < deadline, (seen, _logs(watched.folder))
            time.sleep(0.5)
        assert (
            _find(_alerts(alertmanager), "EdgefeedConnectorTaskFailed", connector=connector) is None
        )

        # The faults, at once.
        os.killpg(watched.workers["eu-west"].pid, signal.SIGKILL)
        watched.workers["eu-west"].wait()
        with psycopg.connect(settings.database.dsn(), autocommit=True) as conn:
            conn.execute(
                f"INSERT INTO public.{watched.table} (id, score) VALUES (%s, %s)",
                (10**12, 2**40),
            )
        with ConnectClient(settings.connect.url, timeout_s=30) as client:
            client.delete(connector)
        _kill(doomed)

        def paged(alerts: list[dict[str, Any]]) -> bool:
            return (
                _find(alerts, "EdgefeedConnectorTaskFailed", connector=connector) is not None
                and _find(alerts, "EdgefeedMonitorDown", instance=doomed_instance) is not None
                and _find(alerts, "EdgefeedConsumerStalled", consumergroup=groups["eu-west"])
                is not None
                and _find(alerts, "EdgefeedFreshnessOverBudget", region="eu-west") is not None
                and _find(alerts, "EdgefeedRegionBehind", region="eu-west") is not None
                and _find(alerts, "EdgefeedDeadLettersRising", topic=dead_letters) is not None
            )

        alerts = _until(alertmanager, paged, "every alert in the Alertmanager")
        failed = _find(alerts, "EdgefeedConnectorTaskFailed", connector=connector)
        down = _find(alerts, "EdgefeedMonitorDown", instance=doomed_instance)
        assert failed is not None and down is not None
        assert failed["labels"]["severity"] == "critical"
        assert failed["annotations"]["runbook_url"] == (
            "docs/operations.md#edgefeedconnectortaskfailed"
        )
        assert connector in failed["annotations"]["summary"]
        assert down["labels"]["severity"] == "critical"
        assert down["labels"]["job"] == "edgefeed-exporter"
        assert down["annotations"]["runbook_url"] == "docs/operations.md#edgefeedmonitordown"
        assert doomed_instance in down["annotations"]["summary"]
        # The exporter that still runs is not named.
        assert _find(alerts, "EdgefeedMonitorDown", instance=f"127.0.0.1:{main_port}") is None

        stalled = _find(alerts, "EdgefeedConsumerStalled", consumergroup=groups["eu-west"])
        stale = _find(alerts, "EdgefeedFreshnessOverBudget", region="eu-west")
        behind = _find(alerts, "EdgefeedRegionBehind", region="eu-west")
        assert stalled is not None and stale is not None and behind is not None
        for alert, runbook, severity in (
            (stalled, "edgefeedconsumerstalled", "critical"),
            (stale, "edgefeedfreshnessoverbudget", "critical"),
            (behind, "edgefeedregionbehind", "warning"),
        ):
            assert alert["labels"]["severity"] == severity, alert
            assert alert["annotations"]["runbook_url"] == f"docs/operations.md#{runbook}"
        assert groups["eu-west"] in stalled["annotations"]["summary"]
        assert "eu-west" in stale["annotations"]["summary"]
        assert "eu-west" in behind["annotations"]["summary"]
        # us-east, whose worker runs and takes the same rows, is named by none of them.
        assert _find(alerts, "EdgefeedConsumerStalled", consumergroup=groups["us-east"]) is None
        assert _find(alerts, "EdgefeedFreshnessOverBudget", region="us-east") is None
        assert _find(alerts, "EdgefeedRegionBehind", region="us-east") is None

        rising = _find(alerts, "EdgefeedDeadLettersRising", topic=dead_letters)
        assert rising is not None
        assert rising["labels"]["severity"] == "warning"
        assert rising["annotations"]["runbook_url"] == (
            "docs/operations.md#edgefeeddeadlettersrising"
        )
        assert dead_letters in rising["annotations"]["summary"]
        # Why: the reason the worker gave, counted by the exporter per topic and reason.
        assert _query(
            prometheus,
            f'edgefeed_deadletter_reason_messages_total{{topic="{dead_letters}",'
            f'reason="out-of-range"}} >= 1',
        )

        # The heal: the connector applied again, the dead exporter's target gone, the
        # eu-west worker started again (rows still being written).
        watched.start_worker("eu-west")
        with ConnectClient(settings.connect.url, timeout_s=30) as client:
            deploy.apply(client, settings.database, settings.sources[:1], wait_s=90)
        for service in stack.services:
            remove = getattr(service, "remove_targets", None)
            if remove is not None:
                remove("exporter-doomed")

        def healed(alerts: list[dict[str, Any]]) -> bool:
            return (
                _find(alerts, "EdgefeedConnectorTaskFailed", connector=connector) is None
                and _find(alerts, "EdgefeedMonitorDown", instance=doomed_instance) is None
                and _find(alerts, "EdgefeedConsumerStalled", consumergroup=groups["eu-west"])
                is None
                and _find(alerts, "EdgefeedFreshnessOverBudget", region="eu-west") is None
                and _find(alerts, "EdgefeedRegionBehind", region="eu-west") is None
            )

        _until(alertmanager, healed, "every alert but the dead letters' resolved after the heal")
