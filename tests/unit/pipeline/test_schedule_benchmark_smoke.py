"""Keep benchmarks/schedule.py from rotting: a small run prints, for each entity size,
the vector's cost, the write's at a fixed and at a moving ``now``, and their ratio."""

from __future__ import annotations

from benchrun import run_benchmark


def test_schedule_benchmark_small_run_prints_every_case() -> None:
    completed = run_benchmark(
        "schedule.py", "--events", "5", "--events", "50", "--calls", "30", "--rounds", "1"
    )
    rows = {
        int(line.split()[0]): [float(x) for x in line.split()[1:]]
        for line in completed.stdout.splitlines()
        if line.strip() and line.split()[0].isdigit()
    }
    assert set(rows) == {5, 50}, completed.stdout
    for vector_us, write_us, ratio, moving_us in rows.values():
        assert vector_us > 0 and write_us > 0 and moving_us > 0
        # the ratio of the unrounded medians; the printed ones are rounded to 0.1 us
        assert abs(ratio - write_us / vector_us) <= 0.05 * write_us / vector_us
