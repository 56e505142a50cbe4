"""Request payloads -> numpy arrays: the one place that knows the wire formats.

Accepted bodies (by ``Content-Type``):

``application/x-npy``
    One array in NumPy's ``.npy`` format (no pickles).
``application/octet-stream``
    Raw C-order bytes with ``X-Tensor-Shape: 2,64,64,3`` and ``X-Tensor-Dtype: uint8``.
``application/vnd.edgefeed.envelope``
    The preprocess stage's envelope (``preprocess.encode_envelope``: raw,
    WebP, Brotli or Arrow payloads with shape, dtype and layout in the header).

This is the seam with :mod:`preprocess`: only :func:`decode_envelope_payload`
touches its types.
"""

from __future__ import annotations

import io
import math
import tokenize
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from preprocess import CONTENT_TYPE_IMAGE, Envelope, decode_envelope
from preprocess.exceptions import DecompressionBombError, InputTooLargeError, PreprocessError
from workers.exceptions import (
    InvalidTensorError,
    PayloadTooLargeError,
    UnsupportedMediaTypeError,
)

__all__ = [
    "ENVELOPE_TYPE",
    "ENVELOPE_TYPES",
    "NPY_TYPE",
    "RAW_TYPE",
    "InputSpec",
    "decode_array",
    "decode_envelope_payload",
    "encode_npy",
]

NPY_TYPE = "application/x-npy"
RAW_TYPE = "application/octet-stream"
ENVELOPE_TYPE = "application/vnd.edgefeed.envelope"
ENVELOPE_TYPES = (ENVELOPE_TYPE,)
SHAPE_HEADER = "X-Tensor-Shape"
DTYPE_HEADER = "X-Tensor-Dtype"

_ALLOWED_DTYPES = {"uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64"}


@dataclass(frozen=True, slots=True)
class InputSpec:
    """What a model takes, checked against a body's declared shape before decoding.

    A small body can declare a huge array (a Brotli or WebP envelope, an
    ``.npy`` header); comparing the declaration with the model's input first
    keeps the cost of a hostile body at the size of its header.

    Attributes:
        row_shape: Shape of one row.
        dtype: NumPy dtype name.
        max_rows: Most rows one request may carry.
        model: Model name, for messages.
    """

    row_shape: tuple[int, ...]
    dtype: str
    max_rows: int
    model: str = "model"

    def check(self, shape: Sequence[int], dtype: str, what: str) -> None:
        """Refuse a declared ``shape``/``dtype`` the model cannot take.

        Raises:
            InvalidTensorError: naming the declared and the accepted shape and dtype.
        """
        shape = tuple(shape)
        where = f"(declared by the {what}; refused before decoding)"
        if dtype != self.dtype:
            raise InvalidTensorError(
                f"model {self.model!r} takes dtype {self.dtype}, got {dtype} {where}"
            )
        if shape != self.row_shape and shape[1:] != self.row_shape:
            dims = ",".join(str(dim) for dim in self.row_shape)
            raise InvalidTensorError(
                f"model {self.model!r} takes shape ({dims}) or (n,{dims}), got "
                f"{_clip(str(shape))} {where}"
            )
        rows = 1 if shape == self.row_shape else shape[0]
        if not 1 <= rows <= self.max_rows:
            raise InvalidTensorError(
                f"request holds {rows} rows; this worker takes 1 to {self.max_rows} "
                f"per request (split it) {where}"
            )


def _clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def encode_npy(array: np.ndarray) -> bytes:
    """Serialize ``array`` as ``.npy`` bytes (what :data:`NPY_TYPE` bodies hold)."""
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return buffer.getvalue()


def _media_type(content_type: str | None) -> str:
    return (content_type or "").split(";", 1)[0].strip().lower()


# A plain .npy or raw body this small decodes in tens of microseconds (a header and
# one copy): less than handing it to a thread and back, which cost about as much as
# the decode itself at 64 clients (docs/benchmarks.md, the serving peers).
INLINE_DECODE_MAX_BYTES = 64 * 1024


