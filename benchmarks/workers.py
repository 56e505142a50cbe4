# ruff: noqa: E402  (sys.path is fixed before the imports; see below)
"""Benchmark of the model workers (docs/benchmarks.md, "Model workers").

    .venv/bin/python benchmarks/workers.py            # full run, CPU: about a minute
    .venv/bin/python benchmarks/workers.py --smoke    # seconds; what the test suite runs

Measures, in one run, against baselines of the same run:

1. Dynamic batching against batch size 1: throughput and p50/p95/p99 of
   T_total under closed-loop load (``--concurrency`` clients, each sending its
   next request when the previous answer arrives), the worker in its own
   process so the load generator does not share its interpreter. Target:
   >= 3.5x throughput at <= 1.2x p95.
2. Reduced precision against fp32: on the CPU int8 dynamic quantization, on
   CUDA fp16: forward latency at batch 1 and at the full batch, and accuracy on
   a held-out set (the trained demo classifier and ranker).

The benchmark model is the classifier architecture with a wide dense head
(``--hidden``, default 3 x 4096, ~34 M parameters): like BERT-base's dense
layers, its weights are too large for the caches, so at batch 1 each request
streams all of them from memory: that is the cost dynamic batching shares. Its
weights are random (latency does not depend on their values); accuracy is
measured on the trained demo weights.

On a CUDA machine the same command runs unchanged: the worker uses fp16 on the
GPU and part 2 compares fp16 with fp32.
"""

from __future__ import annotations

import sys
from pathlib import Path

# This file is named like the package it measures; run as a script, its folder
# comes first on sys.path and would shadow the package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import argparse
import asyncio
import json
import os
import platform
import subprocess
import time
from typing import Any

import numpy as np
import torch

from workers.batcher import BatchingConfig
from workers.bench import LoadResult, closed_loop
from workers.client import InferenceAnswer, WorkerClient
from workers.models import ClassifierConfig, ImageClassifier, ImageClassifierNet
from workers.models.loading import load_served_model
from workers.runtime import ModelRunner, RuntimeConfig
from workers.server import InferenceServer, ServerConfig
from workers.synthetic import shape_images

RESULTS = Path(__file__).parent / "results"


# -- the worker process ---------------------------------------------------


