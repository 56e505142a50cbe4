# ruff: noqa: E402  (sys.path is fixed before the imports; see below)
"""Serving overhead of the ranker (issue 18 part 3): T_service, before and after, one run.

    .venv/bin/python benchmarks/serving.py                       # ~1 min
    .venv/bin/python benchmarks/serving.py --baseline-ref main   # the tree to compare with
    .venv/bin/python benchmarks/serving.py --smoke               # seconds; the test suite runs it
    .venv/bin/python benchmarks/serving.py --rate 600            # the same 8 clients, paced
    .venv/bin/python benchmarks/serving.py --processes 2         # 'after' on 2 processes
    .venv/bin/python benchmarks/serving.py --baseline-ref '' --feature-log  # logging's cost

What it runs, all on loopback:

* one redis-server on a free port (the region's edge cache), seeded with the
  demo ranker's users and items by ``edgefeed workers seed-demo``;
* two ranker workers, each started through the public CLI
  (``edgefeed workers serve --model ranker``), one from this tree ("after")
  and one from ``--baseline-ref`` extracted with ``git archive`` into a
  temporary folder ("before"; skipped with ``--baseline-ref ''``);
* a closed loop of ``--concurrency`` clients (8, as ``make demo``) sending
  ranking requests of 20 candidates, rounds alternating between the two
  workers so a neighbour's burst on this shared machine falls on both;
  with ``--rate R`` the clients are paced to R requests/s in all (still at
  most ``--concurrency`` in flight), to read T_service below saturation;
* with ``--feature-log``, a third worker from this tree ("logged") that logs
  every request it serves (``workers.feature_log`` at ``sample_rate: 1``) to
  Parquet in the temporary folder, in the same alternating rounds: the ratio
  logged/after is what logging costs (issue 32: T_service p50 within 10%).

It reports T_service, T_data, T_model and T_total p50/p95/p99 per worker (from
the response headers, as every client sees them), the ratios after/before, and
the after-worker's T_service broken down by phase (from its
``edgefeed_worker_phase_seconds`` histograms and its per-response
``Server-Timing`` detail). Target: T_service p50 < 1 ms and p99 < 5 ms.
"""

from __future__ import annotations

import sys
from pathlib import Path

# benchmarks/workers.py is named like the package measured; run as a script,
# this folder comes first on sys.path and would shadow the package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import redis
from prometheus_client.parser import text_string_to_metric_families

from workers.bench import LoadResult, closed_loop
from workers.client import InferenceAnswer, WorkerClient
from workers.synthetic import click_world
from workers.timing import HEADER_TIMING_DETAIL

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results"
REGION = "bench"
_CLI = "import sys; from edgefeed.cli import main; sys.exit(main())"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def redis_server(workdir: Path) -> Iterator[str]:
    """A throwaway redis-server on a free loopback port."""
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    port = _free_port()
    process = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        client = redis.Redis(port=port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.02)
        client.close()
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        process.wait(timeout=10)


class Worker:
    """``edgefeed workers serve --model ranker`` from source tree ``tree``, stopped by SIGTERM."""

    def __init__(
        self, name: str, tree: Path, settings: Path, extra: list[str], env: dict[str, str]
    ) -> None:
        self.settings = settings
        self.name = name
        env = {**os.environ, "PYTHONPATH": str(tree), "COLUMNS": "300", **env}
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _CLI,
                "--settings",
                str(settings),
                "workers",
                "serve",
                "--model",
                "ranker",
                "--region",
                REGION,
                "--port",
                "0",
                "--device",
                "cpu",
                *extra,
            ],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env=env,
            cwd=tree,
        )
        if self.process.stderr is None:
            raise RuntimeError("no pipe to the worker")
        lines: list[str] = []
        try:
            for line in self.process.stderr:
                lines.append(line)
                if " at http" in line:
                    break
            else:
                raise RuntimeError(f"{name} worker did not start:\n{''.join(lines)[-3000:]}")
        except BaseException:  # SIGTERM or Ctrl-C while it starts: stop it too
            self.close()
            raise
        self.url = line.split(" at ", 1)[1].split()[0]
        self._pump = threading.Thread(target=self.process.stderr.read, daemon=True)
        self._pump.start()

    def cpu_s(self) -> float:
        """User + system CPU seconds the worker has used: all threads of its process
        and of its living children (``--processes N``)."""
        total = 0.0
        todo = [self.process.pid]
        while todo:
            pid = todo.pop()
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            except OSError:  # gone meanwhile
                continue
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            todo += [int(kid) for kid in kids]
        return total

    def sched(self) -> dict[str, float]:
        """The scheduler's account of the worker's threads (all processes, Linux):
        ``cpu_s`` on a core, ``wait_s`` runnable but waiting for one (run-queue
        delay: what a CPU hog beside it costs), ``preempted`` involuntary context
        switches; ``loop_*`` the same for each process's main (event-loop) thread."""
        out = dict.fromkeys(
            ("cpu_s", "wait_s", "preempted", "loop_cpu_s", "loop_wait_s", "loop_preempted"), 0.0
        )
        todo = [self.process.pid]
        while todo:
            pid = todo.pop()
            try:
                kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
                tasks = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
            except OSError:  # gone meanwhile
                continue
            todo += [int(kid) for kid in kids]
            for tid in tasks:
                try:
                    on, wait = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[:2]
                    status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
                except OSError:
                    continue
                preempted = float(status.rsplit("nonvoluntary_ctxt_switches:", 1)[1].split()[0])
                values = (int(on) / 1e9, int(wait) / 1e9, preempted)
                for key, value in zip(("cpu_s", "wait_s", "preempted"), values, strict=True):
                    out[key] += value
                    if tid == pid:
                        out[f"loop_{key}"] += value
        return out

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as response:
            text: str = response.read().decode()
            return text

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


