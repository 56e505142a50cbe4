"""A small run of benchmarks/sites.py, so the benchmark cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "sites.py"


def test_sites_benchmark_smoke_run_measures_every_phase_and_the_link() -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    report = json.loads(result.stdout)
    phases = {phase["phase"]: phase for phase in report["phases"]}
    assert set(phases) == {"single", "link", "raw"}
    for phase in phases.values():
        assert phase["vectors_written"] > 0
        assert 0 < phase["commit_to_redis_p50_ms"] <= phase["commit_to_redis_p99_ms"]
    assert phases["single"]["link_bytes_up_per_1000_changes"] == 0  # nothing crossed it
    # The changes crossed the link, and zstd made them smaller than no compression.
    zstd, raw = phases["link"], phases["raw"]
    assert 0 < zstd["link_bytes_up_per_1000_changes"] < raw["link_bytes_up_per_1000_changes"]
