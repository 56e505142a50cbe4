"""Keep benchmarks/scale.py from rotting: its --smoke run, whose recovery must give
back every entity with the very vectors the worker held before it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_scale_benchmark_smoke_run() -> None:
    completed = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "scale.py"), "--smoke", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    (result,) = json.loads(completed.stdout)
    users, events = result["users"], result["events_per_user"]
    assert result["changes"] == 2 * users * events
    assert result["dead_lettered"] == 0
    assert result["entities"] == users + users // 10  # every user and every item
    assert 0 < result["rows"] <= result["changes"]
    assert result["recovered_entities"] == result["entities"]
    assert result["recovered_equal"] is True
    # Every recovered state is the one whose vector the cache holds: none is written
    # again at once (each is renewed when its schedule runs out).
    assert result["rewritten"] == 0
    assert result["changes_per_s"] > 0 and result["state_mb"] >= 0
