"""The servers compared by serving.py: the models they all load, how each server
is started, asked (its wire format) and answered, readiness and the agreement
check against the eager model.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import torch
from loadgen import Request

from workers.inputs import NPY_TYPE, encode_npy
from workers.models.loading import WEIGHTS_DIR, load_checkpoint
from workers.models.ranking import RankerConfig, RankingNet
from workers.synthetic import click_world, shape_images

__all__ = [
    "RANKER_ITEMS",
    "VENVS",
    "ModelCase",
    "PeerSetupError",
    "Server",
    "check_agreement",
    "export_models",
    "make_server",
    "wait_ready",
]

HERE = Path(__file__).resolve().parent
VENVS = {"litserve": HERE / ".venv-litserve", "triton": HERE / ".venv-pytriton"}
RANKER_ITEMS = 8
"""Candidate items per ranking request (rows per request)."""


class PeerSetupError(RuntimeError):
    """A server did not start, or answered differently from the reference model."""


# -- the models -----------------------------------------------------------


class _RankerRows(torch.nn.Module):
    """The ranker over one ``(n, user + item features)`` array: a tensor model for every server."""

    def __init__(self, net: RankingNet, user_dims: int) -> None:
        super().__init__()
        self.net = net
        self.user_dims = user_dims

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return self.net(rows[:, : self.user_dims], rows[:, self.user_dims :])


@dataclass(slots=True)
class ModelCase:
    """One model as every server serves it, its probe and load requests' arrays."""

    name: str
    kind: str  # "classifier" or "tensor" (edgefeed's --kind)
    file: Path
    row_shape: tuple[int, ...]
    dtype: str
    out_shape: tuple[int, ...]
    reference: Callable[[np.ndarray], np.ndarray]
    arrays: list[np.ndarray] = field(default_factory=list)


def export_models(folder: Path) -> dict[str, ModelCase]:
    """TorchScript of the shipped demo weights, traced once; every server loads these files."""
    from workers.models.loading import _build

    cases: dict[str, ModelCase] = {}
    path = WEIGHTS_DIR / "image_classifier.pt"
    classifier, config = _build(load_checkpoint(path, "image-classifier"), path)
    size = config.image_size
    example = torch.zeros((4, size, size, 3), dtype=torch.uint8)
    traced = torch.jit.trace(classifier, example)  # type: ignore[no-untyped-call]
    traced.save(str(folder / "classifier.ts"))
    images, _ = shape_images(256, size, seed=11)
    cases["classifier"] = ModelCase(
        "classifier",
        "classifier",
        folder / "classifier.ts",
        (size, size, 3),
        "uint8",
        (config.num_classes,),
        lambda x: _eager(classifier, x),
        [images[i : i + 1] for i in range(len(images))],
    )

    path = WEIGHTS_DIR / "ranker.pt"
    ranker, rconfig = _build(load_checkpoint(path, "ranker"), path)
    assert isinstance(rconfig, RankerConfig) and isinstance(ranker, RankingNet)
    user_dims = len(rconfig.user_features)
    rows = _RankerRows(ranker, user_dims).eval()
    width = user_dims + len(rconfig.item_features)
    traced = torch.jit.trace(rows, torch.zeros((4, width)))  # type: ignore[no-untyped-call]
    traced.save(str(folder / "ranker.ts"))
    world = click_world()
    rng = np.random.default_rng(12)
    arrays = []
    for _ in range(256):
        user = world.user_features[rng.integers(len(world.user_features))]
        items = world.item_features[rng.choice(len(world.item_features), RANKER_ITEMS, False)]
        user_rows = np.broadcast_to(user, (RANKER_ITEMS, user.shape[0]))
        arrays.append(np.ascontiguousarray(np.hstack([user_rows, items]), dtype=np.float32))
    cases["ranker"] = ModelCase(
        "ranker",
        "tensor",
        folder / "ranker.ts",
        (width,),
        "float32",
        (1,),
        lambda x: _eager(rows, x),
        arrays,
    )
    return cases


