"""Bodies whose headers lie about sizes, or do not parse, are typed 4xx errors.

JSON and .npy headers carry unbounded integers; a product of dimensions must
neither overflow a float nor wrap an int64, and a header that does not even
tokenize must not escape as an internal error.
"""

from __future__ import annotations

import json
import struct
import zlib

import pytest

from workers.exceptions import InvalidTensorError, PayloadTooLargeError
from workers.inputs import ENVELOPE_TYPE, NPY_TYPE, RAW_TYPE, InputSpec, decode_array

SPEC = InputSpec((32, 32, 3), "uint8", 32, "image-classifier")


def _npy(header: str) -> bytes:
    text = header.encode()
    pad = (64 - (10 + len(text) + 1) % 64) % 64
    text += b" " * pad + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text


def _envelope(shape: list[int]) -> bytes:
    payload = b"abc"
    header = {
        "content_type": "application/x-tensor",
        "encoding": "raw",
        "shape": shape,
        "dtype": "uint8",
        "payload_bytes": len(payload),
        "crc32": zlib.crc32(payload),
    }
    text = json.dumps(header).encode()
    return struct.pack("<4sBI", b"EDGF", 1, len(text)) + text + payload


@pytest.mark.parametrize(
    "header",
    [
        "{'descr': '|u1', 'fortran_order': False, 'shape': (1,",  # does not tokenize
        f"{{'descr': '|u1', 'fortran_order': False, 'shape': ({10**300},), }}",
        "{'descr': '<f8', 'fortran_order': False, 'shape': (4294967296, 4294967296), }",
    ],
    ids=["unterminated", "googol-cubed", "int64-wrap"],
)
def test_npy_headers_that_lie_or_do_not_parse_are_invalid_tensors(header: str) -> None:
    with pytest.raises(InvalidTensorError, match=r"not a valid \.npy array"):
        decode_array(_npy(header), NPY_TYPE, spec=SPEC)


@pytest.mark.parametrize("shape", [[10**400], [2**200] * 8, [2**32, 2**32]])
def test_envelope_shapes_past_every_numeric_range_are_refused(shape: list[int]) -> None:
    with pytest.raises((InvalidTensorError, PayloadTooLargeError)):
        decode_array(_envelope(shape), ENVELOPE_TYPE, spec=SPEC)


def test_raw_shape_headers_past_int64_are_refused() -> None:
    headers = {"X-Tensor-Shape": "4294967296,4294967296,1", "X-Tensor-Dtype": "uint8"}
    with pytest.raises(InvalidTensorError, match="needs 18446744073709551616"):
        decode_array(b"\x00", RAW_TYPE, headers)
