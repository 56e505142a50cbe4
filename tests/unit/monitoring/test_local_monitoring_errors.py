"""Bad input to the local Prometheus, with the errors a person reads: a rule file
that does not parse stops `edgefeed dev up` before anything starts (the file and
promtool's message named); a target Prometheus cannot reach, and one that refuses
its token, are reported by the alert-state printout with their job and instance
(and, for the token, the settings on both sides).

The last test runs Debian's real Prometheus (installed by `make install`); the
targets are small HTTP servers in the test: one that requires a bearer token as
the exporter does, and a port where nothing listens.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from rich.console import Console

from edgefeed.devstack import DevStack
from edgefeed.devstack.monitoring import AlertRulesError, PrometheusService, check_rules
from edgefeed.localalerts import alert_state, explain_scrape_error, print_alert_state
from edgefeed.settings import settings_from_mapping

ROOT = Path(__file__).resolve().parents[3]
TOKEN = "scrape-0b5e2c9d7a14f3e68c2d"

# `sum(rate(...) >`: the parenthesis never closes.
BAD_RULES = """\
groups:
  - name: edgefeed
    rules:
      - alert: Broken
        expr: sum(rate(edgefeed_worker_requests_total[1m]) >
        for: 1m
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _stack(tmp_path: Path, prometheus_port: int) -> DevStack:
    mapping: dict[str, object] = {
        "kafka": {"bootstrap_servers": "127.0.0.1:19092"},
        "regions": [
            {"name": "eu-west", "redis_url": "redis://127.0.0.1:16379/0", "residency_zone": "eu"}
        ],
        "monitoring": {"prometheus_port": prometheus_port, "scrape_interval_s": 1},
    }
    return DevStack(settings_from_mapping(mapping), tmp_path, only=["prometheus"])


def test_the_checkouts_rules_pass_the_check() -> None:
    check_rules(ROOT / "deploy" / "prometheus" / "alerts.yml")


def test_a_rule_file_that_does_not_parse_stops_dev_up_naming_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "alerts.yml"
    bad.write_text(BAD_RULES)
    stack = _stack(tmp_path / "state", _free_port())
    prometheus = stack.service("prometheus")
    assert isinstance(prometheus, PrometheusService)
    prometheus.rule_file = bad
    with pytest.raises(AlertRulesError) as raised:
        stack.up(timeout_s=30)
    message = str(raised.value)
    assert str(bad) in message
    assert "unclosed left parenthesis" in message  # promtool's own words
    assert '"Broken"' in message  # the rule
    assert isinstance(raised.value, ValueError)
    # Nothing was started.
    assert not stack.pid_path("prometheus").exists()


def test_a_rule_file_that_is_not_yaml_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "alerts.yml"
    bad.write_text("groups:\n  - name: [unclosed\n")
    with pytest.raises(AlertRulesError, match=str(bad)):
        check_rules(bad)


@pytest.mark.parametrize(
    ("job", "error", "named"),
    [
        (
            "edgefeed-exporter",
            "server returned HTTP status 401 Unauthorized",
            ["127.0.0.1:9308", "401", "tokens/edgefeed-exporter", "--token-file"],
        ),
        (
            "edgefeed-workers",
            "server returned HTTP status 401 Unauthorized",
            ["127.0.0.1:9308", "--auth-token-file"],
        ),
        (
            "edgefeed-pipeline",
            'Get "http://127.0.0.1:9308/metrics": dial tcp 127.0.0.1:9308: connect: '
            "connection refused",
            ["edgefeed-pipeline", "127.0.0.1:9308", "unreachable", "connection refused"],
        ),
    ],
)
def test_scrape_errors_name_the_target_and_the_fix(job: str, error: str, named: list[str]) -> None:
    said = explain_scrape_error(job, "127.0.0.1:9308", error)
    for word in named:
        assert word in said, (word, said)


class _Metrics(BaseHTTPRequestHandler):
    """/metrics behind a bearer token, as the exporter serves it."""

    def do_GET(self) -> None:
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            self.send_response(401)
            self.end_headers()
            return
        body = b"edgefeed_up 1\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def token_server() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_real_prometheus_reports_an_unreachable_target_and_a_wrong_token(
    tmp_path: Path, token_server: int
) -> None:
    prometheus_port = _free_port()
    closed = _free_port()  # nothing listens here
    stack = _stack(tmp_path, prometheus_port)
    try:
        stack.up(timeout_s=60)
        assert stack.scrape("edgefeed-exporter", "exporter", token_server, token="wrong")
        assert stack.scrape("edgefeed-workers", "worker-eu-west", closed)
        monitoring = stack.settings.monitoring
        deadline = time.monotonic() + 60
        while True:
            state = alert_state(monitoring)
            if len(state.down) == 2 and all(t.error for t in state.down):
                break
            assert time.monotonic() < deadline, state.down
            time.sleep(0.3)
        exporter, worker = state.down  # sorted by job
        assert (exporter.job, exporter.instance) == (
            "edgefeed-exporter",
            f"127.0.0.1:{token_server}",
        )
        assert "401" in exporter.error
        assert (worker.job, worker.instance) == ("edgefeed-workers", f"127.0.0.1:{closed}")
        assert "connection refused" in worker.error
        console = Console(record=True, width=500)
        print_alert_state(console, monitoring)
        shown = console.export_text()
        assert f"edgefeed-exporter target 127.0.0.1:{token_server} refuses the bearer" in shown
        assert "--token-file" in shown
        assert f"edgefeed-workers target 127.0.0.1:{closed} is unreachable" in shown
        # The right token: the target is up and no longer reported.
        stack.scrape("edgefeed-exporter", "exporter", token_server, token=TOKEN)
        deadline = time.monotonic() + 60
        while True:
            state = alert_state(monitoring)
            if [t.job for t in state.down] == ["edgefeed-workers"]:
                break
            assert time.monotonic() < deadline, state.down
            time.sleep(0.3)
    finally:
        stack.down()
    assert not stack.pid_path("prometheus").exists()
