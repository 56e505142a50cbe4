"""A smoke run of benchmarks/lookup.py, so the benchmark cannot rot (Feast not needed)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "lookup.py"


def test_lookup_benchmark_smoke(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("edgefeed_bench_lookup", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
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
