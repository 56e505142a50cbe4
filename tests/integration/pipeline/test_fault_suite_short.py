"""The fault suite's short variant (scripts/fault_suite.py --short): kill -9 of the
router and a worker, a paused Redis and hostile events, under load, on its own
local stack; after each, every vector in every region equals a recomputation from
PostgreSQL. `make faults` runs every fault."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "fault_suite.py"


@pytest.mark.timeout(900)
def test_no_fault_loses_double_counts_or_leaks_an_update() -> None:
    argv = [sys.executable, str(SCRIPT), "--short", "--json", "--rate", "100", "--load-s", "6"]
    with subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=840)
        except subprocess.TimeoutExpired:
            # SIGTERM: the suite stops its own stack before it exits.
            process.terminate()
            stdout, stderr = process.communicate(timeout=60)
            pytest.fail(f"the fault suite did not end in 840 s:\n{stdout}\n{stderr[-4000:]}")
    result = subprocess.CompletedProcess(argv, process.returncode, stdout, stderr)
    assert result.stdout.strip(), result.stderr[-4000:]
    outcomes = json.loads(result.stdout)
    assert [o["fault"] for o in outcomes] == [
        "kill -9 router",
        "kill -9 worker eu-west",
        "pause Redis eu-west 6 s",
        "hostile Debezium events",
    ]
    for outcome in outcomes:
        assert outcome["recovered_s"] is not None, outcome
        assert (outcome["lost"], outcome["double_counted"], outcome["leaked"]) == (0, 0, 0), outcome
        assert outcome["wrong"] == 0, outcome
    assert outcomes[-1]["dead_lettered"] >= 6  # the hostile corpus, each with its reason
    assert result.returncode == 0, result.stderr[-4000:]
