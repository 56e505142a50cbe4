"""Errors of the preprocess package.

Every error derives from :class:`PreprocessError`, itself an
:class:`~edgefeed.errors.EdgefeedError`. Errors caused by the input (too big,
corrupt, a decompression bomb, a malformed envelope) also derive from
:class:`ValueError`, so an HTTP front end maps them to a 4xx answer and keeps
serving. None of them is retryable: the same bytes fail the same way.

The constructors take one message string only, so the errors pickle cleanly
across the process pool of :func:`preprocess.preprocess_batch`.
"""

from __future__ import annotations

from edgefeed_base.errors import EdgefeedError

__all__ = [
    "CorruptInputError",
    "DecompressionBombError",
    "EncodingError",
    "EnvelopeError",
    "InputTooLargeError",
    "PreprocessError",
    "UnknownProfileError",
    "UnsupportedInputError",
    "WorkerCrashedError",
]


class PreprocessError(EdgefeedError):
    """Base class of every error the preprocess package raises on purpose. Not retryable."""

    retryable = False


class InputTooLargeError(PreprocessError, ValueError):
    """The input has more bytes than ``Limits.max_input_bytes`` (or ``max_bytes``) allows.

    Not retryable: send a smaller input or raise the limit.
    """


class DecompressionBombError(PreprocessError, ValueError):
    """The input would expand past a limit when decoded.

    Raised for an image whose header declares more pixels than
    ``Limits.max_pixels`` (checked before any pixel is decoded) and for a Brotli
    stream whose output would exceed ``Limits.max_decoded_bytes`` (decoding stops
    at the limit). Not retryable.
    """


class CorruptInputError(PreprocessError, ValueError):
    """The input is truncated, damaged or not in the format it claims. Not retryable."""


class UnsupportedInputError(PreprocessError, ValueError):
    """The input is well formed but of a kind this stage does not handle.

    For example an image format other than JPEG, PNG and WebP, or an array of a
    dtype or shape an encoding cannot carry. Not retryable: convert it first.
    """


class EnvelopeError(PreprocessError, ValueError):
    """A request envelope is malformed: bad magic, unknown version, bad header,
    a payload that does not match its declared shape, dtype or checksum. Not retryable.
    """


class EncodingError(PreprocessError, ValueError):
    """A value cannot be encoded as asked (wrong dtype or layout for WebP, bad
    quality setting, unknown encoding). Not retryable: fix the call.
    """


class UnknownProfileError(PreprocessError, ValueError):
    """No image profile is registered under the requested name. Not retryable."""


class WorkerCrashedError(PreprocessError):
    """A process of the preprocessing pool died (killed, out of memory, a crash in
    a native decoder) while handling an input. The input may be the cause, so this
    is not marked retryable; the pool is rebuilt for the next call.
    """
