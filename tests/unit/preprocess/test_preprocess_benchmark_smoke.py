"""Keep benchmarks/preprocess.py from rotting: run its --smoke mode."""

from __future__ import annotations

import json
from pathlib import Path

from benchrun import run_benchmark


def test_benchmark_smoke_run(tmp_path: Path) -> None:
    out = tmp_path / "preprocess.json"
    completed = run_benchmark("preprocess.py", "--smoke", "--out", str(out), timeout=120)
    results = json.loads(out.read_text())
    assert results["smoke"] is True
    tensors = results["tensors"]
    assert tensors["fast_images_per_s"] > 0 and tensors["baseline_images_per_s"] > 0
    assert tensors["parity_gap2"]["mean"] <= 0.75
    webp = results["webp"]["rows"][0]
    assert webp["webp_ssim"] >= webp["jpeg_ssim"]
    codecs = {(row["codec"], row["level"]) for row in results["brotli"]["rows"]}
    assert ("brotli", 4) in codecs and ("gzip", 6) in codecs
    assert "(a)" in completed.stdout and "(b)" in completed.stdout and "(c)" in completed.stdout
