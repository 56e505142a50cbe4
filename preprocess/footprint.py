"""What decoding and preprocessing one image costs in memory, computed from its header.

Every decode path checks this estimate against ``Limits.max_image_bytes``
before decoding a pixel, so the budget holds for the whole path (decoder,
orientation, colour conversion, resampling, output), not only for the decoded
pixels. Each path is a sequence of phases; the estimate is the largest sum of
buffers alive at once in any phase, plus a fixed allowance for the decoders'
row buffers and Python itself. tests/unit/preprocess/test_preprocess_budget.py
measures the peak RSS of each path on images at the edge of the budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["DecodeCost", "Phase", "Plan", "resample_bytes", "stored_bytes"]

# Bytes per pixel Pillow keeps for each mode (RGB, LA and the like are padded to 4).
_STORED = {"1": 1, "L": 1, "P": 1, "I;16": 2, "I;16B": 2, "I;16L": 2}
# libwebp's animation decoder (Pillow's only WebP reader) keeps two RGBA
# canvases for as long as the image lives; while decoding, Pillow also holds
# the frame copied out as bytes, and a lossless (VP8L) stream its own ARGB
# buffer: measured 17 (lossy) to 19 (lossless) bytes a pixel on top of the
# fixed part, of which the image itself is 4.
_WEBP_CANVASES = 8
_WEBP_DECODING = 8
# Decoder row buffers, zlib windows, band temporaries, the interpreter's own
# allocations: a fixed part and a part per pixel of width.
_ALLOWANCE = 8 * 1024 * 1024
_ALLOWANCE_PER_COLUMN = 64


# Radius of Pillow's resampling filters, in source pixels when not shrinking.
_SUPPORT = {
    "nearest": 0.0,
    "box": 0.5,
    "bilinear": 1.0,
    "hamming": 1.0,
    "bicubic": 2.0,
    "lanczos": 3.0,
}


def stored_bytes(mode: str) -> int:
    """Bytes per pixel Pillow stores for ``mode``."""
    return _STORED.get(mode, 4)


def resample_bytes(source: tuple[float, float], size: tuple[int, int], resample: str) -> int:
    """Pillow's coefficient tables for one resize (Resample.c, precompute_coeffs).

    A double per filter tap per output column and row, both directions at
    once; the taps widen with the shrink factor. Upscaling a thin image to a
    long side of 100,000 pixels costs megabytes here.
    """
    support = _SUPPORT.get(resample, 3.0)
    total = 0
    for before, after in zip(source, size, strict=True):
        taps = 2 * math.ceil(support * max(before / max(after, 1), 1.0)) + 1
        total += after * (taps + 1) * 8
    return total


@dataclass(frozen=True, slots=True)
class Phase:
    """One step of a path and the bytes alive during it."""

    name: str
    bytes: int


@dataclass(frozen=True, slots=True)
class DecodeCost:
    """What the decoder itself holds while it runs.

    Attributes:
        width: Width of the decoded pixels (after JPEG DCT scaling).
        height: Height of the decoded pixels.
        mode: Pillow mode of the decoded pixels.
        working: The decoder's own memory on top of the pixels while it runs:
            libjpeg's whole-image coefficient buffer for a JPEG coded in several
            scans (full size even when DCT-scaled), libwebp's canvases and the
            frame Pillow copies out of them.
        held: What the decoder keeps after decoding, as long as the image
            lives (libwebp's canvases: Pillow keeps the decoder for seeking).
    """

    width: int
    height: int
    mode: str
    working: int
    held: int = 0

    @classmethod
    def of(
        cls, image_format: str, width: int, height: int, mode: str, coefficient_bytes: int = 0
    ) -> DecodeCost:
        """The cost of decoding an image of this format, stored size and mode."""
        if image_format == "WEBP":
            canvases = _WEBP_CANVASES * width * height
            return cls(width, height, mode, canvases + _WEBP_DECODING * width * height, canvases)
        return cls(width, height, mode, coefficient_bytes)

    @property
    def pixels(self) -> int:
        return self.width * self.height * stored_bytes(self.mode)


@dataclass(slots=True)
class Plan:
    """The phases of one path, built step by step as the path will run them."""

    width: int
    held: int
    phases: list[Phase]

    @classmethod
    def start(cls, decoded: DecodeCost) -> Plan:
        """A path's first phase: the decoder at work on the image's pixels."""
        return cls(
            decoded.width, decoded.held, [Phase("decoding", decoded.pixels + decoded.working)]
        )

    def add(self, name: str, alive: int) -> None:
        """A later phase with ``alive`` bytes of the path's own buffers."""
        self.phases.append(Phase(name, alive + self.held))

    def peak(self) -> Phase:
        """The costliest phase, allowance included."""
        worst = max(self.phases, key=lambda phase: phase.bytes)
        allowance = _ALLOWANCE + _ALLOWANCE_PER_COLUMN * self.width
        return Phase(worst.name, worst.bytes + allowance)
