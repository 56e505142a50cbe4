"""Bad input gets a clear 4xx; the worker keeps serving everyone else."""

from __future__ import annotations

import aiohttp
import numpy as np
import pytest

from preprocess import CONTENT_TYPE_IMAGE, encode_envelope
from workers.exceptions import PayloadTooLargeError
from workers.inputs import ENVELOPE_TYPE, NPY_TYPE, decode_array, encode_npy
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


@pytest.mark.parametrize(
    ("encoding", "layout"), [("raw", "HWC"), ("webp-lossless", "HWC"), ("arrow", "CHW")]
)
async def test_preprocess_envelope_is_served_like_npy(
    classifier_url: str, encoding: str, layout: str
) -> None:
    pixels = IMAGE if layout == "HWC" else np.ascontiguousarray(IMAGE.transpose(2, 0, 1))
    envelope = encode_envelope(
        pixels, content_type=CONTENT_TYPE_IMAGE, encoding=encoding, layout=layout, profile="demo-32"
    )  # type: ignore[arg-type]
    _, via_npy = await _post(classifier_url, encode_npy(IMAGE), {"Content-Type": NPY_TYPE})
    code, via_envelope = await _post(classifier_url, envelope, {"Content-Type": ENVELOPE_TYPE})
    assert code == 200, via_envelope
    assert via_envelope["predictions"] == via_npy["predictions"]


async def test_bad_envelopes_are_4xx_naming_the_problem(classifier_url: str) -> None:
    good = encode_envelope(IMAGE, content_type=CONTENT_TYPE_IMAGE, encoding="raw", layout="HWC")
    floats = encode_envelope(
        IMAGE.astype(np.float32) / 255,
        content_type=CONTENT_TYPE_IMAGE,
        encoding="raw",
        layout="HWC",
    )
    cases = [
        (good[:-10], 400, "truncated or padded in transit"),
        (b"NOPE" + good[4:], 400, "not an edgefeed envelope"),
        (floats, 400, "takes dtype uint8, got float32"),
        (
            encode_envelope(b"{}", content_type="application/json", encoding="raw"),
            400,
            "holds no array",
        ),
    ]
    for body, status, message in cases:
        code, answer = await _post(classifier_url, body, {"Content-Type": ENVELOPE_TYPE})
        assert code == status, answer
        assert message in answer["error"]["message"]


def test_envelope_over_the_size_limit_is_a_payload_too_large() -> None:
    envelope = encode_envelope(IMAGE, content_type=CONTENT_TYPE_IMAGE, encoding="raw")
    with pytest.raises(PayloadTooLargeError, match="over the limit of 100 bytes"):
        decode_array(envelope, ENVELOPE_TYPE, max_bytes=100)
