"""The local stack's Prometheus and Alertmanager: planned from `monitoring.*`, on
loopback only, loading the checkout's alert rules (run for real in
tests/integration/monitoring/test_pipeline_lag.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from edgefeed.devstack import DevStack
from edgefeed.devstack.monitoring import SCRAPE_JOBS, PrometheusService
from edgefeed.settings import settings_from_mapping

ROOT = Path(__file__).resolve().parents[3]


def _settings(monitoring: dict[str, object] | None) -> dict[str, object]:
    mapping: dict[str, object] = {
        "kafka": {"bootstrap_servers": "127.0.0.1:19092"},
        "regions": [
            {"name": "eu-west", "redis_url": "redis://127.0.0.1:16379/0", "residency_zone": "eu"}
        ],
    }
    if monitoring is not None:
        mapping["monitoring"] = monitoring
    return mapping


def test_no_ports_no_prometheus(tmp_path: Path) -> None:
    stack = DevStack(settings_from_mapping(_settings(None)), tmp_path, with_connect=False)
    assert {s.name for s in stack.services}.isdisjoint({"prometheus", "alertmanager"})
    assert stack.scrape("edgefeed-exporter", "exporter", 9308) is False


def test_prometheus_loads_the_checkouts_rules_and_sends_to_its_alertmanager(
    tmp_path: Path,
) -> None:
    mapping = _settings({"prometheus_port": 19090, "alertmanager_port": 19093})
    stack = DevStack(settings_from_mapping(mapping), tmp_path, with_connect=False)
    prometheus = stack.service("prometheus")
    alertmanager = stack.service("alertmanager")
    assert isinstance(prometheus, PrometheusService)
    assert prometheus.depends_on == ("alertmanager",)
    prometheus.prepare()
    config = yaml.safe_load(prometheus.config_file.read_text())
    assert config["rule_files"] == [str(ROOT / "deploy" / "prometheus" / "alerts.yml")]
    assert config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == [
        "127.0.0.1:19093"
    ]
    jobs = {scrape["job_name"] for scrape in config["scrape_configs"]}
    assert set(SCRAPE_JOBS) <= jobs
    # Everything on loopback: Alertmanager's gossip port would bind 0.0.0.0:9094.
    assert "--web.listen-address=127.0.0.1:19090" in prometheus.argv()
    assert "--cluster.listen-address=" in alertmanager.argv()
    assert "--web.listen-address=127.0.0.1:19093" in alertmanager.argv()


def test_scrape_targets_follow_the_processes(tmp_path: Path) -> None:
    mapping = _settings({"prometheus_port": 19090})
    stack = DevStack(settings_from_mapping(mapping), tmp_path, with_connect=False)
    prometheus = stack.service("prometheus")
    assert isinstance(prometheus, PrometheusService)
    assert prometheus.alertmanager_port is None
    prometheus.prepare()
    assert "alerting" not in yaml.safe_load(prometheus.config_file.read_text())
    assert stack.scrape("edgefeed-pipeline", "pipeline-router", 18001, token="t0k")
    target = prometheus.targets_dir("edgefeed-pipeline") / "pipeline-router.json"
    assert yaml.safe_load(target.read_text())[0]["targets"] == ["127.0.0.1:18001"]
    assert prometheus.token_file("edgefeed-pipeline").read_text().strip() == "t0k"
    stack.stop_app("pipeline-router")  # not running: its target goes all the same
    assert not target.exists()
    with pytest.raises(ValueError, match="scrape job 'edgefeed-nope' unknown"):
        stack.scrape("edgefeed-nope", "x", 1)
