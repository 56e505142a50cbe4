"""Alerts driven by real faults on the real stack, read from the local Alertmanager.

One Prometheus and one Alertmanager (`edgefeed dev up`'s, on free ports, scraping
every second) watch a source whose Debezium connector runs and two exporters with
their bearer tokens. The faults start at once and one deadline covers them all
(the longest `for:` plus scrapes and evaluations): the connector is deleted
(EdgefeedConnectorTaskFailed: a declared connector ABSENT; a paused one would be
neither FAILED nor ABSENT and does not fire) and one exporter is killed
(EdgefeedMonitorDown). Each alert must reach the Alertmanager naming the connector
or the exporter and its runbook, and resolve after the heal.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from stackhelpers import free_ports, source_with_connector, unique_name

from connectors import deploy
from connectors.client import ConnectClient
from edgefeed.devstack import DevStack
from edgefeed.settings import load_settings

pytestmark = pytest.mark.integration

TOKEN = "scrape-4d2b7e91c0a35f68e1b2"
# The longest `for:` here (EdgefeedMonitorDown, 2m) plus scrapes, evaluations and
# the Alertmanager's group_wait; a deadline for a hang, not a bound.
DEADLINE_S = 120 + 60


def _exporter(settings_file: Path, token_file: Path) -> tuple[subprocess.Popen[str], int]:
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
            "--token-file",
            str(token_file),
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


@pytest.fixture
def stack_with_alerts(
    devstack: DevStack, stack_mapping: dict[str, object], state_dir: Path
) -> Iterator[tuple[DevStack, Path, str]]:
    prometheus_port, alertmanager_port = free_ports(2)
    name = unique_name("alf").lower()
    table = f"{name}_rows"
    mapping = dict(stack_mapping)
    mapping["monitoring"] = {
        "prometheus_port": prometheus_port,
        "alertmanager_port": alertmanager_port,
        "scrape_interval_s": 1,
    }
    mapping["sources"] = [
        {"name": name, "snapshot_mode": "no_data", "tables": [{"name": table, "key": ["id"]}]}
    ]
    folder = state_dir / name
    folder.mkdir()
    settings_file = folder / "edgefeed.yaml"
    settings_file.write_text(yaml.safe_dump(mapping))
    settings = load_settings(settings_file)
    stack = DevStack(settings, folder, only=["prometheus", "alertmanager"])
    with contextlib.ExitStack() as cleanup:
        source_with_connector(cleanup, settings, table)
        cleanup.callback(stack.down)
        stack.up()
        yield stack, settings_file, f"http://127.0.0.1:{alertmanager_port}"
    assert not (folder / "run" / "prometheus.pid").exists()


def test_a_deleted_connector_and_a_killed_exporter_page_and_resolve(
    stack_with_alerts: tuple[DevStack, Path, str],
) -> None:
    stack, settings_file, alertmanager = stack_with_alerts
    settings = load_settings(settings_file)
    connector = settings.sources[0].connector_name
    token_file = settings_file.with_name("exporter.token")
    token_file.write_text(TOKEN + "\n")
    with contextlib.ExitStack() as cleanup:
        main, main_port = _exporter(settings_file, token_file)
        cleanup.callback(_kill, main)
        doomed, doomed_port = _exporter(settings_file, token_file)
        cleanup.callback(_kill, doomed)
        stack.scrape("edgefeed-exporter", "exporter", main_port, token=TOKEN)
        stack.scrape("edgefeed-exporter", "exporter-doomed", doomed_port, token=TOKEN)
        doomed_instance = f"127.0.0.1:{doomed_port}"
        # Healthy first: the connector RUNNING is scraped, nothing of ours is active.
        prometheus = f"http://127.0.0.1:{settings.monitoring.prometheus_port}"
        deadline = time.monotonic() + 60
        while True:
            answer = requests.get(
                f"{prometheus}/api/v1/query",
                params={"query": f'edgefeed_connector_state{{connector="{connector}"}} == 1'},
                timeout=5,
            ).json()
            states = {r["metric"]["state"] for r in answer["data"]["result"]}
            if states == {"RUNNING"}:
                break
            assert time.monotonic() < deadline, answer
            time.sleep(0.5)
        assert (
            _find(_alerts(alertmanager), "EdgefeedConnectorTaskFailed", connector=connector) is None
        )

        # The faults, at once.
        with ConnectClient(settings.connect.url, timeout_s=30) as client:
            client.delete(connector)
        _kill(doomed)

        def both(alerts: list[dict[str, Any]]) -> bool:
            return (
                _find(alerts, "EdgefeedConnectorTaskFailed", connector=connector) is not None
                and _find(alerts, "EdgefeedMonitorDown", instance=doomed_instance) is not None
            )

        alerts = _until(alertmanager, both, "both alerts in the Alertmanager")
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

        # The heal: the connector applied again, the dead exporter's target gone.
        with ConnectClient(settings.connect.url, timeout_s=30) as client:
            deploy.apply(client, settings.database, settings.sources, wait_s=90)
        for service in stack.services:
            remove = getattr(service, "remove_targets", None)
            if remove is not None:
                remove("exporter-doomed")

        def neither(alerts: list[dict[str, Any]]) -> bool:
            return (
                _find(alerts, "EdgefeedConnectorTaskFailed", connector=connector) is None
                and _find(alerts, "EdgefeedMonitorDown", instance=doomed_instance) is None
            )

        _until(alertmanager, neither, "both alerts resolved after the heal")
