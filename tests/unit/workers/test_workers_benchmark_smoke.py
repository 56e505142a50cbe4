"""The workers benchmark still runs (its --smoke mode), so it cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[3] / "benchmarks" / "workers.py"


def test_benchmark_smoke_run_reports_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, str(BENCHMARK), "--smoke", "--device", "cpu", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    runs = report["batching"]["runs"]
    assert runs["batch-1"]["mean_batch_rows"] == 1.0
    assert runs["dynamic"]["mean_batch_rows"] > 1.0
    for run in runs.values():
        assert run["errors"] == {}
        assert set(run["latency_ms"]) == {"network", "data", "model", "service", "total"}
    assert report["batching"]["throughput_ratio"] > 0
    precision = report["precision"]
    assert precision["reduced"] == "int8"
    assert set(precision["accuracy"]) == {"fp32", "int8", "top1_agreement"}
    assert 0.5 < precision["accuracy"]["fp32"]["classifier_top1"] <= 1.0
    assert "throughput x" in done.stdout
