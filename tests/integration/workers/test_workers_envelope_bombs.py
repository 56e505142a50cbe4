"""Envelope bombs against a real worker process: refused from their headers, in bounded memory.

A few hundred bytes of envelope can declare (Brotli) or carry (lossless WebP)
tens of megabytes of pixels. The worker must compare what a body declares
with the model's input before it decodes anything, so a bomb costs the size
of its header, and an ordinary request keeps being served.
"""

from __future__ import annotations

import io
import json
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor

import brotli
import numpy as np
import pytest
from PIL import Image
from worker_process import WorkerProcess, worker_process  # type: ignore[import-not-found]

from preprocess import CONTENT_TYPE_IMAGE, encode_envelope
from workers.inputs import ENVELOPE_TYPE

pytestmark = pytest.mark.integration

# Bombs must be refused within this much memory above the worker's own peak.
MEMORY_BOUND = 200 * 1024 * 1024


def _envelope(header: dict[str, object], payload: bytes) -> bytes:
    """An envelope framed by hand, as an attacker would (valid length and checksum)."""
    full = {**header, "payload_bytes": len(payload), "crc32": zlib.crc32(payload)}
    text = json.dumps(full).encode()
    return struct.pack("<4sBI", b"EDGF", 1, len(text)) + text + payload


@pytest.fixture(scope="module")
def webp_bomb() -> bytes:
    """32x32x3 declared; the payload is a lossless WebP of 6300x6300 (one colour)."""
    canvas = io.BytesIO()
    Image.new("RGB", (6300, 6300)).save(canvas, "WEBP", lossless=True, quality=0, method=0)
    return _envelope(
        {
            "content_type": CONTENT_TYPE_IMAGE,
            "encoding": "webp-lossless",
            "shape": [32, 32, 3],
            "dtype": "uint8",
            "layout": "HWC",
        },
        canvas.getvalue(),
    )


@pytest.fixture(scope="module")
def brotli_bomb() -> bytes:
    """A few hundred bytes that expand to 64 MiB of zeros (4096x4096x4 declared)."""
    payload = brotli.compress(bytes(64 * 1024 * 1024), quality=11)
    return _envelope(
        {
            "content_type": "application/x-tensor",
            "encoding": "brotli",
            "shape": [4096, 4096, 4],
            "dtype": "uint8",
        },
        payload,
    )


def _ordinary(worker: WorkerProcess) -> tuple[int, dict[str, object]]:
    image = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    body = encode_envelope(image, content_type=CONTENT_TYPE_IMAGE, encoding="webp-lossless")
    status, answer, _ = worker.post("/v1/models/image-classifier/infer", body, ENVELOPE_TYPE)
    return status, answer


def test_envelope_bombs_are_refused_from_their_headers_in_bounded_memory(
    webp_bomb: bytes, brotli_bomb: bytes
) -> None:
    assert len(brotli_bomb) < 1024
    with worker_process("--model", "image-classifier") as worker:
        status, answer = _ordinary(worker)
        assert status == 200, answer
        baseline = worker.peak_rss_bytes()

        bombs = [webp_bomb, brotli_bomb] * 4  # several in flight at once
        with ThreadPoolExecutor(len(bombs)) as pool:
            answers = list(
                pool.map(
                    lambda body: worker.post(
                        "/v1/models/image-classifier/infer", body, ENVELOPE_TYPE
                    ),
                    bombs,
                )
            )
        grown = worker.peak_rss_bytes() - baseline
        assert grown < MEMORY_BOUND, f"peak RSS grew by {grown / 2**20:.0f} MiB"
        for body, (status, answer, _) in zip(bombs, answers, strict=True):
            assert status == 400, answer
            error = answer["error"]
            assert isinstance(error, dict)
            assert error["type"] == "InvalidTensorError"
            assert "refused before decoding" in str(error["message"])
            if body is webp_bomb:
                assert "6300x6300" in str(error["message"])
            else:
                assert "(4096, 4096, 4)" in str(error["message"])

        status, answer = _ordinary(worker)
        assert status == 200, answer
