"""The request envelope: one self-describing frame that the model workers decode.

Wire format (all integers little-endian)::

    b"EDGF"            4 bytes  magic
    version            1 byte   ENVELOPE_VERSION (1)
    header_length      4 bytes  uint32, at most 64 KiB
    header             JSON (UTF-8), keys below
    payload            header["payload_bytes"] bytes

Header keys: ``content_type``, ``encoding``, ``shape`` (list or null),
``dtype`` (NumPy name or null), ``layout`` (``"HWC"``/``"CHW"``/null),
``profile`` (image profile name or null), ``metadata`` (str -> str),
``payload_bytes`` and ``crc32`` (of the payload, detects truncation and
corruption).

Encodings: ``raw`` (little-endian C-order bytes of the array, or opaque
bytes), ``webp`` / ``webp-lossless`` (uint8 images), ``brotli`` (text, JSON or
an array's raw bytes), ``arrow`` (an Arrow IPC tensor for arrays, an Arrow IPC
stream for feature tables). ``raw``, ``webp-lossless``, ``brotli`` and ``arrow``
round-trip exactly.
"""

from __future__ import annotations

import json
import math
import re
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal, get_args

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from preprocess.codecs import (
    DEFAULT_BROTLI_QUALITY,
    arrow_decode_table,
    arrow_decode_tensor,
    arrow_encode_table,
    arrow_encode_tensor,
    brotli_chunks,
    brotli_compress,
    brotli_decompress,
    webp_decode,
    webp_encode,
)
from preprocess.exceptions import EncodingError, EnvelopeError, InputTooLargeError
from preprocess.limits import DEFAULT_LIMITS, Limits

__all__ = [
    "CONTENT_TYPE_FEATURES",
    "CONTENT_TYPE_IMAGE",
    "CONTENT_TYPE_JSON",
    "CONTENT_TYPE_TENSOR",
    "CONTENT_TYPE_TEXT",
    "ENVELOPE_VERSION",
    "Encoding",
    "Envelope",
    "decode_envelope",
    "encode_envelope",
]

Encoding = Literal["raw", "webp", "webp-lossless", "brotli", "arrow"]
ENCODINGS: Final = frozenset(get_args(Encoding))
ENVELOPE_VERSION: Final = 1
MAGIC: Final = b"EDGF"
_PREFIX = struct.Struct("<4sBI")
_MAX_HEADER = 64 * 1024

CONTENT_TYPE_IMAGE: Final = "image/x-tensor"
"""A preprocessed image (``layout`` and ``profile`` say how it was made)."""
CONTENT_TYPE_TENSOR: Final = "application/x-tensor"
"""Any other numeric array."""
CONTENT_TYPE_FEATURES: Final = "application/vnd.apache.arrow.stream"
"""A feature batch (an Arrow table)."""
CONTENT_TYPE_JSON: Final = "application/json"
CONTENT_TYPE_TEXT: Final = "text/plain"

_CONTENT_TYPE = re.compile(r"^[a-z0-9][a-z0-9!#$&^_.+-]*/[a-z0-9][a-z0-9!#$&^_.+-]*$")
# Numbers only: an object dtype in a header must never reach np.frombuffer.
_DTYPES: Final = frozenset(
    {
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
    }
)
_MAX_DIMS = 8