async def _load(
    url: str, concurrency: int, requests: int, detail: bool, rate: float | None = None
) -> LoadResult:
    world = click_world()
    headers = {HEADER_TIMING_DETAIL: "1"} if detail else None

    async def send(client: WorkerClient, n: int) -> InferenceAnswer:
        user = world.user_ids[n % len(world.user_ids)]
        start = (n * 7) % (len(world.item_ids) - 20)
        body = json.dumps(
            {"user_id": user, "item_ids": list(world.item_ids[start : start + 20])}
        ).encode()
        return await client.infer("ranker", body, "application/json", headers=headers)

    async with WorkerClient(url) as client:
        return await closed_loop(
            client,
            send,
            concurrency=concurrency,
            requests=requests,
            warmup_requests=concurrency,
            rate=rate,
        )


def _merge(parts: list[LoadResult]) -> LoadResult:
    return LoadResult(
        concurrency=parts[0].concurrency,
        elapsed_s=sum(p.elapsed_s for p in parts),
        latencies=tuple(x for p in parts for x in p.latencies),
        batch_rows=tuple(x for p in parts for x in p.batch_rows),
        errors={k: sum(p.errors.get(k, 0) for p in parts) for p in parts for k in p.errors},
        details=tuple(x for p in parts for x in p.details),
    )