def decodes_inline(body: bytes, content_type: str | None) -> bool:
    """Whether :func:`decode_array` of this body is cheap enough for the event loop:
    an uncompressed ``.npy`` or raw tensor of at most :data:`INLINE_DECODE_MAX_BYTES`.
    Envelopes (Brotli, WebP) and larger bodies go to a thread."""
    return len(body) <= INLINE_DECODE_MAX_BYTES and _media_type(content_type) in (
        NPY_TYPE,
        RAW_TYPE,
    )


def decode_array(
    body: bytes,
    content_type: str | None,
    headers: Mapping[str, str] | None = None,
    *,
    max_bytes: int | None = None,
    spec: InputSpec | None = None,
) -> np.ndarray:
    """Decode a request body into one array.

    With ``spec``, what the body declares (an envelope's or ``.npy`` header's
    shape and dtype) is checked against the model's input before any payload
    is decompressed or decoded.

    Raises:
        PayloadTooLargeError: ``body`` is over ``max_bytes``.
        UnsupportedMediaTypeError: unknown ``content_type``.
        InvalidTensorError: the body does not hold what its headers say.
    """
    if max_bytes is not None and len(body) > max_bytes:
        raise PayloadTooLargeError(
            f"payload of {len(body)} bytes is over the limit of {max_bytes} bytes; "
            "preprocess (resize) at the edge or raise max_payload_bytes"
        )
    media = _media_type(content_type)
    if media == NPY_TYPE:
        return _decode_npy(body, spec)
    if media == RAW_TYPE:
        return _decode_raw(body, headers or {})
    if media in ENVELOPE_TYPES:
        return decode_envelope_payload(body, max_bytes=max_bytes, spec=spec)
    accepted = ", ".join((NPY_TYPE, RAW_TYPE, *ENVELOPE_TYPES))
    raise UnsupportedMediaTypeError(
        f"Content-Type {content_type or '(none)'!r} is not accepted; send one of: {accepted}"
    )


def _npy_header(body: bytes) -> tuple[tuple[int, ...], np.dtype[np.generic]]:
    """Shape and dtype an ``.npy`` header declares, read without touching the data."""
    stream = io.BytesIO(body)
    try:
        version = np.lib.format.read_magic(stream)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(stream)
        else:
            shape, _, dtype = np.lib.format.read_array_header_2_0(stream)
    except (ValueError, OSError, EOFError, SyntaxError, tokenize.TokenError) as exc:
        raise InvalidTensorError(
            f"body is not a valid .npy array without pickles ({_clip(str(exc))}); "
            "write it with numpy.save(..., allow_pickle=False)"
        ) from None
    return tuple(int(dim) for dim in shape), dtype


def _decode_npy(body: bytes, spec: InputSpec | None = None) -> np.ndarray:
    if not body.startswith(b"\x93NUMPY"):
        raise InvalidTensorError(
            f"body ({len(body)} bytes) is not .npy: it lacks the \\x93NUMPY magic; write it "
            "with numpy.save(..., allow_pickle=False) or send application/octet-stream"
        )
    shape, dtype = _npy_header(body)
    if dtype.hasobject:
        raise InvalidTensorError(
            "body is not a valid .npy array without pickles (it holds Python objects); "
            "write it with numpy.save(..., allow_pickle=False)"
        )
    declared = math.prod(shape) * dtype.itemsize  # Python ints: no overflow
    if declared > len(body):
        raise InvalidTensorError(
            f"body is not a valid .npy array: its header declares {declared} bytes of data "
            f"({dtype.name} {_clip(str(shape))}), the body has {len(body)}: truncated or "
            "forged; refused before decoding"
        )
    if spec is not None:
        spec.check(shape, dtype.name, ".npy header")
    try:
        array = np.load(io.BytesIO(body), allow_pickle=False)
    except ValueError as exc:
        raise InvalidTensorError(
            f"body is not a valid .npy array without pickles ({exc}); "
            "write it with numpy.save(..., allow_pickle=False)"
        ) from None
    except (OSError, EOFError) as exc:
        raise InvalidTensorError(f"body is not a valid .npy array: {exc}") from None
    if not isinstance(array, np.ndarray):
        raise InvalidTensorError("body holds an .npz archive; send one array as .npy")
    return array