@dataclass(frozen=True, slots=True)
class Envelope:
    """A decoded envelope. The payload stays encoded until asked for.

    Attributes:
        content_type: What the payload is (``image/x-tensor``, ``application/json``...).
        encoding: How it is encoded (``raw``, ``webp``, ``webp-lossless``, ``brotli``, ``arrow``).
        shape: Array shape, or None for bytes, text and JSON.
        dtype: NumPy dtype name, or None for bytes, text and JSON.
        version: Envelope format version.
        layout: ``"HWC"``/``"CHW"`` for images, else None.
        profile: Name of the image profile that produced the tensor, if any.
        metadata: Free string pairs (request id, model name...).
        payload: The encoded payload bytes.
        limits: Bounds applied when the payload is decoded.
    """

    content_type: str
    encoding: Encoding
    shape: tuple[int, ...] | None
    dtype: str | None
    version: int
    layout: str | None = None
    profile: str | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)
    payload: bytes = field(default=b"", repr=False)
    limits: Limits = field(default=DEFAULT_LIMITS, repr=False)

    @property
    def is_array(self) -> bool:
        """True when the payload is a numeric array (``to_numpy`` applies)."""
        return self.shape is not None and self.dtype is not None

    def to_numpy(self) -> npt.NDArray[Any]:
        """The array, with the declared shape, dtype and layout.

        For image tensors this is the preprocessed uint8 or float array in
        ``layout``. Raw and Arrow payloads are returned zero-copy (read-only).

        Raises:
            EnvelopeError: the envelope holds no array (JSON, text, bytes), or the
                decoded payload does not match the declared shape and dtype.
            DecompressionBombError, CorruptInputError: from the payload's codec.
        """
        if self.shape is None or self.dtype is None:
            raise EnvelopeError(
                f"envelope of {self.content_type!r} holds no array; use to_bytes(), "
                "to_text(), to_json() or to_arrow()"
            )
        native = np.dtype(self.dtype)
        wire = native.newbyteorder("<")
        expected = math.prod(self.shape) * native.itemsize  # exact: no int64 wrap-around
        if self.encoding in ("webp", "webp-lossless"):
            return self._webp_array()
        if self.encoding == "arrow":
            array = arrow_decode_tensor(self.payload)
            if array.dtype != native or array.shape != self.shape:
                raise EnvelopeError(
                    f"Arrow tensor is {array.dtype} {array.shape}, the header declares "
                    f"{self.dtype} {self.shape}"
                )
            return array
        raw: bytes | bytearray = (
            self._brotli_exact(expected) if self.encoding == "brotli" else self.payload
        )
        if len(raw) != expected:
            raise EnvelopeError(
                f"payload decodes to {len(raw)} bytes, the header's shape {self.shape} of "
                f"{self.dtype} needs {expected}"
            )
        array = np.frombuffer(raw, dtype=wire)
        if wire != native:  # big-endian host: swap once into native order
            array = array.astype(native)
        return array.reshape(self.shape)

    def _brotli_exact(self, expected: int) -> bytearray:
        """Decompress into a buffer of the declared size: one copy of the output, no more."""
        if len(self.payload) > self.limits.max_input_bytes:
            raise InputTooLargeError(
                f"compressed payload is {len(self.payload)} bytes, over the limit of "
                f"{self.limits.max_input_bytes} (Limits.max_input_bytes)"
            )
        out = bytearray(expected)
        filled = 0
        for part in brotli_chunks(self.payload, expected):
            out[filled : filled + len(part)] = part
            filled += len(part)
        if filled != expected:
            raise EnvelopeError(
                f"payload decodes to {filled} bytes, the header's shape {self.shape} of "
                f"{self.dtype} needs {expected}"
            )
        return out

    def _webp_array(self) -> npt.NDArray[np.uint8]:
        shape = self.shape or ()
        if len(shape) not in (2, 3) or self.dtype != "uint8":
            raise EnvelopeError(
                f"a WebP payload holds a uint8 (H, W) or 3-d image, the header declares "
                f"{self.dtype} {shape}"
            )
        chw = self.layout == "CHW" and len(shape) == 3
        channels = (shape[0] if chw else shape[2]) if len(shape) == 3 else 1
        height, width = shape[1:] if chw else shape[:2]
        # The WebP header is checked against the declared shape before decoding:
        # a few bytes of lossless WebP can declare a 40-megapixel canvas.
        pixels = webp_decode(
            self.payload, channels=channels, limits=self.limits, expect_size=(height, width)
        )
        if chw:
            pixels = np.ascontiguousarray(pixels.transpose(2, 0, 1))
        elif len(shape) == 2:
            pixels = pixels[:, :, 0]
        if pixels.shape != self.shape:
            raise EnvelopeError(
                f"WebP payload decodes to shape {pixels.shape}, the header declares {self.shape}"
            )
        return pixels

    def to_bytes(self) -> bytes:
        """The payload with its transport encoding removed (Brotli decompressed).

        Raises:
            EnvelopeError: WebP and Arrow payloads have no plain-bytes form.
        """
        if self.encoding == "raw":
            return self.payload
        if self.encoding == "brotli":
            return brotli_decompress(self.payload, limits=self.limits)
        raise EnvelopeError(
            f"a {self.encoding!r} payload has no plain-bytes form; use to_numpy() or to_arrow()"
        )

    def to_text(self) -> str:
        """The payload as UTF-8 text.

        Raises:
            EnvelopeError: not valid UTF-8.
        """
        try:
            return self.to_bytes().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise EnvelopeError(f"payload is not UTF-8 text: {exc}") from None

    def to_json(self) -> Any:
        """The payload parsed as JSON.

        Raises:
            EnvelopeError: not valid JSON.
        """
        try:
            return json.loads(self.to_text())
        except json.JSONDecodeError as exc:
            raise EnvelopeError(f"payload is not valid JSON: {exc}") from None

    def to_arrow(self) -> pa.Table:
        """The feature batch of an ``arrow`` envelope (or of Brotli over an Arrow stream).

        Raises:
            EnvelopeError: the payload is not an Arrow stream.
        """
        if self.encoding == "arrow" and not self.is_array:
            return arrow_decode_table(self.payload)
        if self.encoding == "brotli" and self.content_type == CONTENT_TYPE_FEATURES:
            return arrow_decode_table(self.to_bytes())
        raise EnvelopeError(
            f"envelope ({self.content_type!r}, {self.encoding!r}) holds no Arrow table"
        )


