"""Keep benchmarks/history.py from rotting, and use its checks: the columnar engine
equals the reference replay on every feature of every row; and, independently, with the
late events taken out, pandas' merge_asof features (what a data scientist would
write) must equal the training set's, row by row; with them, pandas counts late
events before their commit (leakage) and the training set does not."""

from __future__ import annotations

import re

from benchrun import run_benchmark


def test_history_benchmark_small_run_agrees_with_pandas() -> None:
    completed = run_benchmark(
        "history.py", "--users", "50", "--events", "3000", "--spine", "2000", "--check", "2000"
    )
    out = completed.stdout
    assert "without the late events: pandas equals edgefeed on all 6 features" in out, out
    assert "the first 2,000 rows equal the reference replay (all features)" in out, out
    differing = re.search(r"pandas rows differing \(late events[^)]*\): (.*)", out)
    assert differing, out
    counts = [int(n) for n in re.findall(r" (\d+)(?:,|$)", differing.group(1))]
    assert sum(counts) > 0, out  # the late events made pandas leak