def _eager(module: torch.nn.Module, array: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        out: np.ndarray = module(torch.from_numpy(array)).numpy()
    return out


# -- the servers: how each is started, asked and answered ------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass(slots=True)
class Server:
    """One server process tree serving one model."""

    kind: str
    case: ModelCase
    command: list[str]
    ready_path: str
    port: int
    env: dict[str, str] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None
    log: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def request(self, array: np.ndarray) -> Request:
        """``array`` in this server's wire format (the same .npy bytes, or raw bytes)."""
        name = self.case.name
        if self.kind == "edgefeed":
            return Request(
                f"/v1/models/{name}/infer", encode_npy(array), {"Content-Type": NPY_TYPE}
            )
        if self.kind == "litserve":
            body = json.dumps({"npy": base64.b64encode(encode_npy(array)).decode()}).encode()
            return Request("/predict", body, {"Content-Type": "application/json"})
        # KServe v2 with Triton's binary tensor extension: a JSON header, then the raw bytes.
        header = json.dumps(
            {
                "inputs": [
                    {
                        "name": "inputs",
                        "shape": list(array.shape),
                        "datatype": {"uint8": "UINT8", "float32": "FP32"}[array.dtype.name],
                        "parameters": {"binary_data_size": array.nbytes},
                    }
                ],
                "outputs": [{"name": "outputs", "parameters": {"binary_data": False}}],
            }
        ).encode()
        return Request(
            f"/v2/models/{name}/infer",
            header + array.tobytes(),
            {
                "Content-Type": "application/octet-stream",
                "Inference-Header-Content-Length": str(len(header)),
            },
        )

    def outputs(self, body: bytes) -> np.ndarray:
        """The model's output rows from one answer."""
        answer = json.loads(body)
        if self.kind == "triton":
            out = answer["outputs"][0]
            return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])
        if self.case.kind == "classifier":
            return np.asarray([p["logits"] for p in answer["predictions"]], dtype=np.float32)
        return np.asarray(answer["outputs"], dtype=np.float32)

    def start(self, folder: Path) -> None:
        self.log = folder / f"{self.kind}-{self.case.name}.log"
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env},
                cwd=HERE,
                start_new_session=True,  # one process group to signal, apart from ours
            )

    def tree(self) -> list[int]:
        """Pids of the server and all its descendants (from /proc)."""
        if self.process is None:
            return []
        children: dict[int, list[int]] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = (entry / "stat").read_text()
                ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
        pids, todo = [], [self.process.pid]
        while todo:
            pid = todo.pop()
            pids.append(pid)
            todo += children.get(pid, [])
        return pids

    def signal_tree(self, sig: int) -> None:
        for pid in self.tree():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def stop(self) -> None:
        if self.process is None:
            return
        pids = self.tree()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.process.pid, signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=30)
        for pid in pids:  # stragglers (workers whose parent went first)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)
        self.process = None

    def log_tail(self, chars: int = 3000) -> str:
        if self.log is None or not self.log.exists():
            return ""
        return self.log.read_text(errors="replace")[-chars:]


