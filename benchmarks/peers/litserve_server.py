"""LitServe serving one TorchScript model: the peer of ``edgefeed workers serve``
in benchmarks/serving_peers.py.

Runs in its own venv (``.venv-litserve``, made by setup.sh); imports nothing
from the project. LitServe's batching is on: up to ``--max-batch-size``
requests per ``predict`` call, waiting at most ``--delay-ms`` for a batch to
fill. LitServe's default request path parses JSON, so the body is
``{"npy": "<base64 of the .npy bytes>"}``, the same .npy bytes that edgefeed
receives as ``application/x-npy``.

    python litserve_server.py --model-file M.ts --kind classifier --port 8000
"""

from __future__ import annotations

import argparse
import base64
import io
from typing import Any

import litserve as ls
import numpy as np
import torch


class TorchScriptAPI(ls.LitAPI):
    """Decodes one .npy array per request, runs a batch of them, renders like edgefeed."""

    def __init__(self, model_file: str, kind: str, threads: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.model_file = model_file
        self.kind = kind
        self.threads = threads

    def setup(self, device: str) -> None:
        torch.set_num_threads(self.threads)
        self.model = torch.jit.load(self.model_file, map_location="cpu").eval()

    # No annotation on ``request``: LitServe takes it as the request type, and only
    # the unannotated default parses the JSON body into a dict.
    def decode_request(self, request) -> np.ndarray:  # type: ignore[no-untyped-def]
        array = np.load(io.BytesIO(base64.b64decode(request["npy"])), allow_pickle=False)
        # one row may come without its batch dimension (edgefeed accepts both too)
        return array[np.newaxis] if array.ndim == (3 if self.kind == "classifier" else 1) else array

    def batch(self, inputs: list[np.ndarray]) -> tuple[torch.Tensor, list[int]]:
        return torch.from_numpy(np.concatenate(inputs)), [len(x) for x in inputs]

    def predict(self, x: Any) -> Any:
        if isinstance(x, np.ndarray):  # a batch of one, when batching finds no company
            x = (torch.from_numpy(x), [len(x)])
        tensor, sizes = x
        with torch.inference_mode():
            out = self.model(tensor).numpy()
        return out, sizes

    def unbatch(self, output: Any) -> list[np.ndarray]:
        out, sizes = output
        return np.split(out, np.cumsum(sizes)[:-1])

    def encode_response(self, output: np.ndarray) -> dict[str, Any]:
        if isinstance(output, tuple):  # unbatched path (batch of one)
            output = output[0]
        if self.kind != "classifier":
            return {"outputs": output.tolist()}
        # The same answer edgefeed's classifier renders: top 3 by softmax and the logits.
        shifted = output - output.max(axis=1, keepdims=True)
        probs = np.exp(shifted) / np.exp(shifted).sum(axis=1, keepdims=True)
        predictions = []
        for logits, row in zip(output, probs, strict=True):
            order = np.argsort(-row)[:3]
            top = [{"index": int(i), "label": str(int(i)), "score": float(row[i])} for i in order]
            predictions.append({"top": top, "logits": logits.tolist()})
        return {"predictions": predictions}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-file", required=True)
    parser.add_argument("--kind", choices=["classifier", "tensor"], required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-batch-size", type=int, default=64, help="requests per batch")
    parser.add_argument("--delay-ms", type=float, default=2.0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    api = TorchScriptAPI(
        args.model_file,
        args.kind,
        args.threads,
        max_batch_size=args.max_batch_size,
        batch_timeout=args.delay_ms / 1e3,
    )
    server = ls.LitServer(api, accelerator="cpu", devices=1, workers_per_device=1, timeout=60)
    server.run(host="127.0.0.1", port=args.port, generate_client_file=False, log_level="warning")


if __name__ == "__main__":
    main()
