"""NaN and infinity in model outputs, and huge ids, through the real server.

JSON has no NaN: an answer holding one is unparseable by strict clients. A
tensor or classifier output with NaN/Inf is a typed 500 naming where it is;
a ranker's NaN score is ``null``, ranked last, and counted. Error answers never
echo more than a clipped excerpt of the request.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import aiohttp
import numpy as np
import pytest
import torch
from torch import nn
from workers_doubles import metric_value  # type: ignore[import-not-found]

from workers.inputs import NPY_TYPE, encode_npy
from workers.models import TensorModel
from workers.models.ranking import Ranker, RankerConfig, RankingNet
from workers.server import InferenceServer


def _strict_json(text: str) -> Any:
    def refuse(constant: str) -> None:
        raise AssertionError(f"answer holds {constant}, which is not JSON")

    return json.loads(text, parse_constant=refuse)


class _Reciprocal(nn.Module):
    """1/x: infinite for a zero input, NaN for 0/0 via x/x."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([1.0 / x, x / x], dim=1)


async def test_a_tensor_output_with_nan_or_infinity_is_a_typed_500_not_invalid_json() -> None:
    model = TensorModel("reciprocal", _Reciprocal(), (2,), "float32")
    async with InferenceServer([model]) as server, aiohttp.ClientSession() as http:
        url = f"{server.url}/v1/models/reciprocal/infer"
        headers = {"Content-Type": NPY_TYPE}
        body = encode_npy(np.array([[1.0, 0.0]], np.float32))
        async with http.post(url, data=body, headers=headers) as response:
            status, answer = response.status, _strict_json(await response.text())
        assert status == 500
        assert answer["error"]["type"] == "NonFiniteOutputError"
        assert (
            "model 'reciprocal' produced inf at output index [0, 1]" in (answer["error"]["message"])
        )
        assert answer["error"]["retryable"] is False
        ok = encode_npy(np.array([[1.0, 2.0]], np.float32))
        async with http.post(url, data=ok, headers=headers) as response:
            assert response.status == 200
            assert _strict_json(await response.text())["outputs"] == [[1.0, 0.5, 1.0, 1.0]]
        async with http.get(f"{server.url}/metrics") as response:
            exposition = await response.text()
    assert metric_value(
        exposition, "edgefeed_worker_nonfinite_outputs_total", model="reciprocal"
    ) == pytest.approx(2.0)
    assert (
        metric_value(
            exposition,
            "edgefeed_worker_rejected_total",
            model="reciprocal",
            reason="nonfinite_output",
        )
        == 1.0
    )


