"""Prometheus and Alertmanager in the local stack (Debian's ``prometheus`` and
``prometheus-alertmanager``), so that the alert rules of deploy/prometheus run on
a real Prometheus and their alerts reach a real Alertmanager on a laptop too.

Prometheus evaluates the very file production uses (``deploy/prometheus/alerts.yml``,
read where it lies in the checkout, not a copy) and finds what to scrape in target
files (``file_sd``) that :meth:`edgefeed.devstack.DevStack.scrape` writes when the
demo or a test starts a process with a metrics port: the processes of a local
stack come and go on free ports, and a target file is how Prometheus follows them
without a reload. Jobs are named as in production (``edgefeed-exporter``: the
``EdgefeedMonitorDown`` rule reads ``up{job="edgefeed-exporter"}``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import requests
import yaml

from edgefeed.devstack import binaries
from edgefeed.devstack.exceptions import DevStackError, MissingBinaryError
from edgefeed.devstack.services import LOOPBACK, Service

__all__ = [
    "SCRAPE_JOBS",
    "AlertRulesError",
    "AlertmanagerService",
    "PrometheusService",
    "alerts_file",
    "check_rules",
]

# What the local Prometheus scrapes: the exporter, the pipeline's workers (router
# and regions, `pipeline run --metrics-port`) and the model workers.
SCRAPE_JOBS = ("edgefeed-exporter", "edgefeed-pipeline", "edgefeed-workers")


def alerts_file() -> Path:
    """deploy/prometheus/alerts.yml of this checkout: the rules production loads."""
    path = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "alerts.yml"
    if not path.is_file():
        raise MissingBinaryError(
            f"the alert rules {path} are missing: the local Prometheus loads the checkout's "
            "deploy/prometheus/alerts.yml; run `edgefeed dev up` from a checkout of edgefeed, "
            "or leave monitoring.prometheus_port unset"
        )
    return path


class AlertRulesError(DevStackError, ValueError):
    """An alert rule file does not pass ``promtool check rules`` (YAML that does not
    parse, a PromQL expression Prometheus rejects). Not retryable: the message names
    the file and quotes promtool; fix the file and run ``edgefeed dev up`` again."""


def _promtool() -> str:
    # Debian's prometheus package ships promtool beside prometheus.
    beside = Path(binaries.prometheus_binary()).with_name("promtool")
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("promtool")
    if found is None:
        raise MissingBinaryError(
            "promtool not found beside prometheus or on PATH; install Debian's `prometheus` "
            "package (`make install`)"
        )
    return found


def check_rules(path: Path) -> None:
    """Run ``promtool check rules`` on ``path``.

    Prometheus itself refuses a bad rule file only in its log; checked first, the
    error names the file and says what is wrong with it.

    Raises:
        AlertRulesError: promtool rejects the file.
        MissingBinaryError: promtool is not installed.
    """
    done = subprocess.run(
        [_promtool(), "check", "rules", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if done.returncode != 0:
        said = "\n".join(
            line.strip()
            for line in (done.stdout + done.stderr).splitlines()
            if line.strip() and not line.startswith("Checking ")
        )
        raise AlertRulesError(
            f"the alert rule file {path} does not pass `promtool check rules`:\n{said}\n"
            f"fix the file (check it with `promtool check rules {path}`) and start again"
        )


def _ready(port: int, what: str) -> str | None:
    try:
        answer = requests.get(f"http://{LOOPBACK}:{port}/-/ready", timeout=2)
    except requests.RequestException as exc:
        return f"{what} on {LOOPBACK}:{port} does not answer: {type(exc).__name__}"
    if answer.status_code != 200:
        return f"{what} on {LOOPBACK}:{port} is not ready (HTTP {answer.status_code})"
    return None


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    os.replace(partial, path)


@dataclass(slots=True)
class PrometheusService(Service):
    """Prometheus on loopback, with the checkout's alert rules and file_sd targets.

    Attributes:
        alertmanager_port: Where it sends alerts (None: nowhere).
        scrape_interval_s: Scrape and rule evaluation interval.
        rule_file: The alert rules (None: the checkout's deploy/prometheus/alerts.yml).
    """

    alertmanager_port: int | None = None
    scrape_interval_s: float = 5.0
    rule_file: Path | None = None
    kind: str = field(default="prometheus", init=False)

    @property
    def config_file(self) -> Path:
        return self.home / "prometheus.yml"

    def targets_dir(self, job: str) -> Path:
        return self.home / "targets" / job

    def token_file(self, job: str) -> Path:
        return self.home / "tokens" / job

    def rules(self) -> Path:
        return self.rule_file if self.rule_file is not None else alerts_file()

    def config(self) -> dict[str, object]:
        interval = f"{self.scrape_interval_s:g}s"
        scrapes: list[dict[str, object]] = [
            {
                "job_name": job,
                "authorization": {"credentials_file": str(self.token_file(job))},
                "file_sd_configs": [
                    {"files": [str(self.targets_dir(job) / "*.json")], "refresh_interval": "5s"}
                ],
            }
            for job in SCRAPE_JOBS
        ]
        scrapes.append(
            {"job_name": "prometheus", "static_configs": [{"targets": [f"{LOOPBACK}:{self.port}"]}]}
        )
        config: dict[str, object] = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": [str(self.rules())],
            "scrape_configs": scrapes,
        }
        if self.alertmanager_port is not None:
            am = f"{LOOPBACK}:{self.alertmanager_port}"
            config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [am]}]}]}
            scrapes.append({"job_name": "alertmanager", "static_configs": [{"targets": [am]}]})
        return config

    def prepare(self) -> None:
        # Before anything starts: a bad file would only show in Prometheus' log.
        check_rules(self.rules())
        self.home.mkdir(parents=True, exist_ok=True)
        for job in SCRAPE_JOBS:
            self.targets_dir(job).mkdir(parents=True, exist_ok=True)
            token = self.token_file(job)
            if not token.exists():
                # Prometheus sends it as a bearer token; an endpoint without a token
                # ignores it. DevStack.scrape writes the real one.
                _write_atomic(token, "none\n")
                token.chmod(0o600)
        # Written at every start: the settings' ports and the rules' path may move.
        _write_atomic(self.config_file, yaml.safe_dump(self.config(), sort_keys=False))

    def argv(self) -> list[str]:
        return [
            binaries.prometheus_binary(),
            f"--config.file={self.config_file}",
            f"--storage.tsdb.path={self.home / 'data'}",
            "--storage.tsdb.retention.time=2d",
            f"--web.listen-address={LOOPBACK}:{self.port}",
            "--web.enable-lifecycle",
        ]

    def probe(self) -> str | None:
        return _ready(self.port, "prometheus")

    def write_target(self, job: str, name: str, port: int, token: str | None) -> Path:
        """Scrape ``127.0.0.1:port`` in ``job`` as ``name`` (the token: the job's)."""
        if job not in SCRAPE_JOBS:
            raise ValueError(f"scrape job {job!r} unknown; jobs: {', '.join(SCRAPE_JOBS)}")
        if token is not None:
            _write_atomic(self.token_file(job), token.strip() + "\n")
        path = self.targets_dir(job) / f"{name}.json"
        target = [{"targets": [f"{LOOPBACK}:{port}"], "labels": {"process": name}}]
        _write_atomic(path, json.dumps(target))
        return path

    def remove_targets(self, name: str) -> None:
        """Stop scraping the process ``name`` (it was stopped)."""
        for job in SCRAPE_JOBS:
            (self.targets_dir(job) / f"{name}.json").unlink(missing_ok=True)


@dataclass(slots=True)
class AlertmanagerService(Service):
    """Alertmanager on loopback, alone (no cluster port), sending nowhere: its API
    (``/api/v2/alerts``) and UI show what fired."""

    kind: str = field(default="alertmanager", init=False)

    @property
    def config_file(self) -> Path:
        return self.home / "alertmanager.yml"

    def prepare(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        config = {
            "route": {
                "receiver": "local",
                "group_by": ["alertname", "region"],
                "group_wait": "5s",
                "group_interval": "30s",
                "repeat_interval": "4h",
            },
            "receivers": [{"name": "local"}],
        }
        _write_atomic(self.config_file, yaml.safe_dump(config, sort_keys=False))

    def argv(self) -> list[str]:
        return [
            binaries.alertmanager_binary(),
            f"--config.file={self.config_file}",
            f"--storage.path={self.home / 'data'}",
            f"--web.listen-address={LOOPBACK}:{self.port}",
            # No gossip port: a single local instance (by default it binds 0.0.0.0:9094).
            "--cluster.listen-address=",
        ]

    def probe(self) -> str | None:
        return _ready(self.port, "alertmanager")
