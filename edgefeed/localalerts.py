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

__all__ = ["AlertState", "TargetDown", "alert_state", "explain_scrape_error", "print_alert_state"]

LOOPBACK = "127.0.0.1"


# Where the token of a job comes from: DevStack.scrape(job, ..., token=) writes it to
# <state>/services/prometheus/tokens/<job>; the process checks it against its own.
_TOKEN_SETTINGS = {
    "edgefeed-exporter": "`edgefeed exporter --token-file` / `--token-env`",
    "edgefeed-pipeline": "`pipeline run --metrics-token-file`",
    "edgefeed-workers": "`edgefeed workers serve --auth-token-file`",
}


def explain_scrape_error(job: str, instance: str, error: str) -> str:
    """What a target's ``lastError`` means for a person, naming the target and, for
    a refused token, the setting on each side."""
    lowered = error.lower()
    if "401" in error or "unauthorized" in lowered:
        wants = _TOKEN_SETTINGS.get(job, "the token the process requires")
        return (
            f"{job} target {instance} refuses the bearer token Prometheus sends (HTTP 401): "
            f"the token given for job {job} (DevStack.scrape(..., token=), written to "
            f"<state>/services/prometheus/tokens/{job}) is not {wants}; give both the same "
            "token"
        )
    if "connection refused" in lowered:
        return (
            f"{job} target {instance} is unreachable: nothing listens there ({error}); "
            "the process is stopped or moved to another port"
        )
    if "deadline exceeded" in lowered or "timeout" in lowered:
        return f"{job} target {instance} does not answer in time ({error})"
    return f"{job} target {instance} cannot be scraped: {error or 'no error reported yet'}"


@dataclass(frozen=True, slots=True, order=True)
class TargetDown:
    """A target whose last scrape failed.

    Attributes:
        job: Its scrape job.
        process: The process it is (its ``process`` label) or its instance.
        instance: host:port scraped.
        error: Prometheus' ``lastError``.
    """

    job: str
    process: str
    instance: str
    error: str

    def explain(self) -> str:
        return explain_scrape_error(self.job, self.instance, self.error)


@dataclass(frozen=True, slots=True)
class AlertState:
    """The local monitoring as it stands.

    Attributes:
        targets: (job, process, health, last error) per scraped target.
        alerts: (alert name, state, labels) per alert Prometheus holds pending or firing.
        delivered: Alert names Alertmanager holds (active), None without one.
        down: The targets whose last scrape failed, with their instance.
    """

    targets: list[tuple[str, str, str, str]]
    alerts: list[tuple[str, str, dict[str, str]]]
    delivered: list[str] | None
    down: tuple[TargetDown, ...] = ()

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
    active = _get(f"{prometheus}/api/v1/targets")["data"]["activeTargets"]
    targets = [
        (
            str(t["labels"].get("job", "")),
            str(t["labels"].get("process", t["labels"].get("instance", ""))),
            str(t.get("health", "unknown")),
            str(t.get("lastError", "")),
        )
        for t in active
    ]
    down = tuple(
        sorted(
            TargetDown(
                str(t["labels"].get("job", "")),
                str(t["labels"].get("process", t["labels"].get("instance", ""))),
                str(t["labels"].get("instance", "")),
                str(t.get("lastError", "")),
            )
            for t in active
            if t.get("health") == "down"
        )
    )
    alerts = [
        (str(a["labels"].get("alertname", "")), str(a.get("state", "")), dict(a["labels"]))
        for a in _get(f"{prometheus}/api/v1/alerts")["data"]["alerts"]
    ]
    delivered = None
    if monitoring.alertmanager_port is not None:
        answer = _get(f"http://{LOOPBACK}:{monitoring.alertmanager_port}/api/v2/alerts")
        delivered = sorted(str(a["labels"].get("alertname", "")) for a in answer)
    return AlertState(sorted(targets), sorted(alerts, key=lambda a: a[:2]), delivered, down)


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
    for target in state.down:
        console.print(f"  [red]down: {target.explain()}[/red]")
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
