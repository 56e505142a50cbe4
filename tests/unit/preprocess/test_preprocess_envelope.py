from __future__ import annotations

import dataclasses
import json
import struct

import numpy as np
import pyarrow as pa
import pytest
from preprocess_photos import ssim

from preprocess import (
    CONTENT_TYPE_FEATURES,
    CONTENT_TYPE_IMAGE,
    CONTENT_TYPE_JSON,
    CONTENT_TYPE_TENSOR,
    ENVELOPE_VERSION,
    EncodingError,
    Envelope,
    EnvelopeError,
    InputTooLargeError,
    decode_envelope,
    encode_envelope,
    encode_image,
    get_profile,
    preprocess_image,
)


@pytest.fixture(scope="module")
def image_tensor(hd_jpegs: dict[str, bytes]) -> np.ndarray:
    return preprocess_image(hd_jpegs["chelsea.png"], get_profile("imagenet-224"))


@pytest.mark.parametrize("encoding", ["raw", "brotli", "arrow"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_tensor_round_trips_exactly(image_tensor: np.ndarray, encoding: str, dtype: str) -> None:
    tensor = image_tensor.astype(dtype)
    data = encode_envelope(
        tensor,
        content_type=CONTENT_TYPE_IMAGE,
        encoding=encoding,  # type: ignore[arg-type]
        layout="CHW",
        profile="imagenet-224",
        metadata={"request_id": "r-1"},
    )
    envelope = decode_envelope(data)
    assert isinstance(envelope, Envelope)
    assert dataclasses.is_dataclass(envelope)
    with pytest.raises(dataclasses.FrozenInstanceError):
        envelope.encoding = "raw"  # type: ignore[misc]
    assert envelope.content_type == CONTENT_TYPE_IMAGE
    assert envelope.encoding == encoding
    assert envelope.shape == (3, 224, 224)
    assert envelope.dtype == dtype
    assert envelope.version == ENVELOPE_VERSION
    assert envelope.layout == "CHW"
    assert envelope.profile == "imagenet-224"
    assert envelope.metadata == {"request_id": "r-1"}
    out = envelope.to_numpy()
    assert out.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(out, tensor)


def test_big_endian_input_arrives_native() -> None:
    tensor = np.arange(12, dtype=">i4").reshape(3, 4)
    out = decode_envelope(
        encode_envelope(tensor, content_type=CONTENT_TYPE_TENSOR, encoding="raw")
    ).to_numpy()
    assert out.dtype == np.dtype("int32")
    np.testing.assert_array_equal(out, tensor)


@pytest.mark.parametrize("layout", ["HWC", "CHW"])
def test_lossless_webp_image_round_trips_exactly(hd_jpegs: dict[str, bytes], layout: str) -> None:
    pixels = preprocess_image(hd_jpegs["rocket.jpg"], get_profile("imagenet-224-uint8"))
    value = pixels.transpose(2, 0, 1).copy() if layout == "CHW" else pixels
    data = encode_envelope(
        value,
        content_type=CONTENT_TYPE_IMAGE,
        encoding="webp-lossless",
        layout=layout,  # type: ignore[arg-type]
    )
    envelope = decode_envelope(data)
    assert envelope.shape == value.shape
    np.testing.assert_array_equal(envelope.to_numpy(), value)
    assert len(data) < value.nbytes


def test_lossy_webp_envelope_keeps_shape_and_quality(hd_jpegs: dict[str, bytes]) -> None:
    profile = get_profile("webp-720")
    data = encode_image(hd_jpegs["coffee.png"], profile)
    envelope = decode_envelope(data)
    assert envelope.encoding == "webp"
    assert envelope.profile == "webp-720"
    out = envelope.to_numpy()
    reference = preprocess_image(hd_jpegs["coffee.png"], profile)
    assert out.shape == reference.shape == (720, 1280, 3)
    assert ssim(reference, out) > 0.9
    assert len(data) < len(hd_jpegs["coffee.png"])


def test_json_and_features_round_trip() -> None:
    document = {"user": 7, "recent_items": list(range(200)), "country": "sg"}
    text = json.dumps(document)
    envelope = decode_envelope(
        encode_envelope(text, content_type=CONTENT_TYPE_JSON, encoding="brotli")
    )
    assert envelope.shape is None and envelope.dtype is None
    assert envelope.to_json() == document
    assert envelope.to_text() == text
    with pytest.raises(EnvelopeError, match="holds no array"):
        envelope.to_numpy()
    raw = decode_envelope(
        encode_envelope(b"\x00\x01", content_type="application/octet-stream", encoding="raw")
    )
    assert raw.to_bytes() == b"\x00\x01"
    table = pa.table({"user_id": [1, 2], "score": [0.25, 0.5]})
    for encoding in ("arrow", "brotli"):
        env = decode_envelope(
            encode_envelope(table, content_type=CONTENT_TYPE_FEATURES, encoding=encoding)  # type: ignore[arg-type]
        )
        assert env.to_arrow().equals(table)


@pytest.mark.parametrize(
    ("value", "kwargs", "message"),
    [
        (np.zeros((4, 4), np.float32), {"encoding": "webp"}, "uint8"),
        (b"abc", {"encoding": "arrow"}, "'raw' or 'brotli'"),
        (np.array([object()]), {"encoding": "raw"}, "dtype object"),
        (np.zeros(3), {"encoding": "zip"}, "encoding 'zip'"),
        (np.zeros(3), {"encoding": "raw", "content_type": "not a mime"}, "MIME"),
        ([1, 2], {"encoding": "raw"}, "cannot encode a list"),
    ],
)
def test_encode_refuses_bad_values(value: object, kwargs: dict[str, object], message: str) -> None:
    arguments: dict[str, object] = {"content_type": CONTENT_TYPE_TENSOR, **kwargs}
    with pytest.raises(EncodingError, match=message):
        encode_envelope(value, **arguments)  # type: ignore[arg-type]


def _tamper(data: bytes, **changes: object) -> bytes:
    magic, version, length = struct.unpack_from("<4sBI", data)
    header = json.loads(data[9 : 9 + length])
    payload = data[9 + length :]
    header.update(changes)
    new = json.dumps(header).encode()
    return struct.pack("<4sBI", magic, version, len(new)) + new + payload


def test_decode_refuses_malformed_envelopes() -> None:
    good = encode_envelope(
        np.arange(6, dtype=np.float32), content_type=CONTENT_TYPE_TENSOR, encoding="raw"
    )
    cases = {
        b"XXXX" + good[4:]: "not an edgefeed envelope",
        good[:4] + bytes([99]) + good[5:]: "version 99 is not supported",
        good[:-4]: "truncated or padded",
        good[:-1] + bytes([good[-1] ^ 1]): "checksum",
        good[:6]: "truncated",
        _tamper(good, shape=[7]): "needs 28",
        _tamper(good, dtype="object"): "dtype 'object'",
        _tamper(good, shape=[-1]): "shape",
        _tamper(good, encoding="gzip"): "encoding 'gzip'",
        _tamper(good, shape=[10**9, 10**9]): "max_decoded_bytes",
        good[:9] + b"[" + good[10:]: "not valid JSON",
    }
    for data, message in cases.items():
        with pytest.raises(EnvelopeError, match=message):
            decode_envelope(data)
    with pytest.raises(InputTooLargeError, match="over the limit of 10 bytes"):
        decode_envelope(good, max_bytes=10)


def test_declared_shape_must_match_decoded_payload() -> None:
    data = encode_envelope(
        np.arange(6, dtype=np.int64), content_type=CONTENT_TYPE_TENSOR, encoding="arrow"
    )
    for changes in ({"shape": [5]}, {"shape": [2, 3]}, {"dtype": "float64"}):
        with pytest.raises(EnvelopeError, match="the header declares"):
            decode_envelope(_tamper(data, **changes)).to_numpy()
    short = encode_envelope(
        np.arange(6, dtype=np.int64), content_type=CONTENT_TYPE_TENSOR, encoding="brotli"
    )
    # 48 decoded bytes against 50 declared: a typed error, not NumPy's bare ValueError.
    with pytest.raises(EnvelopeError, match="needs"):
        decode_envelope(_tamper(short, dtype="int16", shape=[25])).to_numpy()