def make_server(kind: str, case: ModelCase, args: argparse.Namespace) -> Server:
    port = free_port()
    rows_per_request = 1 if case.name == "classifier" else RANKER_ITEMS
    if kind == "edgefeed":
        command = [
            str(Path(sys.executable).parent / "edgefeed"),
            "workers",
            "serve",
            "--model",
            case.name,
            "--region",
            "bench",
            "--model-file",
            str(case.file),
            "--kind",
            case.kind,
            "--input-shape",
            ",".join(map(str, case.row_shape)),
            "--input-dtype",
            case.dtype,
            "--port",
            str(port),
            "--device",
            "cpu",
            "--precision",
            "fp32",
            "--max-batch-size",
            str(args.max_rows),
            "--max-queue-delay-ms",
            str(args.delay_ms),
            "--max-queue-size",
            "1024",
            "--processes",
            str(args.processes),
        ]
        env = {"EDGEFEED_WORKERS_CPU_THREADS": str(args.threads), "EDGEFEED_WORKERS_COMPILE": "off"}
        config = {
            "processes": args.processes,
            "max_batch_size_rows": args.max_rows,
            "max_queue_delay_ms": args.delay_ms,
            "max_queue_size": 1024,
            "cpu_threads": args.threads,
            "precision": "fp32",
            "compile": "off",
            "wire": "application/x-npy",
        }
        return Server(kind, case, command, "/readyz", port, env, config)
    python = str(VENVS[kind] / "bin" / "python")
    if kind == "litserve":
        max_requests = max(1, args.max_rows // rows_per_request)
        command = [
            python,
            str(HERE / "litserve_server.py"),
            "--model-file",
            str(case.file),
            "--kind",
            case.kind,
            "--port",
            str(port),
            "--max-batch-size",
            str(max_requests),
            "--delay-ms",
            str(args.delay_ms),
            "--threads",
            str(args.threads),
        ]
        config = {
            "max_batch_size_requests": max_requests,
            "rows_per_request": rows_per_request,
            "batch_timeout_s": args.delay_ms / 1e3,
            "accelerator": "cpu",
            "workers_per_device": 1,
            "cpu_threads": args.threads,
            "wire": 'application/json {"npy": base64 of the .npy bytes}',
        }
        return Server(kind, case, command, "/health", port, {}, config)
    command = [
        python,
        str(HERE / "pytriton_server.py"),
        "--model-file",
        str(case.file),
        "--name",
        case.name,
        "--input-shape",
        ",".join(map(str, case.row_shape)),
        "--input-dtype",
        case.dtype,
        "--output-shape",
        ",".join(map(str, case.out_shape)),
        "--port",
        str(port),
        "--grpc-port",
        str(free_port()),
        "--metrics-port",
        str(free_port()),
        "--max-batch-size",
        str(args.max_rows),
        "--delay-ms",
        str(args.delay_ms),
        "--threads",
        str(args.threads),
    ]
    config = {
        "max_batch_size_rows": args.max_rows,
        "max_queue_delay_microseconds": int(args.delay_ms * 1000),
        "instances": 1,
        "backend": "PyTriton (Triton Python backend + proxy process)",
        "cpu_threads": args.threads,
        "wire": "KServe v2 JSON header + binary tensor extension; JSON outputs",
    }
    return Server(kind, case, command, f"/v2/models/{case.name}/ready", port, {}, config)


async def wait_ready(session: aiohttp.ClientSession, server: Server, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process is not None and server.process.poll() is not None:
            raise PeerSetupError(
                f"{server.kind} ({server.case.name}) exited with {server.process.returncode} "
                f"before it was ready; its log ends:\n{server.log_tail()}"
            )
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with session.get(server.url + server.ready_path) as response:
                if response.status == 200:
                    return
        await asyncio.sleep(0.5)
    raise PeerSetupError(
        f"{server.kind} ({server.case.name}) not ready within {timeout_s:g} s; "
        f"its log ends:\n{server.log_tail()}"
    )


async def check_agreement(
    session: aiohttp.ClientSession, server: Server, probes: int, atol: float
) -> float:
    """Largest |server - eager reference| over ``probes`` requests; raises past ``atol``."""
    worst = 0.0
    for array in server.case.arrays[:probes]:
        request = server.request(array)
        async with session.post(
            server.url + request.path, data=request.body, headers=request.headers
        ) as response:
            body = await response.read()
            if response.status != 200:
                raise PeerSetupError(
                    f"{server.kind} ({server.case.name}) answered {response.status}: {body[:300]!r}"
                )
        got = server.outputs(body).reshape(-1)
        want = server.case.reference(array).reshape(-1)
        if got.shape != want.shape:
            raise PeerSetupError(
                f"{server.kind} ({server.case.name}) answered {got.shape[0]} values, "
                f"the reference {want.shape[0]}"
            )
        worst = max(worst, float(np.max(np.abs(got - want))))
    if worst > atol:
        raise PeerSetupError(
            f"{server.kind} ({server.case.name}) disagrees with the reference model by "
            f"{worst:.3g} (> {atol:g}); the comparison would not be of the same model"
        )
    return worst
