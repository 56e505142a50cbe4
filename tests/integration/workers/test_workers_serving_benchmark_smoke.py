"""The serving-overhead benchmark still runs (its --smoke mode), so it cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

BENCHMARK = Path(__file__).resolve().parents[3] / "benchmarks" / "serving.py"


def test_serving_benchmark_smoke_run_reports_t_service_by_phase(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    done = subprocess.run(
        [
            sys.executable,
            str(BENCHMARK),
            "--smoke",
            "--baseline-ref",
            "",
            "--rate",
            "600",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    after = report["runs"]["after"]
    assert after["requests"] + sum(after["errors"].values()) == 60
    assert after["worker_cpu_us_per_request"] > 0
    phases = {"http", "read", "queue", "batch", "resume", "render", "other"}
    assert set(after["phases_from_headers_ms"]) == phases
    assert set(report["phases_from_metrics_ms"]) == phases
    assert "T_service by phase" in done.stdout
    # Paced: request n goes no earlier than n / 600 s after the start, so 60 requests
    # cannot finish faster than 600/s (a busy machine only makes them slower).
    assert 0 < after["throughput_rps"] <= 600 * 60 / 59 + 1
    assert "paced to 600 req/s" in done.stdout
