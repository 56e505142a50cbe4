"""Property suite over the envelope decoder: hostile bytes give typed errors, in bounded memory.

Thousands of generated inputs: arbitrary bytes, valid envelopes of every
encoding with bytes flipped, cut or inserted, and valid envelopes whose header
fields are rewritten (with the checksum fixed up, so the payload decoders are
reached). Decoding, and every accessor, either succeeds or raises a
:class:`~preprocess.PreprocessError`; nothing else escapes. Each input's own peak
memory is measured and bounded. Derandomized, with no example database, so a
run is reproducible and writes nothing.
"""

from __future__ import annotations

import contextlib
import json
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from preprocess import (
    CONTENT_TYPE_FEATURES,
    CONTENT_TYPE_IMAGE,
    CONTENT_TYPE_JSON,
    CONTENT_TYPE_TENSOR,
    CONTENT_TYPE_TEXT,
    Limits,
    PreprocessError,
    decode_envelope,
    encode_envelope,
)

# Small bounds so that every accepted declaration stays cheap to decode.
LIMITS = Limits(
    max_input_bytes=1 << 20,
    max_pixels=1 << 20,
    max_decoded_bytes=4 << 20,
    max_image_bytes=16 << 20,
)
# Far above what the limits let one input decode (a few MiB), far below a bomb.
MEMORY_PER_INPUT = 64 * 1024 * 1024
FUZZ = settings(
    max_examples=1000,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
_PREFIX = struct.Struct("<4sBI")


def _image() -> np.ndarray:
    rng = np.random.default_rng(5)
    return rng.integers(0, 256, (12, 10, 3), dtype=np.uint8)


def _valid_envelopes() -> list[bytes]:
    image = _image()
    tensor = np.linspace(-1, 1, 24, dtype=np.float32).reshape(2, 3, 4)
    table = pa.table({"id": ["a", "b"], "x": [1.5, 2.5]})
    return [
        encode_envelope(image, content_type=CONTENT_TYPE_IMAGE, encoding="raw", layout="HWC"),
        encode_envelope(image, content_type=CONTENT_TYPE_IMAGE, encoding="webp", layout="HWC"),
        encode_envelope(
            np.ascontiguousarray(image.transpose(2, 0, 1)),
            content_type=CONTENT_TYPE_IMAGE,
            encoding="webp-lossless",
            layout="CHW",
        ),
        encode_envelope(tensor, content_type=CONTENT_TYPE_TENSOR, encoding="brotli"),
        encode_envelope(tensor, content_type=CONTENT_TYPE_TENSOR, encoding="arrow"),
        encode_envelope(table, content_type=CONTENT_TYPE_FEATURES, encoding="arrow"),
        encode_envelope(table, content_type=CONTENT_TYPE_FEATURES, encoding="brotli"),
        encode_envelope('{"a": [1, 2]}', content_type=CONTENT_TYPE_JSON, encoding="brotli"),
        encode_envelope("hello", content_type=CONTENT_TYPE_TEXT, encoding="raw"),
    ]


VALID = _valid_envelopes()


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/status")


def _exercise(data: bytes) -> None:
    """Decode and call every accessor; only typed errors may escape, memory stays bounded.

    The process's peak RSS is reset before each input (``/proc/self/clear_refs``),
    so the peak read after it is this input's own cost.
    """
    resident = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    _decode_all(data)
    grown = (_status_kib("VmHWM") - resident) * 1024
    assert grown < MEMORY_PER_INPUT, f"one input cost {grown / 2**20:.0f} MiB of peak RSS"


def _decode_all(data: bytes) -> None:
    try:
        envelope = decode_envelope(data, limits=LIMITS)
    except PreprocessError:
        return
    accessors: list[Callable[[], Any]] = [
        envelope.to_numpy,
        envelope.to_bytes,
        envelope.to_text,
        envelope.to_json,
        envelope.to_arrow,
    ]
    for accessor in accessors:
        with contextlib.suppress(PreprocessError):
            accessor()


def _split(data: bytes) -> tuple[dict[str, Any], bytes]:
    _, _, length = _PREFIX.unpack_from(data)
    header = json.loads(data[_PREFIX.size : _PREFIX.size + length])
    return header, data[_PREFIX.size + length :]


def _frame(header: dict[str, Any], payload: bytes, *, fix: bool) -> bytes:
    if fix:
        header = {**header, "payload_bytes": len(payload), "crc32": zlib.crc32(payload)}
    text = json.dumps(header).encode()
    return _PREFIX.pack(b"EDGF", 1, len(text)) + text + payload


_JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
_HEADER_EDITS = st.fixed_dictionaries(
    {},
    optional={
        "shape": st.one_of(
            st.lists(st.integers(min_value=-2, max_value=2**40), max_size=9),
            # JSON integers are unbounded: products past float and int64 range.
            st.lists(st.integers(min_value=2**31, max_value=10**400), min_size=1, max_size=8),
            st.lists(st.integers(min_value=0, max_value=64), min_size=1, max_size=4),
            _JSON_VALUES,
        ),
        "dtype": st.sampled_from(
            ["uint8", "float32", "int64", "float16", "bool", "object", "<U3", "V8", None, 3]
        ),
        "encoding": st.sampled_from(["raw", "webp", "webp-lossless", "brotli", "arrow", "gzip"]),
        "layout": st.sampled_from(["HWC", "CHW", None, "NCHW", 1]),
        "content_type": st.sampled_from(
            [CONTENT_TYPE_IMAGE, CONTENT_TYPE_TENSOR, CONTENT_TYPE_FEATURES, "x/y", "", 7]
        ),
        "profile": _JSON_VALUES,
        "metadata": _JSON_VALUES,
        "payload_bytes": st.integers(min_value=-1, max_value=2**40),
    },
)


def test_the_valid_envelopes_decode() -> None:
    for data in VALID:
        envelope = decode_envelope(data, limits=LIMITS)
        if envelope.is_array:
            envelope.to_numpy()


@FUZZ
@given(st.binary(max_size=2048) | st.binary(max_size=64).map(lambda tail: b"EDGF\x01" + tail))
def test_arbitrary_bytes_give_typed_errors(data: bytes) -> None:
    _exercise(data)


@FUZZ
@given(
    base=st.sampled_from(VALID),
    edits=st.lists(
        st.tuples(
            st.sampled_from(["flip", "cut", "insert", "delete"]),
            st.integers(min_value=0, max_value=1 << 16),
            st.binary(min_size=1, max_size=16),
        ),
        min_size=1,
        max_size=4,
    ),
    fix_checksum=st.booleans(),
)
def test_mutated_envelopes_give_typed_errors(
    base: bytes, edits: list[tuple[str, int, bytes]], fix_checksum: bool
) -> None:
    header, payload = _split(base)
    buffer = bytearray(payload if fix_checksum else base)
    for kind, where, blob in edits:
        at = where % (len(buffer) + 1)
        if kind == "flip" and buffer:
            buffer[at % len(buffer)] ^= blob[0] or 0x01
        elif kind == "cut":
            del buffer[at:]
        elif kind == "insert":
            buffer[at:at] = blob
        elif kind == "delete":
            del buffer[at : at + len(blob)]
    data = _frame(header, bytes(buffer), fix=True) if fix_checksum else bytes(buffer)
    _exercise(data)


@FUZZ
@given(base=st.sampled_from(VALID), edits=_HEADER_EDITS)
def test_rewritten_headers_give_typed_errors(base: bytes, edits: dict[str, Any]) -> None:
    header, payload = _split(base)
    fix = "payload_bytes" not in edits
    _exercise(_frame({**header, **edits}, payload, fix=fix))