def _check_content_type(content_type: str) -> None:
    if not isinstance(content_type, str) or len(content_type) > 127:
        raise EncodingError(f"content_type must be a MIME type string, got {content_type!r}")
    if not _CONTENT_TYPE.match(content_type):
        raise EncodingError(
            f"content_type {content_type!r} is not a MIME type like 'image/x-tensor' "
            "or 'application/json'"
        )


def _array_payload(
    array: npt.NDArray[Any],
    encoding: Encoding,
    layout: str | None,
    webp_quality: int,
    webp_method: int,
    brotli_quality: int,
) -> bytes:
    if array.dtype.name not in _DTYPES:
        raise EncodingError(
            f"dtype {array.dtype} cannot travel in an envelope; "
            f"use one of {', '.join(sorted(_DTYPES))}"
        )
    if array.ndim > _MAX_DIMS:
        raise EncodingError(f"arrays of at most {_MAX_DIMS} dimensions, got {array.ndim}")
    if encoding in ("webp", "webp-lossless"):
        pixels = array
        if layout == "CHW":
            if array.ndim != 3:
                raise EncodingError(f"layout CHW needs a 3-d array, got shape {array.shape}")
            pixels = array.transpose(1, 2, 0)
        elif layout not in (None, "HWC"):
            raise EncodingError(f"layout must be 'HWC' or 'CHW', got {layout!r}")
        return webp_encode(
            pixels,
            quality=webp_quality,
            method=webp_method,
            lossless=encoding == "webp-lossless",
        )
    if encoding == "arrow":
        return arrow_encode_tensor(array)
    raw = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
    if encoding == "brotli":
        return brotli_compress(raw, quality=brotli_quality)
    return raw


