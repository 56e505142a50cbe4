"""Run a script of benchmarks/ as a user would (``python benchmarks/X.py ...``) for the
suite's smoke tests. An importable module (``from benchrun import run_benchmark``),
beside stackhelpers; it imports nothing of the project, so unit tests may use it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

__all__ = ["BENCHMARKS", "run_benchmark"]

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def run_benchmark(
    script: str, *args: str, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``benchmarks/<script>`` run with this interpreter; fails the test (with the tails
    of its output) unless it exits 0. ``script`` is relative to benchmarks/."""
    completed = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-4000:]
    return completed
