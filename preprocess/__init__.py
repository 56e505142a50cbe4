"""Edge preprocessing: shrink payloads before they reach the model workers.

Images are decoded, oriented, resized, cropped and normalised as an
:class:`ImageProfile` declares (the same code for training and serving);
payloads travel in a self-describing envelope encoded as raw bytes, WebP,
Brotli or Arrow IPC. Every decoder is bounded by :class:`Limits` and fails with
a typed :class:`PreprocessError`.
"""

from __future__ import annotations

from preprocess.batch import BatchResult, PreprocessPool, preprocess_batch, read_input
from preprocess.codecs import (
    DEFAULT_BROTLI_QUALITY,
    arrow_decode_table,
    arrow_decode_tensor,
    arrow_encode_table,
    arrow_encode_tensor,
    brotli_compress,
    brotli_decompress,
    webp_decode,
    webp_encode,
)
from preprocess.envelope import (
    CONTENT_TYPE_FEATURES,
    CONTENT_TYPE_IMAGE,
    CONTENT_TYPE_JSON,
    CONTENT_TYPE_TENSOR,
    CONTENT_TYPE_TEXT,
    ENVELOPE_VERSION,
    Encoding,
    Envelope,
    decode_envelope,
    encode_envelope,
)
from preprocess.exceptions import (
    CorruptInputError,
    DecompressionBombError,
    EncodingError,
    EnvelopeError,
    InputTooLargeError,
    PreprocessError,
    UnknownProfileError,
    UnsupportedInputError,
    WorkerCrashedError,
)
from preprocess.image import ImageInfo, decode_image, normalize, preprocess_image, probe_image
from preprocess.limits import DEFAULT_LIMITS, Limits
from preprocess.pipeline import encode_image, encode_image_file
from preprocess.profiles import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    ImageProfile,
    get_profile,
    list_profiles,
    register_profile,
)
from preprocess.settings import PreprocessSettings

__all__ = [
    "CONTENT_TYPE_FEATURES",
    "CONTENT_TYPE_IMAGE",
    "CONTENT_TYPE_JSON",
    "CONTENT_TYPE_TENSOR",
    "CONTENT_TYPE_TEXT",
    "DEFAULT_BROTLI_QUALITY",
    "DEFAULT_LIMITS",
    "ENVELOPE_VERSION",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "BatchResult",
    "CorruptInputError",
    "DecompressionBombError",
    "Encoding",
    "EncodingError",
    "Envelope",
    "EnvelopeError",
    "ImageInfo",
    "ImageProfile",
    "InputTooLargeError",
    "Limits",
    "PreprocessError",
    "PreprocessPool",
    "PreprocessSettings",
    "UnknownProfileError",
    "UnsupportedInputError",
    "WorkerCrashedError",
    "arrow_decode_table",
    "arrow_decode_tensor",
    "arrow_encode_table",
    "arrow_encode_tensor",
    "brotli_compress",
    "brotli_decompress",
    "decode_envelope",
    "decode_image",
    "encode_envelope",
    "encode_image",
    "encode_image_file",
    "get_profile",
    "list_profiles",
    "normalize",
    "preprocess_batch",
    "preprocess_image",
    "probe_image",
    "read_input",
    "register_profile",
    "webp_decode",
    "webp_encode",
]