class _Features:
    """Feature vectors in memory (a unit-level stand-in for the edge cache)."""

    def __init__(self, vectors: dict[str, np.ndarray]) -> None:
        self.vectors = vectors

    async def get(
        self, entity: str, ids: Sequence[str], features: Sequence[str] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        width = len(features or ())
        rows = np.full((len(ids), width), np.nan, np.float32)
        mask = np.ones((len(ids), width), bool)
        for row, entity_id in enumerate(ids):
            if entity_id in self.vectors:
                rows[row] = self.vectors[entity_id]
                mask[row] = False
        return rows, mask

    async def aclose(self) -> None:
        return None


def _ranker(vectors: dict[str, np.ndarray]) -> Ranker:
    config = RankerConfig()
    torch.manual_seed(0)
    return Ranker("ranker", RankingNet(config).eval(), config, _Features(vectors))


async def test_nan_scores_are_null_ranked_last_in_request_order_and_counted() -> None:
    rng = np.random.default_rng(3)
    vectors = {name: rng.normal(size=16).astype(np.float32) for name in ("u1", "a", "b", "c")}
    # A stored NaN is a value, not a missing cell: the lookup reports it as present.
    vectors["broken1"] = np.full(16, np.nan, np.float32)
    vectors["broken2"] = np.full(16, np.inf, np.float32)
    ids = ["broken1", "a", "broken2", "b", "c"]
    async with InferenceServer([_ranker(vectors)]) as server, aiohttp.ClientSession() as http:
        async with http.post(
            f"{server.url}/v1/models/ranker/infer",
            json={"user_id": "u1", "item_ids": ids},
        ) as response:
            status, answer = response.status, _strict_json(await response.text())
        async with http.get(f"{server.url}/metrics") as response:
            exposition = await response.text()
    assert status == 200, answer
    scores = dict(zip(ids, answer["scores"], strict=True))
    assert scores["broken1"] is None and scores["broken2"] is None
    ranked = [entry["item_id"] for entry in answer["ranking"]]
    finite = sorted(["a", "b", "c"], key=lambda item: -scores[item])
    assert ranked == [*finite, "broken1", "broken2"]
    assert metric_value(
        exposition, "edgefeed_worker_nonfinite_outputs_total", model="ranker"
    ) == pytest.approx(2.0)


async def test_a_megabyte_item_id_is_not_echoed_back() -> None:
    huge = "i" * 1_000_000
    rng = np.random.default_rng(4)
    vectors = {"u1": rng.normal(size=16).astype(np.float32)}
    async with InferenceServer([_ranker(vectors)]) as server, aiohttp.ClientSession() as http:
        for ids in ([huge], [f"item{i}-{'x' * 200}" for i in range(30)]):
            async with http.post(
                f"{server.url}/v1/models/ranker/infer",
                json={"user_id": "u1", "item_ids": ids},
            ) as response:
                status, text = response.status, await response.text()
            assert status in (400, 422), text[:200]
            assert len(text) < 4096, f"{len(text)}-byte error answer"
            assert "error" in _strict_json(text)


async def test_large_bodies_are_decoded_off_the_event_loop_small_plain_ones_on_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A large or hostile body must not stall every other request on the loop; a small
    plain tensor is decoded on it (the thread hop cost as much as its decode)."""
    import threading

    import workers.models.classifier as classifier
    from workers.inputs import INLINE_DECODE_MAX_BYTES

    threads: list[threading.Thread] = []
    real = classifier.decode_array

    def recording(*args: Any, **kwargs: Any) -> np.ndarray:
        threads.append(threading.current_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(classifier, "decode_array", recording)
    width = INLINE_DECODE_MAX_BYTES // 4 + 64  # one float32 row: a body over the limit
    small = TensorModel("reciprocal", _Reciprocal(), (2,), "float32")
    large = TensorModel("wide", _Reciprocal(), (width,), "float32")
    bodies = {
        "reciprocal": encode_npy(np.array([[1.0, 2.0]], np.float32)),
        "wide": encode_npy(np.ones((1, width), np.float32)),
    }
    assert len(bodies["reciprocal"]) <= INLINE_DECODE_MAX_BYTES < len(bodies["wide"])
    async with InferenceServer([small, large]) as server, aiohttp.ClientSession() as http:
        for name, body in bodies.items():
            async with http.post(
                f"{server.url}/v1/models/{name}/infer",
                data=body,
                headers={"Content-Type": NPY_TYPE},
            ) as response:
                assert response.status == 200, await response.text()
    assert threads[0] is threading.main_thread()
    assert threads[1] is not threading.main_thread()


class _NumpyRender(TensorModel):
    """A model whose render answers what orjson will not write (numpy scalars, int keys)."""

    def render(self, prepared: Any, output: np.ndarray) -> dict[str, Any]:
        return {"sum": np.float64(output.sum()), "by_row": {0: float(output[0, 0])}}


async def test_an_answer_orjson_cannot_write_is_still_rendered_as_json() -> None:
    model = _NumpyRender("numpyish", nn.Identity(), (2,), "float32")
    async with InferenceServer([model]) as server, aiohttp.ClientSession() as http:
        url = f"{server.url}/v1/models/numpyish/infer"
        body = encode_npy(np.array([[1.5, 2.0]], np.float32))
        async with http.post(url, data=body, headers={"Content-Type": NPY_TYPE}) as response:
            assert response.status == 200
            assert response.headers["Content-Type"] == "application/json; charset=utf-8"
            assert _strict_json(await response.text()) == {"sum": 3.5, "by_row": {"0": 1.5}}
