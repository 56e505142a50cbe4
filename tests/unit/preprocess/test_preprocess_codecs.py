from __future__ import annotations

import gzip
import json

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image
from preprocess_photos import PHOTOS, encode, ssim

from preprocess import (
    EncodingError,
    arrow_decode_table,
    arrow_decode_tensor,
    arrow_encode_table,
    arrow_encode_tensor,
    brotli_compress,
    brotli_decompress,
    webp_decode,
    webp_encode,
)


@pytest.mark.parametrize("photo", PHOTOS)
def test_lossless_webp_round_trips_exactly(photos: dict[str, Image.Image], photo: str) -> None:
    pixels = np.asarray(photos[photo])
    data = webp_encode(pixels, lossless=True, quality=50, method=2)
    assert data[:4] == b"RIFF" and data[8:12] == b"WEBP"
    np.testing.assert_array_equal(webp_decode(data), pixels)


@pytest.mark.parametrize("photo", PHOTOS)
def test_lossy_webp_decodes_with_high_ssim(
    photos: dict[str, Image.Image], photo: str, record_property: pytest.RecordProperty
) -> None:
    pixels = np.asarray(photos[photo])
    data = webp_encode(pixels, quality=85, method=4)
    decoded = webp_decode(data)
    assert decoded.shape == pixels.shape
    score = ssim(pixels, decoded)
    record_property("webp_q85_ssim", score)
    record_property("webp_q85_bytes", len(data))
    assert score > 0.85
    assert len(data) < len(encode(photos[photo], "PNG"))


def test_webp_greyscale_and_rgba() -> None:
    grey = np.arange(64 * 48, dtype=np.uint32).reshape(48, 64).astype(np.uint8)
    out = webp_decode(webp_encode(grey, lossless=True), channels=1)
    np.testing.assert_array_equal(out[:, :, 0], grey)
    rgba = np.dstack([grey, grey, grey, 255 - grey])
    np.testing.assert_array_equal(webp_decode(webp_encode(rgba, lossless=True), channels=4), rgba)


@pytest.mark.parametrize(
    ("array", "message"),
    [
        (np.zeros((8, 8, 3), np.float32), "uint8"),
        (np.zeros((3, 8, 8, 2), np.uint8), "shape"),
        (np.zeros((8, 8, 2), np.uint8), "shape"),
    ],
)
def test_webp_refuses_what_it_cannot_carry(array: np.ndarray, message: str) -> None:
    with pytest.raises(EncodingError, match=message):
        webp_encode(array)


def test_brotli_round_trip_and_text_mode() -> None:
    payload = json.dumps({"user": 42, "features": [0.5] * 1000}).encode()
    for quality in (0, 5, 11):
        packed = brotli_compress(payload, quality=quality, text=True)
        assert brotli_decompress(packed) == payload
    assert len(brotli_compress(payload)) < len(gzip.compress(payload))
    assert brotli_decompress(brotli_compress("héllo")) == "héllo".encode()
    with pytest.raises(EncodingError, match="0-11"):
        brotli_compress(b"x", quality=12)


def test_arrow_tensor_and_table_round_trip() -> None:
    tensor = np.random.default_rng(1).standard_normal((4, 3, 8, 8)).astype(np.float16)
    out = arrow_decode_tensor(arrow_encode_tensor(tensor))
    assert out.dtype == np.float16
    np.testing.assert_array_equal(out, tensor)
    table = pa.table(
        {
            "user_id": pa.array([1, 2, 3], pa.int64()),
            "embedding": pa.array([[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]], pa.list_(pa.float32())),
            "country": pa.array(["de", "sg", "fr"]),
        }
    )
    assert arrow_decode_table(arrow_encode_table(table)).equals(table)
    batch = table.to_batches()[0]
    assert arrow_decode_table(arrow_encode_table(batch)).equals(table)
    with pytest.raises(EncodingError, match="numbers"):
        arrow_encode_tensor(np.array(["a"], dtype=object))
