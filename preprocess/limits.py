"""Resource limits that every decoder of the package enforces."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_LIMITS", "Limits"]


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds on what one input may cost to decode.

    Attributes:
        max_input_bytes: Largest encoded input accepted (an image file, an
            envelope). Checked before anything is parsed.
        max_pixels: Largest image, in pixels (width x height), as declared by its
            header. Checked after reading the header and before decoding any
            pixel, so a small file that declares a huge canvas is refused cheaply.
        max_decoded_bytes: Largest output of a Brotli stream. Decompression stops
            as soon as the output would pass it.
        max_image_bytes: Largest peak memory one image may take on its whole
            path: the decoder (its pixels at their stored size, Pillow keeping
            RGB in 4 bytes and 16-bit greyscale in 2; libjpeg's coefficient
            buffer for a progressive JPEG; libwebp's canvases), orientation,
            colour conversion, resizing and the output. Estimated from the
            header for the path asked for (decode_image, the fast or the
            reference preprocess path; see preprocess/footprint.py) before a
            pixel is decoded; peak RSS stays within it (tested).
        max_jpeg_scans: Most scans a JPEG may hold. Each scan of a progressive
            JPEG is a pass over the whole image, so the scan count bounds decode
            CPU time; ordinary progressive files hold 6 to 12. Counted from the
            markers before decoding.
    """

    max_input_bytes: int = 32 * 1024 * 1024
    max_pixels: int = 40_000_000
    max_decoded_bytes: int = 64 * 1024 * 1024
    max_image_bytes: int = 320 * 1024 * 1024
    max_jpeg_scans: int = 64

    def __post_init__(self) -> None:
        for name in (
            "max_input_bytes",
            "max_pixels",
            "max_decoded_bytes",
            "max_image_bytes",
            "max_jpeg_scans",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Limits.{name} must be a positive integer, got {value!r}")


DEFAULT_LIMITS = Limits()
