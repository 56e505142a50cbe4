"""A small run of benchmarks/pipeline.py, so the benchmark cannot rot."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "pipeline.py"


def test_pipeline_benchmark_smoke_run_measures_every_part() -> None:
    result = subprocess.run(
        # --renewals 3600: part (c) with windows of 0.5 s and 1 s (30m, 1h), so rows
        # leave them during the short load and the settle after it
        [sys.executable, str(SCRIPT), "--smoke", "--json", "--renewals", "3600"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    report = json.loads(result.stdout)
    throughput, freshness = report["throughput"], report["freshness"]
    assert throughput["plain"] > 0 and throughput["edgefeed"] > 0
    assert throughput["speedup"] == pytest.approx(throughput["edgefeed"] / throughput["plain"])
    assert freshness["vectors_written"] > 0
    assert 0 < freshness["commit_to_redis_p50_ms"] <= freshness["commit_to_redis_p99_ms"]
    assert math.isfinite(freshness["commit_to_kafka_p50_ms"])
    # measured after the warm-up; the whole run's figures beside them
    assert freshness["warmup_s"] == 1.0 and freshness["seconds"] >= 2.5, freshness
    assert freshness["cold_vectors_written"] > freshness["vectors_written"], freshness
    assert 0 < freshness["kafka_samples"] < freshness["cold_kafka_samples"], freshness
    assert 0 < freshness["cold_commit_to_redis_p50_ms"] <= freshness["cold_commit_to_redis_p99_ms"]
    # (c): windows read as of the read time stay true through renewals, measured
    renewals = report["renewals"]
    assert renewals["vectors_written"] > 0
    assert renewals["renewals"] > 0, renewals
    assert 0 <= renewals["renewal_lag_p50_ms"] <= renewals["renewal_lag_p99_ms"], renewals
    assert renewals["renewal_lag_max_bucket_s"] is not None
