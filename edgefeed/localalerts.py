"""What the local stack's Prometheus and Alertmanager say: the targets they scrape
and the alerts that are pending or firing (``make demo`` prints it at its end).

Read through their HTTP APIs (Prometheus ``/api/v1/targets`` and ``/api/v1/alerts``,
Alertmanager ``/api/v2/alerts``), as a person would read their pages.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import requests
from rich.console import Console
from rich.table import Table

from edgefeed.settings import MonitoringSettings

__all__ = ["AlertState", "alert_state", "print_alert_state"]

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class AlertState:
    """The local monitoring as it stands.

    Attributes:
        targets: (job, process, health, last error) per scraped target.
        alerts: (alert name, state, labels) per alert Prometheus holds pending or firing.
        delivered: Alert names Alertmanager holds (active), None without one.
    """

    targets: list[tuple[str, str, str, str]]
    alerts: list[tuple[str, str, dict[str, str]]]
    delivered: list[str] | None

    @property
    def scraped(self) -> bool:
        """Every target was scraped at least once (none is still ``unknown``)."""
        return all(health != "unknown" for _, _, health, _ in self.targets)

    @property
    def firing(self) -> list[str]:
        return sorted({name for name, state, _ in self.alerts if state == "firing"})


def _get(url: str) -> Any:
    answer = requests.get(url, timeout=5)
    answer.raise_for_status()
    return answer.json()


def alert_state(monitoring: MonitoringSettings) -> AlertState:
    """Read the local Prometheus (and Alertmanager, where one runs).

    Raises:
        requests.RequestException: one of them does not answer.
    """
    prometheus = f"http://{LOOPBACK}:{monitoring.prometheus_port}"
    targets = [
        (
            str(t["labels"].get("job", "")),
            str(t["labels"].get("process", t["labels"].get("instance", ""))),
            str(t.get("health", "unknown")),
            str(t.get("lastError", "")),
        )
        for t in _get(f"{prometheus}/api/v1/targets")["data"]["activeTargets"]
    ]
    alerts = [
        (str(a["labels"].get("alertname", "")), str(a.get("state", "")), dict(a["labels"]))
        for a in _get(f"{prometheus}/api/v1/alerts")["data"]["alerts"]
    ]
    delivered = None
    if monitoring.alertmanager_port is not None:
        answer = _get(f"http://{LOOPBACK}:{monitoring.alertmanager_port}/api/v2/alerts")
        delivered = sorted(str(a["labels"].get("alertname", "")) for a in answer)
    return AlertState(sorted(targets), sorted(alerts, key=lambda a: a[:2]), delivered)


def print_alert_state(console: Console, monitoring: MonitoringSettings) -> AlertState | None:
    """Wait (a bounded time) until every target was scraped and the rules evaluated,
    then print the targets and the alerts."""
    deadline = time.monotonic() + 3 * monitoring.scrape_interval_s + 5
    try:
        state = alert_state(monitoring)
        while not state.scraped and time.monotonic() < deadline:
            time.sleep(0.5)
            state = alert_state(monitoring)
        # One more evaluation after the last first scrape.
        time.sleep(min(monitoring.scrape_interval_s, max(0.0, deadline - time.monotonic())))
        state = alert_state(monitoring)
    except requests.RequestException as exc:
        console.print(f"  [red]the local Prometheus does not answer: {type(exc).__name__}[/red]")
        return None
    targets = Table("job", "process", "health", "last error", title="what Prometheus scrapes")
    for job, process, health, error in state.targets:
        style = "green" if health == "up" else "red"
        targets.add_row(job, process, f"[{style}]{health}[/{style}]", error[:80])
    console.print(targets)
    if not state.alerts:
        console.print("  alerts: nothing pending or firing (a healthy run)")
    else:
        alerts = Table("alert", "state", "labels", title="alerts")
        for name, alert_state_, labels in state.alerts:
            shown = {k: v for k, v in labels.items() if k not in ("alertname", "severity")}
            alerts.add_row(name, alert_state_, ", ".join(f"{k}={v}" for k, v in shown.items()))
        console.print(alerts)
    if state.delivered is not None:
        held = ", ".join(state.delivered) or "none"
        console.print(
            f"  alertmanager holds: {held} "
            f"(http://{LOOPBACK}:{monitoring.alertmanager_port}/#/alerts)"
        )
    return state
