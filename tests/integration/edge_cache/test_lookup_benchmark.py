"""A smoke run of benchmarks/lookup.py, so the benchmark cannot rot (Feast not needed)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
pytest_plugins = ["edge_cache_stack"]

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "lookup.py"


def test_lookup_benchmark_smoke(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("edgefeed_bench_lookup", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    out = tmp_path / "lookup.json"
    results = module.main(["--smoke", "--no-feast", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    # every edgefeed form read back exactly what was written, and the near cache really hit
    assert results["checks"] and all(results["checks"].values()), results["checks"]
    assert {"near hits 1", "near hits 100", "edgefeed 100", "edgefeed async 100"} <= set(
        results["checks"]
    )
    for sync in ("sync", "async"):
        for size in ("1x50", "100x50"):
            for near in ("near-off", "near-on"):
                case = results["cases"][f"edgefeed {sync} {near} {size}"]
                assert case["calls"] >= 20 and case["p99_us"] >= case["p50_us"] > 0
            assert results["cases"][f"plain redis-py {sync} {size}"]["calls"] >= 20
    assert results["feast"].startswith("skipped")
    assert "edgefeed/plain p99 100x50" in results["ratios"]
    # millions of entities (issue 36): vectors filled in bulk, byte for byte the
    # writer's, in several chunks; scheduled values for a subset, read from it
    results = module.main(
        ["--smoke", "--no-feast", "--entities", "25000", "--timed-entities", "700"]
    )
    assert results["checks"] and all(results["checks"].values()), results["checks"]
    assert results["fill"]["entities"] == 25_000 and results["fill"]["timed_entities"] == 700


def test_lookup_profile_smoke(tmp_path: Path) -> None:
    """benchmarks/lookup_profile.py: every case reads back the written values (it raises
    otherwise) and each part of a call is timed."""
    script = SCRIPT.with_name("lookup_profile.py")
    spec = importlib.util.spec_from_file_location("edgefeed_bench_lookup_profile", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    path_before = list(sys.path)
    spec.loader.exec_module(module)
    # benchmarks/ on sys.path would shadow the workers and preprocess packages in
    # every later test and in the processes they spawn.
    assert sys.path == path_before
    out = tmp_path / "profile.json"
    for options in (["--ids", "3", "--scheduled"], ["--ids", "1"]):
        results = module.main(["--smoke", *options, "--json", str(out)])
        assert json.loads(out.read_text()) == json.loads(json.dumps(results))
        assert len(results["p50_us"]) == 4 and all(v > 0 for v in results["p50_us"].values())
        assert set(results["hot_us"]) >= {"plan (validate, keys)", "decode", "metrics (record)"}
