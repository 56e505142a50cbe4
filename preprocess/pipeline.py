"""The edge step end to end: encoded image in, envelope for the model worker out."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from preprocess.envelope import CONTENT_TYPE_IMAGE, Encoding, encode_envelope
from preprocess.image import preprocess_image
from preprocess.limits import DEFAULT_LIMITS, Limits
from preprocess.profiles import ImageProfile

__all__ = ["encode_image", "encode_image_file"]


def encode_image(
    data: bytes | bytearray | memoryview,
    profile: ImageProfile,
    *,
    encoding: Encoding | None = None,
    limits: Limits = DEFAULT_LIMITS,
    metadata: Mapping[str, str] | None = None,
) -> bytes:
    """Preprocess an encoded image with ``profile`` and frame it as an envelope.

    Args:
        data: JPEG, PNG or WebP bytes.
        profile: The image pipeline.
        encoding: Transport encoding (default: ``profile.encoding``).
        limits: Input bounds.
        metadata: Extra header pairs.

    Returns:
        Envelope bytes; ``decode_envelope(...).to_numpy()`` gives the tensor.

    Raises:
        PreprocessError: a bad image (see :func:`preprocess.preprocess_image`) or
            an encoding the profile's dtype cannot use.
    """
    tensor = preprocess_image(data, profile, limits=limits)
    return encode_envelope(
        tensor,
        content_type=CONTENT_TYPE_IMAGE,
        encoding=encoding or profile.encoding,
        layout=profile.layout,
        profile=profile.name,
        metadata=metadata,
        webp_quality=profile.webp_quality,
    )


def encode_image_file(
    path: str,
    profile: ImageProfile,
    encoding: Encoding | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> tuple[int, bytes]:
    """Read an image file and return ``(bytes read, envelope)``; picklable for process pools.

    Raises:
        PreprocessError: unreadable, too large or bad image; see :func:`encode_image`.
    """
    from preprocess.batch import read_input

    data = read_input(path, limits)
    return len(data), encode_image(
        data, profile, encoding=encoding, limits=limits, metadata={"source": Path(path).name}
    )
