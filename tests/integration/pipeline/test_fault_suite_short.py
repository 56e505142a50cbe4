"""The fault suite's short variant (`make faults-short`), run as CI runs it.

`scripts/fault_suite.py --short` starts its own stack on free loopback ports
(PostgreSQL, Tansu, Connect + Debezium, three Redis servers, the router and a
worker per region), drives 200 changes/s, and strikes four faults one after
another in the middle of the load: kill -9 of the router and of eu-west's
worker, a 6 s CLIENT PAUSE of eu-west's Redis, and a corpus of hostile Debezium
events. After each, every region's cache must equal a recomputation from
PostgreSQL (`edgefeed pipeline verify`). The full run (`make faults`, ~15 min)
is not part of the test suite; docs/operations.md quotes one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.timeout(1500)  # four faults of up to 120 s recovery each, on a busy machine
def test_the_short_fault_suite_loses_nothing_and_leaks_nothing(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("EDGEFEED_FAULTS_KEEP", None)
    try:
        done = subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "fault_suite.py"), "--short", "--json"],
            cwd=tmp_path,  # anything the stack writes outside its own folder lands here
            env=env,
            capture_output=True,
            text=True,
            timeout=1400,
        )
    except subprocess.TimeoutExpired as exc:  # run() killed and reaped it
        raise AssertionError(f"the fault suite ran past 1400 s:\n{exc.stderr}") from None
    assert done.stdout.strip(), f"no report (exit {done.returncode}):\n{done.stderr[-4000:]}"
    outcomes = json.loads(done.stdout)
    assert [o["fault"] for o in outcomes] == [
        "kill -9 router",
        "kill -9 worker eu-west",
        "pause Redis eu-west 6 s",
        "hostile Debezium events",
    ]
    table = json.dumps(outcomes, indent=1)
    for outcome in outcomes:
        assert outcome["recovered_s"] is not None, table
        for count in ("lost", "double_counted", "leaked", "wrong"):
            assert outcome[count] == 0, table
    # The hostile corpus is dead-lettered (with its reasons), the other faults add none.
    assert outcomes[3]["dead_lettered"] > 0, table
    assert all(o["dead_lettered"] == 0 for o in outcomes[:3]), table
    assert done.returncode == 0, done.stderr[-4000:]
