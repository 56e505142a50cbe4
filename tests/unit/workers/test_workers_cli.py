"""`edgefeed workers bench` and `serve` as people and scripts call them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from edgefeed.cli import app

EDGEFEED = str(Path(sys.executable).with_name("edgefeed"))


def test_bench_json_reports_the_four_terms_and_the_total() -> None:
    result = CliRunner().invoke(
        app,
        [
            "workers",
            "bench",
            "--model",
            "image-classifier",
            "--requests",
            "24",
            "--concurrency",
            "4",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["requests"] == 24
    assert set(summary["latency_ms"]) == {"network", "data", "model", "service", "total"}
    assert summary["latency_ms"]["total"]["p50"] >= summary["latency_ms"]["model"]["p50"]


def test_bench_table_for_people() -> None:
    result = CliRunner().invoke(
        app, ["workers", "bench", "--requests", "8", "--concurrency", "2"], env={"COLUMNS": "120"}
    )
    assert result.exit_code == 0, result.output
    for term in ("T_network", "T_data", "T_model", "T_service", "T_total", "p50 ms", "p99 ms"):
        assert term in result.output


def test_serve_with_an_impossible_precision_exits_2_with_the_fix() -> None:
    result = CliRunner().invoke(
        app,
        [
            "workers",
            "serve",
            "--model",
            "image-classifier",
            "--region",
            "eu-west",
            "--device",
            "cpu",
            "--precision",
            "fp16",
            "--port",
            "0",
        ],
    )
    assert result.exit_code == 2
    assert "'fp16' needs a CUDA device; on the CPU use fp32 or int8" in result.output


def test_serve_with_a_slice_linux_refuses_exits_2_naming_it_and_the_fix() -> None:
    result = CliRunner().invoke(
        app,
        [
            *("workers", "serve", "--model", "image-classifier", "--region", "eu-west"),
            *("--sched-slice-us", "20"),
        ],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 2
    assert "sched_slice_us" in result.output and "(got 20.0)" in result.output
    assert "use 0 for the kernel's default" in result.output


def test_serve_unknown_model_exits_2() -> None:
    result = CliRunner().invoke(app, ["workers", "serve", "--model", "gpt", "--region", "x"])
    assert result.exit_code == 2
    assert "model 'gpt' is not built in" in result.output


def test_serve_drains_and_exits_0_on_sigterm() -> None:
    process = subprocess.Popen(
        [
            EDGEFEED,
            "workers",
            "serve",
            "--model",
            "image-classifier",
            "--region",
            "eu-west",
            "--port",
            "0",
            "--device",
            "cpu",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "COLUMNS": "300"},
    )
    try:
        assert process.stderr is not None
        line = process.stderr.readline()
        assert "serving 'image-classifier' for region 'eu-west' at http://127.0.0.1:" in line
        url = line.split(" at ", 1)[1].split()[0]
        import urllib.request

        with urllib.request.urlopen(f"{url}/readyz", timeout=10) as response:
            assert response.status == 200
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stderr is not None:
            process.stderr.close()


def test_bench_against_an_unreachable_worker_exits_1() -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    result = CliRunner().invoke(app, ["workers", "bench", "--url", url, "--requests", "2"])
    assert result.exit_code == 1
    assert "unreachable" in result.output
