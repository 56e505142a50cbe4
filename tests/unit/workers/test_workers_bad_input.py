"""Bad input gets a clear 4xx; the worker keeps serving everyone else."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass

import aiohttp
import numpy as np
import pytest

from workers.exceptions import InvalidTensorError, UnsupportedMediaTypeError
from workers.inputs import NPY_TYPE, decode_array, encode_npy
from workers.models import load_served_model
from workers.server import InferenceServer, ServerConfig
from workers.synthetic import shape_images

IMAGE = shape_images(1, seed=1)[0][0]


@pytest.fixture
async def classifier_url():  # type: ignore[no-untyped-def]
    model = load_served_model("image-classifier")
    async with InferenceServer([model], config=ServerConfig(max_payload_bytes=160 * 1024)) as srv:
        yield f"{srv.url}/v1/models/image-classifier/infer"


async def _post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict]:  # type: ignore[type-arg]
    async with aiohttp.ClientSession() as http, http.post(url, data=body, headers=headers) as r:
        return r.status, await r.json()


CASES = [
    (
        "wrong shape",
        encode_npy(np.zeros((16, 16, 3), np.uint8)),
        {"Content-Type": NPY_TYPE},
        400,
        "takes shape (32,32,3) or (n,32,32,3), got (16, 16, 3)",
    ),
    (
        "wrong dtype",
        encode_npy(IMAGE.astype(np.float32)),
        {"Content-Type": NPY_TYPE},
        400,
        "takes dtype uint8, got float32",
    ),
    ("not npy", b"\x89PNG....", {"Content-Type": NPY_TYPE}, 400, "lacks the \\x93NUMPY magic"),
    ("truncated npy", encode_npy(IMAGE)[:200], {"Content-Type": NPY_TYPE}, 400, "not a valid"),
    (
        "pickled npy",
        b"\x93NUMPY\x01\x00v\x00{'descr': '|O', 'fortran_order': False, "
        b"'shape': (1,), }" + b" " * 60 + b"\n" + b"\x80\x04N.",
        {"Content-Type": NPY_TYPE},
        400,
        "without pickles",
    ),
    (
        "unknown encoding",
        b"{}",
        {"Content-Type": "image/jpeg"},
        415,
        "Content-Type 'image/jpeg' is not accepted",
    ),
    (
        "raw without headers",
        IMAGE.tobytes(),
        {"Content-Type": "application/octet-stream"},
        400,
        "need headers X-Tensor-Shape",
    ),
    (
        "raw size mismatch",
        IMAGE.tobytes()[:-1],
        {
            "Content-Type": "application/octet-stream",
            "X-Tensor-Shape": "32,32,3",
            "X-Tensor-Dtype": "uint8",
        },
        400,
        "body has 3071 bytes",
    ),
    (
        "raw bad dtype",
        IMAGE.tobytes(),
        {
            "Content-Type": "application/octet-stream",
            "X-Tensor-Shape": "32,32,3",
            "X-Tensor-Dtype": "object",
        },
        400,
        "'object' is not one of",
    ),
    (
        "too many rows",
        encode_npy(np.zeros((40, 32, 32, 3), np.uint8)),
        {"Content-Type": NPY_TYPE},
        400,
        "request holds 40 rows; this worker takes 1 to 32",
    ),
    (
        "oversized",
        b"\x93NUMPY" + b"\x00" * (170 * 1024),
        {"Content-Type": NPY_TYPE},
        413,
        "over the limit of 163840 bytes",
    ),
]


@pytest.mark.parametrize(
    ("case", "body", "headers", "status", "message"), CASES, ids=[case[0] for case in CASES]
)
async def test_bad_input_is_a_clear_4xx_and_the_worker_keeps_serving(
    classifier_url: str,
    case: str,
    body: bytes,
    headers: dict[str, str],
    status: int,
    message: str,
) -> None:
    code, answer = await _post(classifier_url, body, headers)
    assert code == status, answer
    assert message in answer["error"]["message"]
    assert answer["error"]["retryable"] is False
    code, answer = await _post(classifier_url, encode_npy(IMAGE), {"Content-Type": NPY_TYPE})
    assert code == 200
    assert answer["predictions"][0]["top"][0]["label"]


async def test_unknown_model_is_a_404_listing_the_served_ones(classifier_url: str) -> None:
    url = classifier_url.replace("image-classifier", "resnet-9000")
    code, answer = await _post(url, encode_npy(IMAGE), {"Content-Type": NPY_TYPE})
    assert code == 404
    assert answer["error"]["type"] == "UnknownModelError"
    assert (
        "'resnet-9000' is not served here; served: image-classifier" in answer["error"]["message"]
    )


async def test_raw_tensor_format_equals_npy(classifier_url: str) -> None:
    _, via_npy = await _post(classifier_url, encode_npy(IMAGE), {"Content-Type": NPY_TYPE})
    _, via_raw = await _post(
        classifier_url,
        IMAGE.tobytes(),
        {
            "Content-Type": "application/octet-stream",
            "X-Tensor-Shape": "1,32,32,3",
            "X-Tensor-Dtype": "uint8",
        },
    )
    assert via_raw["predictions"] == via_npy["predictions"]


def test_envelope_without_the_preprocess_decoder_is_a_415(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "preprocess", types.ModuleType("preprocess"))
    with pytest.raises(UnsupportedMediaTypeError, match="decode_envelope"):
        decode_array(b"...", "application/vnd.edgefeed.envelope")


@dataclass(frozen=True)
class _Envelope:
    content_type: str
    shape: tuple[int, ...]
    dtype: str
    pixels: np.ndarray

    def to_numpy(self) -> np.ndarray:
        return self.pixels


def test_envelope_is_decoded_through_preprocess_decode_envelope(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int | None] = []

    def decode_envelope(data: bytes, *, max_bytes: int | None = None) -> _Envelope:
        calls.append(max_bytes)
        if data == b"bad":
            raise ValueError("envelope version 9 is not supported")
        return _Envelope("image/raw", IMAGE.shape, "uint8", IMAGE)

    fake = types.ModuleType("preprocess")
    fake.decode_envelope = decode_envelope  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "preprocess", fake)
    array = decode_array(b"ok", "application/vnd.edgefeed.envelope", max_bytes=1000)
    np.testing.assert_array_equal(array, IMAGE)
    assert calls == [1000]
    with pytest.raises(InvalidTensorError, match="envelope version 9 is not supported"):
        decode_array(b"bad", "application/vnd.edgefeed.envelope")