def encode_envelope(
    value: npt.NDArray[Any] | bytes | bytearray | memoryview | str | pa.Table | pa.RecordBatch,
    *,
    content_type: str,
    encoding: Encoding,
    layout: Literal["HWC", "CHW"] | None = None,
    profile: str | None = None,
    metadata: Mapping[str, str] | None = None,
    webp_quality: int = 80,
    webp_method: int = 4,
    brotli_quality: int = DEFAULT_BROTLI_QUALITY,
) -> bytes:
    """Frame ``value`` as one self-describing envelope.

    Args:
        value: A NumPy array (tensor or image), bytes, text (encoded as UTF-8),
            or an Arrow table/record batch (``encoding="arrow"`` or ``"brotli"``).
        content_type: MIME type of what the payload is; see the ``CONTENT_TYPE_*``
            constants.
        encoding: ``raw``, ``webp`` (lossy), ``webp-lossless``, ``brotli`` or ``arrow``.
        layout: ``"HWC"``/``"CHW"`` for image arrays. WebP stores HWC; a CHW
            array is transposed for encoding and back on decode.
        profile: Name of the image profile that produced the array.
        metadata: Extra string pairs carried in the header.
        webp_quality: Lossy WebP quality 0-100 (lossless: effort).
        webp_method: WebP method 0 (fast) to 6 (small).
        brotli_quality: Brotli quality 0-11.

    Returns:
        The envelope bytes.

    Raises:
        EncodingError: the value cannot be carried by ``encoding`` (float pixels
            as WebP, a table as raw...), or a bad argument.
    """
    _check_content_type(content_type)
    if encoding not in ENCODINGS:
        raise EncodingError(f"encoding {encoding!r} is not one of {', '.join(sorted(ENCODINGS))}")
    shape: list[int] | None = None
    dtype: str | None = None
    if isinstance(value, np.ndarray):
        payload = _array_payload(value, encoding, layout, webp_quality, webp_method, brotli_quality)
        shape, dtype = list(value.shape), value.dtype.name
    elif isinstance(value, pa.Table | pa.RecordBatch):
        if encoding not in ("arrow", "brotli"):
            raise EncodingError(f"an Arrow table travels as 'arrow' or 'brotli', not {encoding!r}")
        payload = arrow_encode_table(value)
        if encoding == "brotli":
            payload = brotli_compress(payload, quality=brotli_quality)
    elif isinstance(value, bytes | bytearray | memoryview | str):
        if encoding not in ("raw", "brotli"):
            raise EncodingError(
                f"bytes and text travel as 'raw' or 'brotli', not {encoding!r}; "
                "pass a NumPy array for WebP or Arrow"
            )
        text = isinstance(value, str) or content_type in (CONTENT_TYPE_JSON, CONTENT_TYPE_TEXT)
        data = value.encode("utf-8") if isinstance(value, str) else bytes(value)
        payload = (
            brotli_compress(data, quality=brotli_quality, text=text)
            if encoding == "brotli"
            else data
        )
    else:
        raise EncodingError(
            f"cannot encode a {type(value).__name__}; pass a NumPy array, bytes, str "
            "or a pyarrow Table"
        )
    meta = dict(metadata or {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise EncodingError("metadata keys and values must be strings")
    header = {
        "content_type": content_type,
        "encoding": encoding,
        "shape": shape,
        "dtype": dtype,
        "layout": layout,
        "profile": profile,
        "metadata": meta,
        "payload_bytes": len(payload),
        "crc32": zlib.crc32(payload),
    }
    header_bytes = json.dumps(header, separators=(",", ":"), sort_keys=True).encode("utf-8")
    if len(header_bytes) > _MAX_HEADER:
        raise EncodingError(f"envelope header is {len(header_bytes)} bytes, over {_MAX_HEADER}")
    return _PREFIX.pack(MAGIC, ENVELOPE_VERSION, len(header_bytes)) + header_bytes + payload


def _field(header: Mapping[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    value = header.get(key)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise EnvelopeError(f"envelope header field {key!r} is missing or invalid: {value!r}")
    return value


def decode_envelope(
    data: bytes | bytearray | memoryview,
    *,
    max_bytes: int | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> Envelope:
    """Parse and check an envelope; the payload is decoded later, on demand.

    Args:
        data: The envelope bytes.
        max_bytes: Refuse envelopes larger than this (default ``limits.max_input_bytes``).
        limits: Bounds applied now and when the payload is decoded.

    Raises:
        InputTooLargeError: ``data`` is over ``max_bytes``.
        EnvelopeError: bad magic, unsupported version, malformed header, a payload
            whose length or checksum differs from the header, or a shape and
            dtype that do not fit the payload.
    """
    bound = limits.max_input_bytes if max_bytes is None else max_bytes
    if len(data) > bound:
        raise InputTooLargeError(
            f"envelope is {len(data)} bytes, over the limit of {bound} bytes; "
            "send a smaller payload or raise max_bytes"
        )
    raw = bytes(data)
    if len(raw) < _PREFIX.size:
        raise EnvelopeError(f"envelope is truncated: {len(raw)} bytes, not even a header")
    magic, version, header_length = _PREFIX.unpack_from(raw)
    if magic != MAGIC:
        raise EnvelopeError(
            f"not an edgefeed envelope (starts with {raw[:4]!r}, expected {MAGIC!r})"
        )
    if version != ENVELOPE_VERSION:
        raise EnvelopeError(
            f"envelope version {version} is not supported (this build reads version "
            f"{ENVELOPE_VERSION}); upgrade edgefeed on the receiving side"
        )
    if header_length > _MAX_HEADER or _PREFIX.size + header_length > len(raw):
        raise EnvelopeError(f"envelope header length {header_length} is invalid or truncated")
    try:
        header = json.loads(raw[_PREFIX.size : _PREFIX.size + header_length])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EnvelopeError(f"envelope header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise EnvelopeError("envelope header must be a JSON object")
    payload = raw[_PREFIX.size + header_length :]
    declared = _field(header, "payload_bytes", int)
    if declared != len(payload):
        raise EnvelopeError(
            f"envelope payload is {len(payload)} bytes, the header declares {declared}: "
            "truncated or padded in transit"
        )
    if zlib.crc32(payload) != _field(header, "crc32", int):
        raise EnvelopeError("envelope payload checksum mismatch: corrupted in transit")
    content_type = _field(header, "content_type", str)
    encoding = _field(header, "encoding", str)
    if encoding not in ENCODINGS:
        raise EnvelopeError(f"envelope encoding {encoding!r} is unknown")
    shape_value = header.get("shape")
    dtype = header.get("dtype")
    shape: tuple[int, ...] | None = None
    if shape_value is not None or dtype is not None:
        if (
            not isinstance(shape_value, list)
            or len(shape_value) > _MAX_DIMS
            or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape_value
            )
        ):
            raise EnvelopeError(f"envelope shape {shape_value!r} is invalid")
        if dtype not in _DTYPES:
            raise EnvelopeError(f"envelope dtype {dtype!r} is not a supported numeric dtype")
        shape = tuple(shape_value)
        # Python ints: JSON sizes are unbounded and must neither overflow nor wrap.
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        if nbytes > limits.max_decoded_bytes:
            raise EnvelopeError(
                f"envelope declares a {nbytes}-byte array, over Limits.max_decoded_bytes "
                f"({limits.max_decoded_bytes})"
            )
        if encoding == "raw" and nbytes != len(payload):
            raise EnvelopeError(
                f"raw payload is {len(payload)} bytes, shape {shape} of {dtype} needs {nbytes}"
            )
    layout = header.get("layout")
    if layout not in (None, "HWC", "CHW"):
        raise EnvelopeError(f"envelope layout {layout!r} is not HWC or CHW")
    profile = header.get("profile")
    metadata = header.get("metadata") or {}
    if not isinstance(profile, str | None) or not isinstance(metadata, dict):
        raise EnvelopeError("envelope profile or metadata field is invalid")
    return Envelope(
        content_type=content_type,
        encoding=encoding,
        shape=shape,
        dtype=dtype,
        version=version,
        layout=layout,
        profile=profile,
        metadata={str(k): str(v) for k, v in metadata.items()},
        payload=payload,
        limits=limits,
    )
