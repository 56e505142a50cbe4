"""Keep benchmarks/instructions.py from rotting: its --smoke run counts the
instructions of a vector from scratch under valgrind, and it says plainly what is
missing when valgrind is not installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchrun import BENCHMARKS, run_benchmark


def test_instructions_benchmark_counts_a_vector_from_scratch(tmp_path: Path) -> None:
    out = tmp_path / "instructions.json"
    completed = run_benchmark("instructions.py", "--smoke", "--steps", "vector", "--json", str(out))
    report = json.loads(out.read_text())
    found = report["trees"]["after"]
    # A demo entity's vector and schedule from scratch, read back from the store, is
    # hundreds of thousands of instructions: far above what start-up noise could leave
    # once the run without passes is subtracted, and far below a runaway.
    assert 100_000 < found["vector"] < 20_000_000, found
    assert len(found["digests"]["vector"]) == 32
    assert "read" not in found and "vector_alone" not in found  # only the step asked for
    assert f"{found['vector']:,d}" in completed.stdout


def test_instructions_benchmark_without_valgrind_says_what_to_install(tmp_path: Path) -> None:
    # A PATH with this interpreter's folder only: no valgrind on it.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    completed = subprocess.run(
        [sys.executable, str(BENCHMARKS / "instructions.py"), "--smoke"],
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": str(bin_dir)},
        timeout=60,
        check=False,
    )
    assert completed.returncode == 1
    assert "valgrind is not installed" in completed.stderr
    assert "apt-get install valgrind" in completed.stderr
