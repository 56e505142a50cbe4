"""The serving-overhead benchmark still runs (its --smoke mode), so it cannot rot.

One smoke run (paced, with a second worker logging every request's features) feeds
both tests: starting the benchmark costs more than either test's checks.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

BENCHMARK = Path(__file__).resolve().parents[3] / "benchmarks" / "serving.py"


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    """`serving.py --smoke --rate 600 --feature-log`: its JSON report and its stdout."""
    out = tmp_path_factory.mktemp("serving-smoke") / "report.json"
    done = subprocess.run(
        [
            sys.executable,
            str(BENCHMARK),
            "--smoke",
            "--baseline-ref",
            "",
            "--rate",
            "600",
            "--feature-log",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text()), done.stdout


def test_serving_benchmark_smoke_run_reports_t_service_by_phase(
    smoke_run: tuple[dict[str, Any], str],
) -> None:
    report, stdout = smoke_run
    after = report["runs"]["after"]
    assert after["requests"] + sum(after["errors"].values()) == 60
    assert after["worker_cpu_us_per_request"] > 0
    phases = {"http", "read", "queue", "batch", "resume", "render", "other"}
    assert set(after["phases_from_headers_ms"]) == phases
    assert set(report["phases_from_metrics_ms"]) == phases
    assert "T_service by phase" in stdout
    # Paced: request n goes no earlier than n / 600 s after the start, so 60 requests
    # cannot finish faster than 600/s (a busy machine only makes them slower).
    assert 0 < after["throughput_rps"] <= 600 * 60 / 59 + 1
    assert "paced to 600 req/s" in stdout


def test_serving_benchmark_smoke_compares_a_logging_worker(
    smoke_run: tuple[dict[str, Any], str],
) -> None:
    report, stdout = smoke_run
    logged = report["runs"]["logged"]
    assert logged["requests"] + sum(logged["errors"].values()) == 60
    # Every answered request, warm-up ones too, logged its 20 items.
    assert report["feature_log_rows"] >= 20 * logged["requests"]
    assert report["feature_log_rows"] % 20 == 0
    assert set(report["ratios_logged_over_after"]) == {"p50", "p95", "p99"}
    assert "T_service logged/after" in stdout
