# ruff: noqa: E402  (sys.path is fixed before the project imports; see below)
"""Model workers vs LitServe and Triton (docs/benchmarks.md, "Model workers vs
LitServe and Triton"; issue 18 part 2).

    make bench-peers-serving                      # creates the peer venvs, then the full run
    .venv/bin/python benchmarks/peers/serving.py --smoke --servers edgefeed   # what CI runs

The same two models, the project's demo classifier and ranker with their
shipped weights, exported once to TorchScript, are served by

* edgefeed: ``edgefeed workers serve --model-file ...`` (the public CLI);
* LitServe (``.venv-litserve``), batching on (``max_batch_size``, ``batch_timeout``);
* Triton through PyTriton (``.venv-pytriton``), Triton's dynamic batcher;

each on the CPU with one torch thread, a batch of up to ``--max-rows`` rows and
a ``--delay-ms`` batching window; ``--processes N`` runs edgefeed as N worker
processes on its port (issue 35; the peers keep one instance, LitServe one
worker, Triton one model instance, as in every earlier run). Before anything
is timed, every server's answers to the same probe requests are checked against
the eager PyTorch module (same scores within float tolerance). Then one closed-loop client
(loadgen.py) drives each server at each concurrency for the same duration
after the same warm-up. All servers of a model run at once but only the one
being measured is scheduled: the others are stopped with SIGSTOP (their whole
process tree), so an idle peer's polling cannot tax the one under load; the
measured rounds rotate through the servers so that a neighbour's load on this
shared machine falls on every side.

The ranker's feature lookup (edge cache, Redis) is not part of this
comparison: the peers have no edge cache, so every server gets the user's and
the items' feature vectors in the request (one ``(items, 32)`` float32 array,
user features then item features), and the ranker is served as a tensor
model. T_data of the lookup is measured by benchmarks/lookup.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, this folder comes first on sys.path; the project root must
# be importable (the models are the project's).
_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import argparse
import asyncio
import json
import os
import platform
import signal
import tempfile
import time
from typing import Any

import aiohttp
import numpy as np
import torch
from loadgen import Window, closed_loop, merge, summarize
from servers import (
    RANKER_ITEMS,
    VENVS,
    ModelCase,
    PeerSetupError,
    Server,
    check_agreement,
    export_models,
    make_server,
    wait_ready,
)

from workers.timing import HEADER_BATCH_ROWS, HEADER_T_MODEL, HEADER_T_SERVICE

__all__ = ["ModelCase", "PeerSetupError", "Server", "check_agreement", "markdown", "verdict"]

RESULTS = _ROOT / "benchmarks" / "results"
SERVERS = ("edgefeed", "litserve", "triton")


# -- the run ----------------------------------------------------------------


def _edgefeed_terms(windows: list[Window]) -> dict[str, float]:
    """Mean T_model, T_service and batch rows from edgefeed's answer headers."""
    headers = [h for w in windows for h in w.headers]
    if not headers:
        return {}

    def mean(key: str) -> float:
        return round(float(np.mean([float(h[key]) for h in headers if key in h])), 3)

    return {
        "t_model_ms_mean": mean(HEADER_T_MODEL),
        "t_service_ms_mean": mean(HEADER_T_SERVICE),
        "batch_rows_mean": mean(HEADER_BATCH_ROWS),
    }


async def _triton_stats(session: aiohttp.ClientSession, server: Server) -> dict[str, Any]:
    async with session.get(f"{server.url}/v2/models/{server.case.name}/stats") as response:
        stats: dict[str, Any] = (await response.json())["model_stats"][0]
        return stats