def _phases(text: str) -> dict[str, dict[str, float]]:
    """p50/p99 per phase from the worker's phase histograms (bucket interpolation)."""
    buckets: dict[str, list[tuple[float, float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "edgefeed_worker_phase_seconds_bucket":
                le = float(sample.labels["le"])
                buckets.setdefault(sample.labels["phase"], []).append((le, sample.value))
    out: dict[str, dict[str, float]] = {}
    for phase, points in buckets.items():
        points.sort()
        total = points[-1][1]
        if not total:
            continue
        out[phase] = {}
        for q in (50, 99):
            rank, previous_le, previous_count = total * q / 100, 0.0, 0.0
            for le, count in points:
                if count >= rank:
                    if le == float("inf"):
                        value = previous_le
                    else:
                        share = (rank - previous_count) / max(count - previous_count, 1e-12)
                        value = previous_le + (le - previous_le) * share
                    out[phase][f"p{q}"] = round(value * 1e3, 3)
                    break
                previous_le, previous_count = le, count
    return out


def _detail(result: LoadResult) -> dict[str, dict[str, float]]:
    """p50/p99 per phase from the responses' Server-Timing detail (exact, client side)."""
    phases: dict[str, list[float]] = {}
    for entry in result.details:
        for phase, ms in entry.items():
            phases.setdefault(phase, []).append(ms)
    return {
        phase: {f"p{q}": round(float(np.percentile(v, q)), 3) for q in (50, 99)}
        for phase, v in phases.items()
    }


def _logged_rows(folder: Path) -> int:
    """Rows in the complete log files under ``folder`` (every request's items)."""
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(path).metadata.num_rows for path in folder.rglob("*.parquet"))


def _extract(ref: str, into: Path) -> None:
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", ref], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)


def _one_process(tree: Path) -> list[str]:
    """``--processes 1`` where ``tree``'s CLI has the option (older trees are one process)."""
    cli = (tree / "edgefeed" / "cli" / "workers.py").read_text()
    return ["--processes", "1"] if "--processes" in cli or "processes:" in cli else []


def main() -> None:
    parser = argparse.ArgumentParser(description="ranker serving overhead, before and after")
    parser.add_argument("--smoke", action="store_true", help="tiny run (seconds)")
    parser.add_argument("--baseline-ref", default="main", help="git ref of 'before' ('': none)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=1500, help="measured per round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument(
        "--rate",
        type=float,
        default=None,
        help="pace the clients to this many requests/s (default: closed loop, as fast as answered)",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="worker processes of the 'after' worker (edgefeed workers serve --processes); "
        "'before' runs one process",
    )
    parser.add_argument(
        "--feature-log",
        action="store_true",
        help="also run a worker of this tree logging every request (workers.feature_log, "
        "sample_rate 1), alternating with 'after'",
    )
    parser.add_argument("--out", type=Path, default=None, help="report path (JSON)")
    args = parser.parse_args()
    if args.rate is not None and not args.rate > 0:
        parser.error(f"--rate {args.rate} must be a positive number of requests per second")
    # SIGTERM (a timeout, CI) unwinds like Ctrl-C: workers, redis-server and files go.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.smoke:
        args.requests, args.rounds = 60, 1
    started = time.perf_counter()
    report: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "load_average_at_start": os.getloadavg(),
        },
        "parameters": {k: str(v) for k, v in vars(args).items()},
    }
    with tempfile.TemporaryDirectory(prefix="edgefeed-bench-serving-") as tmp:
        work = Path(tmp)
        with redis_server(work) as redis_url:
            settings = work / "edgefeed.yaml"
            settings.write_text(
                f"regions:\n  - {{name: {REGION}, redis_url: '{redis_url}', residency_zone: eu}}\n"
            )
            subprocess.run(
                [
                    sys.executable,
                    "-c",
                    _CLI,
                    "--settings",
                    str(settings),
                    "workers",
                    "seed-demo",
                    "--region",
                    REGION,
                ],
                check=True,
                capture_output=True,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )
            variants: dict[str, tuple[Path, list[str]]] = {}
            if args.baseline_ref:
                before = work / "before"
                before.mkdir()
                _extract(args.baseline_ref, before)
                variants["before"] = (before, _one_process(before))
            variants["after"] = (ROOT, ["--processes", str(args.processes)])
            logs = work / "feature-logs"
            logged_settings = work / "edgefeed-logged.yaml"
            if args.feature_log:
                logged_settings.write_text(
                    settings.read_text()
                    + f"workers:\n  feature_log: {{dir: '{logs}', sample_rate: 1.0}}\n"
                )
                variants["logged"] = (ROOT, ["--processes", str(args.processes)])
            workers: dict[str, Worker] = {}
            parts: dict[str, list[LoadResult]] = {name: [] for name in variants}
            cpu: dict[str, float] = dict.fromkeys(variants, 0.0)
            sched: dict[str, dict[str, float]] = {name: {} for name in variants}
            for name in variants:
                sched[name] = dict.fromkeys(
                    ("cpu_s", "wait_s", "preempted", "loop_cpu_s", "loop_wait_s", "loop_preempted"),
                    0.0,
                )
            try:
                for name, (tree, extra) in variants.items():
                    chosen = logged_settings if name == "logged" else settings
                    workers[name] = Worker(name, tree, chosen, extra, {})
                for round_ in range(args.rounds):
                    # ABBA: every other round in reverse, so that neither worker is
                    # always the one measured right after the other.
                    order = list(workers.items())
                    for name, worker in order if round_ % 2 == 0 else order[::-1]:
                        used = worker.cpu_s()
                        sched_before = worker.sched()
                        result = asyncio.run(
                            _load(
                                worker.url,
                                args.concurrency,
                                args.requests,
                                name != "before",
                                args.rate,
                            )
                        )
                        cpu[name] += worker.cpu_s() - used
                        for key, value in worker.sched().items():
                            sched[name][key] += value - sched_before[key]
                        parts[name].append(result)
                phase_text = workers["after"].metrics_text()
            finally:
                for worker in workers.values():
                    worker.close()
            if args.feature_log:
                report["feature_log_rows"] = _logged_rows(logs)
    runs: dict[str, Any] = {}
    for name in variants:
        merged = _merge(parts[name])
        runs[name] = merged.summary()
        # CPU per request counts warm-up requests too (each round sends `concurrency`).
        sent = len(merged.latencies) + args.rounds * args.concurrency
        runs[name]["worker_cpu_us_per_request"] = round(cpu[name] / sent * 1e6, 1)
        # Per request, from the scheduler: time on a core, time runnable but waiting
        # for one, and preemptions; the event-loop threads' share apart.
        runs[name]["scheduler_per_request"] = {
            "cpu_us": round(sched[name]["cpu_s"] / sent * 1e6, 1),
            "runqueue_wait_us": round(sched[name]["wait_s"] / sent * 1e6, 1),
            "preemptions": round(sched[name]["preempted"] / sent, 3),
            "loop_cpu_us": round(sched[name]["loop_cpu_s"] / sent * 1e6, 1),
            "loop_runqueue_wait_us": round(sched[name]["loop_wait_s"] / sent * 1e6, 1),
            "loop_preemptions": round(sched[name]["loop_preempted"] / sent, 3),
        }
        runs[name]["t_service_p50_by_round_ms"] = [
            part.summary()["latency_ms"]["service"]["p50"] for part in parts[name]
        ]
        lat = runs[name]["latency_ms"]
        print(
            f"  {name:6s} {merged.throughput:7.1f} req/s  T_service p50 "
            f"{lat['service']['p50']:6.2f} p95 {lat['service']['p95']:6.2f} p99 "
            f"{lat['service']['p99']:6.2f} ms | T_total p50 {lat['total']['p50']:6.2f} p99 "
            f"{lat['total']['p99']:6.2f} ms | mean batch {runs[name]['mean_batch_rows']} | "
            f"worker CPU {runs[name]['worker_cpu_us_per_request']:.0f} us/request",
            flush=True,
        )
        per = runs[name]["scheduler_per_request"]
        print(
            f"         per request: on a core {per['cpu_us']:.0f} us, waiting for one "
            f"{per['runqueue_wait_us']:.0f} us, {per['preemptions']:.2f} preemptions "
            f"(event loop: {per['loop_cpu_us']:.0f} us, {per['loop_runqueue_wait_us']:.0f} us, "
            f"{per['loop_preemptions']:.2f})",
            flush=True,
        )
        if name != "before":
            runs[name]["phases_from_headers_ms"] = _detail(merged)
    report["runs"] = runs
    report["phases_from_metrics_ms"] = _phases(phase_text)
    print(f"  after, T_service by phase (ms, headers): {runs['after']['phases_from_headers_ms']}")
    after = runs["after"]["latency_ms"]["service"]
    report["target_met"] = after["p50"] < 1.0 and after["p99"] < 5.0
    if "before" in runs:
        before_s = runs["before"]["latency_ms"]["service"]
        report["ratios_after_over_before"] = {
            q: round(after[q] / before_s[q], 3) if before_s[q] else None
            for q in ("p50", "p95", "p99")
        }
        print(f"  T_service after/before: {report['ratios_after_over_before']}")
    if "logged" in runs:
        plain = runs["after"]["latency_ms"]["service"]
        logged = runs["logged"]["latency_ms"]["service"]
        report["ratios_logged_over_after"] = {
            q: round(logged[q] / plain[q], 3) if plain[q] else None for q in ("p50", "p95", "p99")
        }
        # Round by round (each logged round right after an unlogged one): the spread
        # says how much of the ratio is the machine's noise.
        report["t_service_p50_ratio_by_round"] = [
            round(x / y, 3) if y else None
            for x, y in zip(
                runs["logged"]["t_service_p50_by_round_ms"],
                runs["after"]["t_service_p50_by_round_ms"],
                strict=True,
            )
        ]
        sent = args.rounds * (args.requests + args.concurrency)
        print(
            f"  T_service logged/after: {report['ratios_logged_over_after']} "
            f"(budget: p50 <= 1.10); {report['feature_log_rows']} rows logged "
            f"of {sent} requests x 20 items"
        )
        print(f"  T_service p50 logged/after by round: {report['t_service_p50_ratio_by_round']}")
    offered = f"paced to {args.rate:g} req/s" if args.rate else "closed loop, unpaced"
    print(
        f"  target (T_service p50 < 1 ms, p99 < 5 ms; {offered}): "
        f"{'met' if report['target_met'] else 'MISSED'}"
    )
    report["load_average_at_end"] = os.getloadavg()
    report["elapsed_s"] = round(time.perf_counter() - started, 1)
    stamp = time.strftime("%Y%m%dT%H%M%S") + ("-smoke" if args.smoke else "")
    path = args.out or RESULTS / f"serving-{stamp}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    print(f"done in {report['elapsed_s']} s; full report: {path}")


if __name__ == "__main__":
    main()
