"""Transport encodings: WebP for images, Brotli for JSON and text, Arrow IPC for tensors.

Each decoder enforces :class:`~preprocess.limits.Limits`: Brotli stops as soon
as its output would pass ``max_decoded_bytes`` (brotli >= 1.2's bounded
``Decompressor.process``), WebP refuses a canvas over ``max_pixels`` before
decoding, Arrow IPC is read uncompressed so its size is bounded by the input.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
from PIL import Image

from preprocess.exceptions import (
    CorruptInputError,
    DecompressionBombError,
    EncodingError,
    EnvelopeError,
    InputTooLargeError,
    UnsupportedInputError,
)
from preprocess.image import decode_image, probe_image
from preprocess.limits import DEFAULT_LIMITS, Limits

try:
    import brotli
except ImportError:  # pragma: no cover - exercised only without the extra
    brotli = None

__all__ = [
    "DEFAULT_BROTLI_QUALITY",
    "arrow_decode_table",
    "arrow_decode_tensor",
    "arrow_encode_table",
    "arrow_encode_tensor",
    "brotli_chunks",
    "brotli_compress",
    "brotli_decompress",
    "webp_decode",
    "webp_encode",
]

# Chosen for latency, measured in benchmarks/preprocess.py (docs/benchmarks.md):
# on a 1.35 MB JSON feature payload quality 4 compresses at ~110 MB/s to a
# ratio of ~4.5 (gzip -6: ~35 MB/s, 4.4); compress + transfer + decompress is
# ties the best level at 10 Mbit/s and is within 5% of it at 100 Mbit/s.
# Qualities 9-11 gain 10-20% in size at 5-100x the CPU time.
DEFAULT_BROTLI_QUALITY = 4
_CHUNK = 64 * 1024


def _brotli() -> Any:
    if brotli is None:
        raise ImportError(
            "Brotli support needs the brotli package: pip install edgefeed[preprocess]"
        )
    return brotli


def _as_hwc_uint8(array: npt.NDArray[Any]) -> npt.NDArray[np.uint8]:
    if array.dtype != np.uint8:
        raise EncodingError(
            f"WebP carries uint8 pixels, got dtype {array.dtype}; use dtype='uint8' "
            "or the raw/arrow/brotli encodings for float tensors"
        )
    if array.ndim == 2:
        array = array[:, :, None]
    if array.ndim != 3 or array.shape[2] not in (1, 3, 4):
        raise EncodingError(
            f"WebP needs an (H, W), (H, W, 1), (H, W, 3) or (H, W, 4) array, got shape "
            f"{array.shape}; transpose CHW to HWC first"
        )
    if max(array.shape[:2]) > 16383:
        raise EncodingError(f"WebP images are at most 16383 pixels a side, got {array.shape[:2]}")
    return array


def webp_encode(
    pixels: npt.NDArray[np.uint8],
    *,
    quality: int = 80,
    method: int = 4,
    lossless: bool = False,
) -> bytes:
    """Encode uint8 ``(H, W[, C])`` pixels (C = 1, 3 or 4) as WebP.

    Args:
        pixels: The image.
        quality: 0-100. Lossy: visual quality. Lossless: effort (higher is smaller, slower).
        method: 0 (fast) to 6 (smallest).
        lossless: Exact pixels; greyscale is stored as RGB and returned as one channel.

    Raises:
        EncodingError: wrong dtype or shape, or settings out of range.
    """
    array = _as_hwc_uint8(np.asarray(pixels))
    if not 0 <= quality <= 100 or not 0 <= method <= 6:
        raise EncodingError(f"WebP quality must be 0-100 and method 0-6, got {quality}, {method}")
    channels = array.shape[2]
    image = Image.fromarray(
        array[:, :, 0] if channels == 1 else array,
        mode={1: "L", 3: "RGB", 4: "RGBA"}[channels],
    )
    if channels == 1:
        image = image.convert("RGB")  # WebP has no greyscale mode
    out = io.BytesIO()
    image.save(out, "WEBP", quality=quality, method=method, lossless=lossless, exact=lossless)
    return out.getvalue()


def webp_decode(
    data: bytes | bytearray | memoryview,
    *,
    channels: int = 3,
    limits: Limits = DEFAULT_LIMITS,
    expect_size: tuple[int, int] | None = None,
) -> npt.NDArray[np.uint8]:
    """Decode WebP to a uint8 ``(H, W, channels)`` array (channels 1, 3 or 4).

    Args:
        data: The WebP stream.
        channels: 1, 3 or 4.
        limits: Input and pixel bounds.
        expect_size: ``(height, width)`` the caller expects; the stream's header is
            checked against it before any pixel is decoded, so a small stream that
            declares a huge canvas costs nothing.

    Raises:
        InputTooLargeError, DecompressionBombError, CorruptInputError, UnsupportedInputError.
        EnvelopeError: the header's size differs from ``expect_size``.
    """
    mode = {1: "L", 3: "RGB", 4: "RGBA"}.get(channels)
    if mode is None:
        raise EncodingError(f"channels must be 1, 3 or 4, got {channels}")
    if not bytes(data[:4]) == b"RIFF" or not bytes(data[8:12]) == b"WEBP":
        raise CorruptInputError(f"not a WebP stream (starts with {bytes(data[:12])!r})")
    if expect_size is not None:
        # The header against the envelope first: a mismatch is the envelope's error
        # (400), whatever the size; decode_image checks the memory budget after.
        info = probe_image(data, limits=limits, budget=False)
        if (info.height, info.width) != tuple(expect_size):
            raise EnvelopeError(
                f"WebP header declares {info.width}x{info.height} pixels, the envelope "
                f"declares {expect_size[1]}x{expect_size[0]}; refused before decoding"
            )
    return decode_image(data, mode=mode, limits=limits)


def brotli_compress(
    data: bytes | bytearray | memoryview | str,
    *,
    quality: int = DEFAULT_BROTLI_QUALITY,
    text: bool = False,
) -> bytes:
    """Brotli-compress ``data`` (a str is UTF-8 encoded first).

    Args:
        data: The payload.
        quality: 0-11; see docs/benchmarks.md for the ratio/speed trade-off measured.
        text: Hint that the payload is UTF-8 text (JSON): slightly better ratio.

    Raises:
        EncodingError: quality out of range.
    """
    if not 0 <= quality <= 11:
        raise EncodingError(f"Brotli quality must be 0-11, got {quality}")
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    lib = _brotli()
    mode = lib.MODE_TEXT if text else lib.MODE_GENERIC
    return bytes(lib.compress(raw, mode=mode, quality=quality))


def brotli_decompress(
    data: bytes | bytearray | memoryview,
    *,
    max_output: int | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> bytes:
    """Decompress a Brotli stream, stopping before the output passes a bound.

    Args:
        data: The compressed stream.
        max_output: Largest output accepted; defaults to ``limits.max_decoded_bytes``.
        limits: Input and output bounds.

    Raises:
        InputTooLargeError: the compressed input is over ``limits.max_input_bytes``.
        DecompressionBombError: the output would pass ``max_output``.
        CorruptInputError: not a valid, complete Brotli stream.
    """
    if len(data) > limits.max_input_bytes:
        raise InputTooLargeError(
            f"compressed payload is {len(data)} bytes, over the limit of "
            f"{limits.max_input_bytes} (Limits.max_input_bytes)"
        )
    bound = limits.max_decoded_bytes if max_output is None else max_output
    return b"".join(brotli_chunks(data, bound))


def brotli_chunks(data: bytes | bytearray | memoryview, bound: int) -> Iterator[bytes]:
    """Decompress a Brotli stream in chunks of at most 64 KiB, never past ``bound`` bytes.

    Lets a caller write the output straight into its destination (an array of
    the declared size) instead of holding the chunks and their concatenation.

    Raises:
        DecompressionBombError: the output would pass ``bound``.
        CorruptInputError: not a valid, complete Brotli stream.
    """
    lib = _brotli()
    decompressor = lib.Decompressor()
    total = 0
    view = memoryview(bytes(data))
    position = 0
    try:
        while True:
            if decompressor.can_accept_more_data():
                if position >= len(view) and decompressor.is_finished():
                    break
                chunk = bytes(view[position : position + _CHUNK])
                position += len(chunk)
            else:
                chunk = b""
            part = decompressor.process(chunk, output_buffer_limit=_CHUNK)
            total += len(part)
            if total > bound:
                raise DecompressionBombError(
                    f"Brotli payload expands past {bound} bytes (Limits.max_decoded_bytes); "
                    "decoding stopped"
                )
            if part:
                yield part
            if decompressor.is_finished():
                break
            if not chunk and not part and position >= len(view):
                raise CorruptInputError(
                    f"Brotli stream is truncated after {len(data)} bytes; resend it"
                )
    except lib.error as exc:
        raise CorruptInputError(f"invalid Brotli stream: {exc}") from None
    if position < len(view):
        raise CorruptInputError("Brotli stream has trailing bytes after its end")


def arrow_encode_tensor(array: npt.NDArray[Any]) -> bytes:
    """Frame an N-d numeric array as one Arrow IPC tensor message.

    Raises:
        EncodingError: a dtype Arrow tensors cannot hold (object, string...).
    """
    if array.dtype.kind not in "biuf":
        raise EncodingError(f"Arrow tensors hold numbers, got dtype {array.dtype}")
    sink = pa.BufferOutputStream()
    pa.ipc.write_tensor(pa.Tensor.from_numpy(np.ascontiguousarray(array)), sink)
    return bytes(sink.getvalue())


def arrow_decode_tensor(data: bytes | bytearray | memoryview) -> npt.NDArray[Any]:
    """Read an Arrow IPC tensor message back into a (read-only, zero-copy) NumPy array.

    Raises:
        CorruptInputError: not a valid Arrow tensor message.
    """
    try:
        tensor = pa.ipc.read_tensor(pa.BufferReader(pa.py_buffer(data)))
        return np.asarray(tensor.to_numpy())
    except (pa.ArrowException, ValueError, OSError) as exc:
        raise CorruptInputError(f"invalid Arrow tensor message: {exc}") from None


def arrow_encode_table(table: pa.Table | pa.RecordBatch) -> bytes:
    """Frame a feature batch as an uncompressed Arrow IPC stream.

    Uncompressed on purpose: compressed IPC buffers declare their own
    decompressed length, which a reader must trust (a decompression-bomb
    vector). Wrap the stream in Brotli when the bytes matter.
    """
    if isinstance(table, pa.RecordBatch):
        table = pa.Table.from_batches([table])
    if not isinstance(table, pa.Table):
        raise EncodingError(f"expected a pyarrow Table or RecordBatch, got {type(table).__name__}")
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue())


def arrow_decode_table(data: bytes | bytearray | memoryview) -> pa.Table:
    """Read an Arrow IPC stream (uncompressed) into a Table.

    Raises:
        CorruptInputError: not a valid stream.
        UnsupportedInputError: the stream uses IPC buffer compression.
    """
    try:
        reader = pa.ipc.open_stream(pa.BufferReader(pa.py_buffer(data)))
        batches = []
        for batch in reader:
            batches.append(batch)
        table = pa.Table.from_batches(batches, schema=reader.schema)
    except pa.ArrowNotImplementedError as exc:
        raise UnsupportedInputError(f"unsupported Arrow stream: {exc}") from None
    except (pa.ArrowException, ValueError, OSError) as exc:
        raise CorruptInputError(f"invalid Arrow IPC stream: {exc}") from None
    # An uncompressed stream is read zero-copy, so its buffers cannot outgrow the
    # input; more means IPC buffer compression, which this reader does not accept.
    if table.get_total_buffer_size() > len(data):
        raise UnsupportedInputError(
            "Arrow IPC streams with buffer compression are not accepted; send an "
            "uncompressed stream (use the brotli encoding to compress it)"
        )
    return table