def _triton_terms(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """Mean queue and compute time per request, and rows per execution, between two snapshots."""
    out: dict[str, float] = {}
    b, a = before["inference_stats"], after["inference_stats"]
    count = a["success"]["count"] - b["success"]["count"]
    if count <= 0:
        return out
    for key in ("queue", "compute_input", "compute_infer", "compute_output"):
        out[f"{key}_ms_mean"] = round((a[key]["ns"] - b[key]["ns"]) / count / 1e6, 3)
    executions = after["execution_count"] - before["execution_count"]
    rows = after["inference_count"] - before["inference_count"]
    if executions > 0:
        out["batch_rows_mean"] = round(rows / executions, 2)
    return out


async def measure(
    session: aiohttp.ClientSession,
    servers: list[Server],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Every concurrency, rounds rotating through the servers; only the measured one runs."""
    results: dict[str, Any] = {}
    for server in servers:
        server.signal_tree(signal.SIGSTOP)
    try:
        for concurrency in args.concurrency:
            windows: dict[str, list[Window]] = {s.kind: [] for s in servers}
            terms: dict[str, list[dict[str, float]]] = {s.kind: [] for s in servers}
            for round_ in range(args.rounds):
                order = servers[round_ % len(servers) :] + servers[: round_ % len(servers)]
                for server in order:
                    server.signal_tree(signal.SIGCONT)
                    requests = [server.request(a) for a in server.case.arrays]
                    try:
                        await closed_loop(
                            session,
                            server.url,
                            requests,
                            concurrency=concurrency,
                            duration_s=args.warmup_s,
                        )
                        before = (
                            await _triton_stats(session, server)
                            if server.kind == "triton"
                            else None
                        )
                        window = await closed_loop(
                            session,
                            server.url,
                            requests,
                            concurrency=concurrency,
                            duration_s=args.duration_s,
                            keep_headers=(
                                (
                                    lambda k: (
                                        k.lower().startswith("x-edgefeed-t-")
                                        or k.lower() == HEADER_BATCH_ROWS.lower()
                                    )
                                )
                                if server.kind == "edgefeed"
                                else None
                            ),
                        )
                        if before is not None:
                            terms[server.kind].append(
                                _triton_terms(before, await _triton_stats(session, server))
                            )
                    finally:
                        server.signal_tree(signal.SIGSTOP)
                    windows[server.kind].append(window)
            cell: dict[str, Any] = {}
            for server in servers:
                summary = summarize(merge(windows[server.kind]))
                if server.kind == "edgefeed":
                    summary["server_terms"] = _edgefeed_terms(windows[server.kind])
                elif terms[server.kind]:
                    summary["server_terms"] = {
                        k: round(float(np.mean([t[k] for t in terms[server.kind] if k in t])), 3)
                        for k in terms[server.kind][0]
                    }
                cell[server.kind] = summary
                p = summary["t_total_ms"]
                assert isinstance(p, dict)
                print(
                    f"  {server.case.name:10s} c={concurrency:<3d} {server.kind:9s}"
                    f"{summary['throughput_rps']:9.1f} req/s  p50 {p['p50']:8.2f}  p95 "
                    f"{p['p95']:8.2f}  p99 {p['p99']:8.2f} ms  errors {summary['errors']}",
                    flush=True,
                )
            results[str(concurrency)] = cell
    finally:
        for server in servers:
            server.signal_tree(signal.SIGCONT)
    return results


def verdict(results: dict[str, Any]) -> dict[str, Any]:
    """Per model, concurrency, peer: edgefeed's throughput >= the peer's at a p95 <= theirs."""
    out: dict[str, Any] = {}
    met_all = True
    for model, by_concurrency in results.items():
        for concurrency, cell in by_concurrency.items():
            ours = cell.get("edgefeed")
            if ours is None:
                continue
            for peer, theirs in cell.items():
                if peer == "edgefeed":
                    continue
                tp = (
                    ours["throughput_rps"] / theirs["throughput_rps"]
                    if theirs["throughput_rps"]
                    else float("inf")
                )
                p95 = ours["t_total_ms"]["p95"] / theirs["t_total_ms"]["p95"]
                met = tp >= 1.0 and p95 <= 1.0 and not ours["errors"]
                met_all &= met
                out[f"{model} c={concurrency} vs {peer}"] = {
                    "throughput_ratio": round(tp, 3),
                    "p95_ratio": round(p95, 3),
                    "met": met,
                }
    return {"cells": out, "all_met": met_all and bool(out)}


def markdown(report: dict[str, Any]) -> str:
    """The report's tables as docs/benchmarks.md quotes them."""
    lines = []
    for model, by_concurrency in report["results"].items():
        lines += [
            f"**{model}** ({report['rows_per_request'][model]} row(s) per request):",
            "",
            "| concurrency | server | throughput (req/s) | T_total p50 | p95 | p99 (ms) "
            "| server-side terms (means, ms) |",
            "|---|---|---|---|---|---|---|",
        ]
        for concurrency, cell in by_concurrency.items():
            for kind, run in cell.items():
                p = run["t_total_ms"]
                terms = ", ".join(f"{k} {v}" for k, v in run.get("server_terms", {}).items())
                errors = f" errors {run['errors']}" if run["errors"] else ""
                lines.append(
                    f"| {concurrency} | {kind} | {run['throughput_rps']:.1f}{errors} "
                    f"| {p['p50']:.2f} | {p['p95']:.2f} | {p['p99']:.2f} | {terms or '-'} |"
                )
        lines.append("")
    lines += ["| cell | throughput ratio | p95 ratio | target |", "|---|---|---|---|"]
    for name, cell in report["verdict"]["cells"].items():
        target = "met" if cell["met"] else "**missed**"
        lines.append(
            f"| {name} | {cell['throughput_ratio']:.2f}x | {cell['p95_ratio']:.2f}x | {target} |"
        )
    return "\n".join(lines)


def _edgefeed_loop() -> str:
    from importlib.metadata import version

    from workers.server import event_loop_name

    name = event_loop_name("auto")
    return f"uvloop {version('uvloop')}" if name == "uvloop" else name


def _peer_versions(kind: str) -> dict[str, str]:
    freeze = VENVS[kind] / "freeze.txt"
    if not freeze.exists():
        return {}
    wanted = {
        "litserve": ("litserve", "torch", "fastapi", "uvicorn", "uvloop", "numpy"),
        "triton": ("nvidia-pytriton", "tritonclient", "torch", "numpy"),
    }[kind]
    versions = {}
    for line in freeze.read_text().splitlines():
        name, _, version = line.partition("==")
        if name.lower() in wanted:
            versions[name.lower()] = version
    return versions


async def run(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    cases = export_models(folder)
    report: dict[str, Any] = {"versions": {}, "configs": {}, "agreement_max_abs_diff": {}}
    import aiohttp as _aiohttp

    import edgefeed

    report["versions"]["edgefeed"] = {
        "edgefeed": edgefeed.__version__,
        "torch": torch.__version__,
        "aiohttp": _aiohttp.__version__,
        "numpy": np.__version__,
        # the worker's loop (event_loop: auto): uvloop and its version when installed
        "event_loop": _edgefeed_loop(),
    }
    for kind in args.servers:
        if kind != "edgefeed":
            report["versions"][kind] = _peer_versions(kind)
    results: dict[str, Any] = {}
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as session:
        for model in args.models:
            case = cases[model]
            servers = [make_server(kind, case, args) for kind in args.servers]
            try:
                for server in servers:
                    server.start(folder)
                for server in servers:
                    await wait_ready(session, server, args.start_timeout_s)
                    report["configs"].setdefault(server.kind, {})[model] = server.config
                    diff = await check_agreement(session, server, args.probes, args.atol)
                    report["agreement_max_abs_diff"].setdefault(model, {})[server.kind] = diff
                    if server.kind == "triton":
                        async with session.get(f"{server.url}/v2") as response:
                            meta = await response.json()
                        report["versions"]["triton"]["tritonserver"] = meta.get("version", "?")
                print(
                    f"{model}: outputs agree with the eager model "
                    f"(max |diff| {report['agreement_max_abs_diff'][model]})",
                    flush=True,
                )
                results[model] = await measure(session, servers, args)
            finally:
                for server in servers:
                    server.stop()
    report["results"] = results
    report["verdict"] = verdict(results)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description="model workers vs LitServe and Triton")
    parser.add_argument("--servers", nargs="+", default=list(SERVERS), choices=SERVERS)
    parser.add_argument("--models", nargs="+", default=["classifier", "ranker"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--duration-s", type=float, default=5.0, help="measured seconds per window")
    parser.add_argument(
        "--warmup-s", type=float, default=1.5, help="unmeasured seconds before each"
    )
    parser.add_argument("--rounds", type=int, default=3, help="windows per server per cell")
    parser.add_argument("--max-rows", type=int, default=64, help="rows per forward pass")
    parser.add_argument("--delay-ms", type=float, default=2.0, help="batching window")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per server")
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="edgefeed worker processes on the port (edgefeed workers serve --processes); "
        "the peers keep their one instance",
    )
    parser.add_argument("--probes", type=int, default=32, help="agreement-check requests")
    parser.add_argument("--atol", type=float, default=1e-4)
    parser.add_argument("--start-timeout-s", type=float, default=180.0)
    parser.add_argument("--smoke", action="store_true", help="tiny run (seconds)")
    parser.add_argument("--out", type=Path, default=None, help="report path (JSON)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument(
        "--render", type=Path, default=None, help="print a saved report's tables (markdown)"
    )
    args = parser.parse_args()
    if args.render is not None:
        print(markdown(json.loads(args.render.read_text())))
        return
    if args.smoke:
        args.concurrency, args.duration_s, args.warmup_s, args.rounds = [1, 4], 0.5, 0.2, 1
        args.probes = 4
    missing = [
        k for k in args.servers if k != "edgefeed" and not (VENVS[k] / "bin" / "python").exists()
    ]
    if missing:
        sys.exit(
            f"no venv for {', '.join(missing)}: run `make bench-peers-serving` (or "
            "bash benchmarks/peers/setup.sh) first"
        )
    started = time.perf_counter()
    header = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        },
        "parameters": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "rows_per_request": {"classifier": 1, "ranker": RANKER_ITEMS},
    }
    with tempfile.TemporaryDirectory(prefix="edgefeed-peers-serving-") as tmp:
        try:
            report = {**header, **asyncio.run(run(args, Path(tmp)))}
        except PeerSetupError as exc:
            sys.exit(f"setup failed: {exc}")
    report["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    report["elapsed_s"] = round(time.perf_counter() - started, 1)
    for name, cell in report["verdict"]["cells"].items():
        print(
            f"  {name}: throughput x{cell['throughput_ratio']}, p95 x{cell['p95_ratio']} "
            f"-> {'met' if cell['met'] else 'MISSED'}"
        )
    stamp = time.strftime("%Y%m%dT%H%M%S") + ("-smoke" if args.smoke else "")
    path = args.out or RESULTS / f"peers-serving-{stamp}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    print(f"done in {report['elapsed_s']} s; full report: {path}")
    if args.strict and not args.smoke and not report["verdict"]["all_met"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