def _child(spec: dict[str, Any]) -> None:
    """Serve the benchmark model; print the port; stop at EOF on stdin."""
    torch.manual_seed(0)
    config = ClassifierConfig(hidden=tuple(spec["hidden"]))
    module = ImageClassifierNet(config).eval()
    model = ImageClassifier(
        "bench", module, [str(i) for i in range(config.num_classes)], config.image_size
    )

    async def main() -> None:
        server = InferenceServer(
            [model],
            runtime=RuntimeConfig(
                device=spec["device"],
                precision=spec["precision"],
                compile=spec["compile"],
                cpu_threads=spec["threads"],
            ),
            batching=BatchingConfig(
                max_batch_size=spec["max_batch"],
                max_queue_delay_s=spec["delay_ms"] / 1e3,
                max_queue_size=4096,
            ),
            config=ServerConfig(port=0),
        )
        await server.start()
        print(f"PORT {server.port}", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await server.stop()

    asyncio.run(main())


class WorkerProcess:
    """The benchmark worker in a subprocess (stopped by closing its stdin)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--child", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        if self.process.stdout is None:
            raise RuntimeError("no pipe to the benchmark worker")
        line = self.process.stdout.readline()
        if not line.startswith("PORT "):
            self.close()
            raise RuntimeError(f"benchmark worker failed to start: {line!r}")
        self.url = f"http://127.0.0.1:{int(line.split()[1])}"

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> WorkerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- part 1: dynamic batching against batch size 1 -------------------------


async def _load(url: str, concurrency: int, requests: int) -> LoadResult:
    images, _ = shape_images(64, 32, seed=7)

    async def send(client: WorkerClient, n: int) -> InferenceAnswer:
        return await client.classify("bench", images[n % len(images)])

    async with WorkerClient(url) as client:
        return await closed_loop(
            client,
            send,
            concurrency=concurrency,
            requests=requests,
            warmup_requests=2 * concurrency,
        )


def _spec(args: argparse.Namespace, device: str, precision: str, max_batch: int) -> dict[str, Any]:
    return {
        "hidden": args.hidden,
        "device": device,
        "precision": precision,
        "compile": args.compile,
        "threads": args.cpu_threads,
        "max_batch": max_batch,
        "delay_ms": args.delay_ms,
    }


def _merge(parts: list[LoadResult]) -> LoadResult:
    """One result from rounds run at different times (throughput = all requests / all time)."""
    return LoadResult(
        concurrency=parts[0].concurrency,
        elapsed_s=sum(part.elapsed_s for part in parts),
        latencies=tuple(item for part in parts for item in part.latencies),
        batch_rows=tuple(rows for part in parts for rows in part.batch_rows),
        errors={
            kind: sum(part.errors.get(kind, 0) for part in parts)
            for kind in {kind for part in parts for kind in part.errors}
        },
    )


def batching(args: argparse.Namespace, device: str, precision: str) -> dict[str, Any]:
    """Closed-loop load on batch size 1 and on dynamic batching; then a lone client on each.

    Both workers run side by side (an idle one costs no CPU) and the measured
    rounds alternate between them, so a neighbour's load on this shared
    machine falls on both sides of the comparison rather than on one.
    """
    modes = {"batch-1": 1, "dynamic": args.max_batch}
    requests = {
        "batch-1": max(args.concurrency * 2, args.requests // 4) // args.rounds,
        "dynamic": args.requests // args.rounds,
    }
    parts: dict[str, list[LoadResult]] = {name: [] for name in modes}
    alone: dict[str, LoadResult] = {}
    workers: dict[str, WorkerProcess] = {}
    try:
        for name, size in modes.items():
            workers[name] = WorkerProcess(_spec(args, device, precision, size))
        for _ in range(args.rounds):
            for name, worker in workers.items():
                parts[name].append(asyncio.run(_load(worker.url, args.concurrency, requests[name])))
        for name, worker in workers.items():
            # What the batching window costs when there is no load: one client alone.
            alone[name] = asyncio.run(_load(worker.url, 1, args.unloaded_requests))
    finally:
        for worker in workers.values():
            worker.close()
    results: dict[str, Any] = {}
    unloaded: dict[str, Any] = {}
    for name in modes:
        result = _merge(parts[name])
        results[name] = result.summary()
        unloaded[name] = {
            f"p{q}": round(alone[name].percentile_ms("total", q), 3) for q in (50, 95)
        }
        print(
            f"  {name:8s} {result.throughput:8.1f} req/s  p50 "
            f"{result.percentile_ms('total', 50):7.2f} ms  p95 "
            f"{result.percentile_ms('total', 95):7.2f} ms  mean batch "
            f"{results[name]['mean_batch_rows']}  | alone: p50 {unloaded[name]['p50']:.2f} ms",
            flush=True,
        )
    base, dyn = results["batch-1"], results["dynamic"]
    ratio_tp = dyn["throughput_rps"] / base["throughput_rps"]
    ratio_p95 = dyn["latency_ms"]["total"]["p95"] / base["latency_ms"]["total"]["p95"]
    return {
        "runs": results,
        "unloaded": unloaded,
        "rounds": args.rounds,
        "throughput_ratio": round(ratio_tp, 2),
        "p95_ratio": round(ratio_p95, 3),
        "target_met": ratio_tp >= 3.5 and ratio_p95 <= 1.2,
    }


# -- part 2: reduced precision against fp32 ---------------------------------


def _forward_ms(runner: ModelRunner, inputs: tuple[np.ndarray, ...], repeats: int) -> float:
    runner.execute([inputs])
    times = [runner.execute([inputs])[1] for _ in range(repeats)]
    return float(np.median(times) * 1e3)


def _runner(
    module: torch.nn.Module, device: str, precision: str, max_rows: int, threads: int | None
) -> ModelRunner:
    return ModelRunner(
        module,
        RuntimeConfig(
            device=device,
            precision=precision,
            compile="off",
            max_batch_rows=max_rows,
            cpu_threads=threads,
        ),
    )


def _predict(runner: ModelRunner, inputs: tuple[np.ndarray, ...], batch: int) -> np.ndarray:
    rows = inputs[0].shape[0]
    chunks = [tuple(array[i : i + batch] for array in inputs) for i in range(0, rows, batch)]
    return np.concatenate([runner.execute([chunk])[0][0] for chunk in chunks])


def precision_comparison(args: argparse.Namespace, device: str) -> dict[str, Any]:
    from workers.synthetic import click_world
    from workers.train_demo import HELD_OUT_SEED, auc

    reduced = "fp16" if device.startswith("cuda") else "int8"
    out: dict[str, Any] = {"reduced": reduced, "latency_ms": {}, "accuracy": {}}
    torch.manual_seed(0)
    wide = ImageClassifierNet(ClassifierConfig(hidden=tuple(args.hidden))).eval()
    demo = load_served_model("image-classifier")
    ranker = load_served_model("ranker", features=_NoFeatures())
    images, labels = shape_images(args.held_out, 32, seed=HELD_OUT_SEED)
    world = click_world()
    users, items, clicked = world.pairs(args.held_out * 5, seed=HELD_OUT_SEED)
    pairs = (world.user_features[users], world.item_features[items])
    batch = args.max_batch
    for precision in ("fp32", reduced):
        for name, module in (("wide classifier", wide), ("demo classifier", demo.module)):
            runner = _runner(_copy(module), device, precision, batch, args.cpu_threads)
            one = (images[:1],)
            full = (np.resize(images, (batch, *images.shape[1:])),)
            out["latency_ms"].setdefault(name, {})[precision] = {
                "batch_1": round(_forward_ms(runner, one, args.repeats), 3),
                f"batch_{batch}": round(_forward_ms(runner, full, max(3, args.repeats // 4)), 3),
            }
        classifier = _runner(_copy(demo.module), device, precision, batch, args.cpu_threads)
        logits = _predict(classifier, (images,), batch)
        scorer = _runner(_copy(ranker.module), device, precision, batch, args.cpu_threads)
        scores = _predict(scorer, pairs, batch)
        out["accuracy"][precision] = {
            "classifier_top1": round(float((logits.argmax(1) == labels).mean()), 4),
            "ranker_auc": round(auc(scores, clicked), 4),
        }
        out.setdefault("_predictions", {})[precision] = logits.argmax(1)
    predictions = out.pop("_predictions")
    out["accuracy"]["top1_agreement"] = round(
        float((predictions["fp32"] == predictions[reduced]).mean()), 4
    )
    for name, entry in out["latency_ms"].items():
        for key in entry["fp32"]:
            cut = 1 - entry[reduced][key] / entry["fp32"][key]
            entry.setdefault("reduction", {})[key] = round(cut, 3)
        print(
            f"  {name}: fp32 {entry['fp32']} / {reduced} {entry[reduced]} ms "
            f"(reduction {entry['reduction']})",
            flush=True,
        )
    print(f"  accuracy: {out['accuracy']}", flush=True)
    return out


def _copy(module: torch.nn.Module) -> torch.nn.Module:
    import copy

    return copy.deepcopy(module).eval()


class _NoFeatures:
    """The precision comparison feeds the ranker directly; it never looks features up."""

    async def get(self, entity: str, ids: Any, features: Any = None) -> Any:
        raise RuntimeError(
            f"the precision comparison feeds the ranker's features directly; a lookup of "
            f"{entity!r} means the benchmark built its requests wrong"
        )

    async def aclose(self) -> None:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description="model workers benchmark")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help="tiny run (seconds)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda")
    parser.add_argument(
        "--compile",
        default="off",
        choices=["auto", "on", "off"],
        help="torch.compile/CUDA graphs in the worker (CUDA only with auto)",
    )
    parser.add_argument(
        "--hidden",
        type=int,
        nargs="+",
        default=[4096, 4096, 4096],
        help="dense head widths of the benchmark model",
    )
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument(
        "--requests",
        type=int,
        default=1600,
        help="measured requests with dynamic batching (batch 1 runs a quarter)",
    )
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--delay-ms", type=float, default=2.0)
    parser.add_argument(
        "--cpu-threads",
        type=int,
        default=1,
        help="torch threads in the worker; on 2 cores the load generator needs the other one",
    )
    parser.add_argument(
        "--rounds", type=int, default=4, help="alternating measured rounds per mode"
    )
    parser.add_argument("--unloaded-requests", type=int, default=100)
    parser.add_argument("--held-out", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None, help="report path (JSON)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args()
    if args.child:
        _child(json.loads(args.child))
        return
    if args.smoke:
        args.hidden, args.concurrency, args.requests, args.max_batch = [64], 8, 64, 8
        args.unloaded_requests, args.held_out, args.repeats, args.rounds = 10, 200, 3, 1
    if args.device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    else:
        device = args.device
    precision = "fp16" if device.startswith("cuda") else "fp32"
    started = time.perf_counter()
    report: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None,
        },
        "device": device,
        "precision": precision,
        "parameters": {
            k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "child"
        },
    }
    print(
        f"1. dynamic batching vs batch size 1 ({device}, {precision}, concurrency "
        f"{args.concurrency}, max batch {args.max_batch}):",
        flush=True,
    )
    report["batching"] = batching(args, device, precision)
    verdict = report["batching"]
    print(
        f"  throughput x{verdict['throughput_ratio']}, p95 x{verdict['p95_ratio']} -> "
        f"target (>= 3.5x at <= 1.2x p95) {'met' if verdict['target_met'] else 'MISSED'}",
        flush=True,
    )
    print(f"2. {'fp16' if device.startswith('cuda') else 'int8'} vs fp32:", flush=True)
    report["precision"] = precision_comparison(args, device)
    report["elapsed_s"] = round(time.perf_counter() - started, 1)
    stamp = time.strftime("%Y%m%dT%H%M%S") + ("-smoke" if args.smoke else "")
    path = args.out or RESULTS / f"workers-{stamp}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    print(f"done in {report['elapsed_s']} s; full report: {path}")
    if args.strict and not args.smoke and not verdict["target_met"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
