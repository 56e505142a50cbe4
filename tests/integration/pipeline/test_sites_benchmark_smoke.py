"""A small run of benchmarks/sites.py, so the benchmark cannot rot."""

from __future__ import annotations

import json

import pytest
from benchrun import run_benchmark

pytestmark = pytest.mark.integration


def test_sites_benchmark_smoke_run_measures_every_phase_and_the_link() -> None:
    result = run_benchmark("sites.py", "--smoke", "--json", timeout=600)
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


def test_partition_benchmark_smoke_run_cuts_eu_west_and_it_catches_up() -> None:
    """The 30 s partition benchmark, shortened (8 s windows at 200 changes/s): every
    site behind its link, central <-> eu-west cut once. Functional only: what an
    operator and a client see during the cut, the catch-up, and every region equal
    to a recomputation afterwards (the timings are docs/benchmarks.md's)."""
    result = run_benchmark("sites.py", "--phases", "partition", "--smoke", "--json", timeout=600)
    (phase,) = json.loads(result.stdout)["phases"]
    # no cut, cut, and the closing no-cut window
    assert [w["cut"] for w in phase["windows"]] == [False, True, False]
    for window in phase["windows"]:
        for region in ("us-east", "ap-southeast"):  # the other regions kept flowing
            assert window["regions"][region]["count"] > 0, (region, window)
    (cut,) = phase["cuts"]
    assert cut["lag_link_state"] == "CUT", cut
    assert cut["lag_eu_west_behind_s"] >= cut["cut_s"] - 1, cut
    assert 0.0 in cut["exporter_link_up_during_cut"], cut
    at_end = cut["lookups_at_cut_end"]  # served from the cache, withheld as stale
    assert at_end["found"] == at_end["users"] > 0, cut
    assert at_end["stale_withheld"] == at_end["users"], cut
    assert cut["heal_to_caught_up_s"] is not None, cut
    assert phase["verify"]["ok"], phase["verify"]
    assert phase["verify"]["mismatches"] == 0
    assert set(phase["ratios_p99_bracketed"]) == {"us-east", "ap-southeast"}
