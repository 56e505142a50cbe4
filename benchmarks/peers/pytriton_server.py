"""Triton (through NVIDIA PyTriton) serving one TorchScript model: the peer of
``edgefeed workers serve`` in benchmarks/serving_peers.py.

Runs in its own venv (``.venv-pytriton``, made by setup.sh); imports nothing
from the project. Triton's dynamic batcher (rows up to ``--max-batch-size``,
waiting at most ``--delay-ms``) feeds a PyTriton Python backend that runs the
module on the CPU with ``--threads`` torch threads.

    python pytriton_server.py --model-file M.ts --name classifier --input-shape 32,32,3 \
        --input-dtype uint8 --output-shape 6 --port 8000
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig

import numpy as np
import torch
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import DEFAULT_PROTECTED_ENDPOINTS, Triton, TritonConfig, TritonSecurityConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-file", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--input-shape", required=True, help="per-row shape, e.g. 32,32,3")
    parser.add_argument("--input-dtype", required=True)
    parser.add_argument("--output-shape", required=True, help="per-row output shape, e.g. 6 or 1")
    parser.add_argument("--port", type=int, required=True, help="HTTP port")
    parser.add_argument("--grpc-port", type=int, required=True)
    parser.add_argument("--metrics-port", type=int, required=True)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--delay-ms", type=float, default=2.0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    # Triton's Python backend stub links libpython3.X.so dynamically; without this
    # it picks the system's (here Debian's 3.11.2) while the venv's stdlib is this
    # interpreter's (pyenv 3.11.7), and fails in multiprocessing.resource_tracker with
    # "AttributeError: '_thread.RLock' object has no attribute '_recursion_count'"
    # (pytriton issue #51). The stub inherits this environment from tritonserver.
    libdir = sysconfig.get_config_var("LIBDIR")
    if libdir and sysconfig.get_config_var("Py_ENABLE_SHARED"):
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (libdir, os.environ.get("LD_LIBRARY_PATH", "")) if p
        )
    torch.set_num_threads(args.threads)
    module = torch.jit.load(args.model_file, map_location="cpu").eval()
    out_shape = tuple(int(d) for d in args.output_shape.split(","))

    @batch
    def infer(inputs: np.ndarray) -> dict[str, np.ndarray]:
        with torch.inference_mode():
            out = module(torch.from_numpy(inputs)).numpy()
        return {"outputs": out.reshape(out.shape[0], *out_shape).astype(np.float32)}

    config = TritonConfig(
        http_address="127.0.0.1",
        http_port=args.port,
        grpc_address="127.0.0.1",
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        log_verbose=0,
    )
    # PyTriton guards the statistics endpoint with a token by default; the benchmark
    # reads it (queue and compute time per request), so only that one is opened.
    security = TritonSecurityConfig(
        restricted_endpoints=[e for e in DEFAULT_PROTECTED_ENDPOINTS if e != "statistics"]
    )
    with Triton(config=config, security_config=security) as triton:
        triton.bind(
            model_name=args.name,
            infer_func=infer,
            inputs=[
                Tensor(
                    name="inputs",
                    dtype=np.dtype(args.input_dtype).type,
                    shape=tuple(int(d) for d in args.input_shape.split(",")),
                )
            ],
            outputs=[Tensor(name="outputs", dtype=np.float32, shape=out_shape)],
            config=ModelConfig(
                max_batch_size=args.max_batch_size,
                batcher=DynamicBatcher(max_queue_delay_microseconds=int(args.delay_ms * 1000)),
            ),
            strict=True,
        )
        print(json.dumps({"ready": True, "port": args.port}), flush=True)
        triton.serve()
    sys.exit(0)


if __name__ == "__main__":
    main()
