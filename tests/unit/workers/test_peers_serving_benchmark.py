"""The serving peers benchmark (benchmarks/peers/serving.py) without the peers' venvs.

Its smoke run drives the edgefeed worker alone (the peer venvs are made only by
``make bench-peers-serving``); the shared closed-loop client, the agreement
check and the verdict are tested against small in-process HTTP servers.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from aiohttp import ClientSession, web
from aiohttp.test_utils import TestServer

PEERS = Path(__file__).resolve().parents[3] / "benchmarks" / "peers"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"peers_{name}", PEERS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


serving = _load("serving")  # puts benchmarks/peers on sys.path: its loadgen is the one used
loadgen = sys.modules["loadgen"]


def test_smoke_run_serves_both_models_and_reports_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    command = [sys.executable, str(PEERS / "serving.py"), "--smoke", "--servers", "edgefeed"]
    done = subprocess.run(
        [*command, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"classifier", "ranker"}
    for model, by_concurrency in report["results"].items():
        # the worker's answers were checked against the eager model before timing
        assert report["agreement_max_abs_diff"][model]["edgefeed"] <= 1e-4
        assert set(by_concurrency) == {"1", "4"}
        for cell in by_concurrency.values():
            run = cell["edgefeed"]
            assert run["errors"] == {}
            assert run["requests"] > 0 and run["throughput_rps"] > 0
            p = run["t_total_ms"]
            assert 0 < p["p50"] <= p["p95"] <= p["p99"]
            assert run["server_terms"]["t_model_ms_mean"] > 0
    # a ranking request carries 8 items: every batch holds whole requests
    ranker_rows = report["results"]["ranker"]["1"]["edgefeed"]["server_terms"]["batch_rows_mean"]
    assert ranker_rows >= serving.RANKER_ITEMS
    assert report["versions"]["edgefeed"]["torch"].startswith("2.13.0")
    assert report["versions"]["edgefeed"]["event_loop"].startswith("uvloop ")
    assert report["configs"]["edgefeed"]["ranker"]["max_batch_size_rows"] == 64


def test_run_without_peer_venvs_names_the_command_that_makes_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "nowhere"
    script = (
        "import runpy, sys; from pathlib import Path; "
        f"sys.argv = ['serving.py', '--servers', 'litserve']; "
        f"g = runpy.run_path({str(PEERS / 'serving.py')!r}, run_name='peers'); "
        f"g['VENVS']['litserve'] = Path({str(missing)!r}); g['main']()"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 1
    assert "make bench-peers-serving" in done.stderr


async def _serve(app: web.Application) -> TestServer:
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


async def test_closed_loop_counts_answers_and_errors_apart() -> None:
    seen = 0

    async def handler(request: web.Request) -> web.Response:
        nonlocal seen
        seen += 1
        body = await request.read()
        if body == b"bad":
            return web.Response(status=503)
        return web.Response(body=body, headers={"X-Edgefeed-T-Model-Ms": "0.5", "Other": "x"})

    app = web.Application()
    app.router.add_post("/infer", handler)
    server = await _serve(app)
    try:
        requests = [
            loadgen.Request("/infer", b"good", {}),
            loadgen.Request("/infer", b"bad", {}),
        ]
        async with ClientSession() as session:
            window = await loadgen.closed_loop(
                session,
                str(server.make_url("")).rstrip("/"),
                requests,
                concurrency=3,
                duration_s=0.3,
                keep_headers=lambda k: k.lower().startswith("x-edgefeed-"),
            )
    finally:
        await server.close()
    successes = len(window.latencies_s)
    assert successes + window.errors["http-503"] == seen
    assert successes > 0 and window.errors["http-503"] > 0
    assert window.headers == [{"X-Edgefeed-T-Model-Ms": "0.5"}] * successes
    summary = loadgen.summarize(loadgen.merge([window, window]))
    assert summary["requests"] == 2 * successes
    assert summary["errors"] == {"http-503": 2 * window.errors["http-503"]}


async def test_agreement_check_refuses_a_server_answering_other_scores(tmp_path: Path) -> None:
    logits = np.array([[1.0, 2.0, 3.0]], dtype=np.float32)
    answer = {"predictions": [{"top": [], "logits": (logits[0] + 0.01).tolist()}]}

    async def handler(request: web.Request) -> web.Response:
        return web.json_response(answer)

    app = web.Application()
    app.router.add_post("/v1/models/classifier/infer", handler)
    server = await _serve(app)
    case = serving.ModelCase(
        "classifier",
        "classifier",
        tmp_path / "unused.ts",
        (2, 2, 3),
        "uint8",
        (3,),
        lambda x: logits,
        [np.zeros((1, 2, 2, 3), dtype=np.uint8)],
    )
    peer = serving.Server("edgefeed", case, [], "/readyz", server.port or 0)
    try:
        async with ClientSession() as session:
            with pytest.raises(serving.PeerSetupError, match="disagrees with the reference"):
                await serving.check_agreement(session, peer, probes=1, atol=1e-4)
            # within tolerance it passes and reports the largest difference
            assert await serving.check_agreement(session, peer, 1, 0.02) == pytest.approx(0.01)
    finally:
        await server.close()


def _cell(tp: float, p95: float, errors: dict[str, int] | None = None) -> dict[str, object]:
    return {"throughput_rps": tp, "t_total_ms": {"p95": p95}, "errors": errors or {}}


def test_verdict_needs_throughput_and_p95_against_every_peer() -> None:
    results = {
        "ranker": {
            "1": {"edgefeed": _cell(100, 5), "litserve": _cell(90, 6), "triton": _cell(100, 5)},
            "8": {"edgefeed": _cell(100, 5), "litserve": _cell(120, 6), "triton": _cell(90, 4)},
        }
    }
    verdict = serving.verdict(results)
    cells = verdict["cells"]
    assert cells["ranker c=1 vs litserve"]["met"] and cells["ranker c=1 vs triton"]["met"]
    assert not cells["ranker c=8 vs litserve"]["met"]  # less throughput
    assert not cells["ranker c=8 vs triton"]["met"]  # higher p95
    assert verdict["all_met"] is False
    results["ranker"].pop("8")
    assert serving.verdict(results)["all_met"] is True
    results["ranker"]["1"]["edgefeed"]["errors"] = {"http-503": 1}
    assert serving.verdict(results)["all_met"] is False