MAX_TENSOR_DIMS = 16  # a raw body's X-Tensor-Shape (numpy's own limit is 64)


def _decode_raw(body: bytes, headers: Mapping[str, str]) -> np.ndarray:
    lowered = {key.lower(): value for key, value in headers.items()}
    shape_text = lowered.get(SHAPE_HEADER.lower())
    dtype_text = lowered.get(DTYPE_HEADER.lower(), "").strip().lower()
    if shape_text is None or not dtype_text:
        raise InvalidTensorError(
            f"{RAW_TYPE} bodies need headers {SHAPE_HEADER} (e.g. 1,64,64,3) and "
            f"{DTYPE_HEADER} (e.g. uint8)"
        )
    try:
        shape = tuple(int(part) for part in shape_text.split(",") if part.strip())
    except ValueError:
        raise InvalidTensorError(
            f"{SHAPE_HEADER} {shape_text!r} must be comma-separated integers such as 1,64,64,3"
        ) from None
    if not shape or any(dim < 0 for dim in shape):
        raise InvalidTensorError(f"{SHAPE_HEADER} {shape_text!r} must list non-negative sizes")
    if len(shape) > MAX_TENSOR_DIMS:
        raise InvalidTensorError(
            f"{SHAPE_HEADER} has {len(shape)} dimensions; a tensor may have at most "
            f"{MAX_TENSOR_DIMS} (e.g. 1,64,64,3)"
        )
    if dtype_text not in _ALLOWED_DTYPES:
        raise InvalidTensorError(
            f"{DTYPE_HEADER} {dtype_text!r} is not one of: {', '.join(sorted(_ALLOWED_DTYPES))}"
        )
    dtype = np.dtype(dtype_text).newbyteorder("<")
    expected = math.prod(shape) * dtype.itemsize
    if len(body) != expected:
        raise InvalidTensorError(
            f"body has {len(body)} bytes but shape {shape} of {dtype_text} needs {expected}"
        )
    return np.frombuffer(body, dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="))


def decode_envelope_payload(
    body: bytes, *, max_bytes: int | None = None, spec: InputSpec | None = None
) -> np.ndarray:
    """Decode a preprocess envelope and return its array.

    Image envelopes (``image/x-tensor``) in ``CHW`` layout are returned as
    ``HWC``, the layout the workers' image models take.

    Raises:
        PayloadTooLargeError: the envelope, or what it decodes to, is over a limit.
        InvalidTensorError: the envelope is malformed or holds no array (the
            preprocess error's message is kept).
    """
    try:
        envelope = decode_envelope(body, max_bytes=max_bytes)
        if spec is not None:
            _check_envelope(envelope, spec)
        array = envelope.to_numpy()
    except (InputTooLargeError, DecompressionBombError) as exc:
        raise PayloadTooLargeError(f"envelope rejected: {exc}") from None
    except PreprocessError as exc:
        raise InvalidTensorError(f"envelope rejected: {exc}") from None
    if _is_chw_image(envelope):
        array = np.moveaxis(array, -3, -1)
    return np.asarray(array)


def _is_chw_image(envelope: Envelope) -> bool:
    return envelope.content_type == CONTENT_TYPE_IMAGE and envelope.layout == "CHW"


def _check_envelope(envelope: Envelope, spec: InputSpec) -> None:
    """The envelope's declared array against the model's input, before decoding."""
    if envelope.shape is None or envelope.dtype is None:
        raise InvalidTensorError(
            f"envelope of {_clip(envelope.content_type)!r} holds no array; model "
            f"{spec.model!r} takes {spec.dtype} arrays"
        )
    shape = envelope.shape
    if _is_chw_image(envelope) and len(shape) >= 3:
        shape = (*shape[:-3], shape[-2], shape[-1], shape[-3])  # served as HWC
    spec.check(shape, envelope.dtype, "envelope")
