"""Pixel conversions that bound their temporaries: colour modes, orientation, Pillow to NumPy.

Each works a band of rows at a time where a whole-image temporary would
otherwise double the peak memory (see :mod:`preprocess.footprint`):
``np.asarray(image)`` goes through ``Image.tobytes``, which holds the packed
pixels twice (its chunks, then their join), and a 16-bit image converted in
one go makes 32-bit copies.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from PIL import Image

__all__ = ["GREY_MODES", "TRANSPOSED", "orient", "oriented_view", "to_array", "to_mode"]

GREY_MODES = frozenset({"1", "L", "I;16", "I;16B", "I;16L", "I"})
# EXIF orientations 5-8 swap width and height.
TRANSPOSED = frozenset({5, 6, 7, 8})
_ORIENT = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
# Bytes of Pillow pixels converted at a time (a band of rows).
_BAND_BYTES = 1 << 18
_CHANNELS = {"L": 1, "RGB": 3, "RGBA": 4}


def orient(image: Image.Image, orientation: int) -> Image.Image:
    """Apply the EXIF orientation (as ImageOps.exif_transpose, without its copy when upright)."""
    method = _ORIENT.get(orientation)
    return image if method is None else image.transpose(method)


def oriented_view(out: npt.NDArray[np.uint8], orientation: int) -> npt.NDArray[np.uint8]:
    """A view of ``out`` (the displayed image) indexed as the stored image is.

    Writing stored row ``y`` into ``view[y]`` puts it where :func:`orient` would.
    """
    flipped = out.transpose(1, 0, 2) if orientation in TRANSPOSED else out
    rows, columns = {
        1: (1, 1),
        2: (1, -1),
        3: (-1, -1),
        4: (-1, 1),
        5: (1, 1),
        6: (-1, 1),
        7: (-1, -1),
        8: (1, -1),
    }.get(orientation, (1, 1))
    return flipped[::rows, ::columns]


def grey_peak(image: Image.Image) -> int:
    """The value that maps to 255 when a deep greyscale image becomes 8-bit."""
    if image.mode.startswith("I;16"):
        return 65535
    extrema = image.getextrema()
    top = extrema[1]
    return max(int(top), 1) if isinstance(top, int | float) else 65535


def to_mode(image: Image.Image, mode: str, peak: int | None = None) -> Image.Image:
    """Convert to ``mode``; 16- and 32-bit greyscale is scaled to 8 bits, not clipped.

    Args:
        image: The image.
        mode: The mode wanted.
        peak: For deep greyscale, the value that becomes 255 (:func:`grey_peak`
            of the whole image when converting a band of it).
    """
    if image.mode == mode:
        return image
    if image.mode in ("I;16", "I;16B", "I;16L", "I") and mode in ("RGB", "L"):
        # A band of rows at a time, so no full-size 16- or 32-bit copy is made.
        width, height = image.size
        top_value = grey_peak(image) if peak is None else peak
        out = np.empty((height, width), dtype=np.uint8)
        rows = max(1, _BAND_BYTES // (4 * width))
        for top in range(0, height, rows):
            band = np.asarray(image.crop((0, top, width, min(top + rows, height))))
            out[top : top + rows] = band.astype(np.uint32) * 255 // top_value
        grey = Image.fromarray(out, mode="L")  # shares out's memory
        return grey if mode == "L" else grey.convert(mode)
    return image.convert(mode)


def to_array(image: Image.Image, mode: str, orientation: int = 1) -> npt.NDArray[np.uint8]:
    """The image as a uint8 ``(H, W, C)`` array in ``mode`` (L, RGB, RGBA), oriented.

    Converts and copies a band of rows at a time into the one output array,
    oriented through :func:`oriented_view`: no full-size intermediate besides
    the output.
    """
    width, height = image.size
    channels = _CHANNELS[mode]
    shape = (width, height) if orientation in TRANSPOSED else (height, width)
    out = np.empty((*shape, channels), dtype=np.uint8)
    view = oriented_view(out, orientation)
    peak = grey_peak(image) if image.mode in ("I", "I;16", "I;16B", "I;16L") else None
    rows = max(1, _BAND_BYTES // (4 * width))
    for top in range(0, height, rows):
        bottom = min(top + rows, height)
        band = to_mode(image.crop((0, top, width, bottom)), mode, peak)
        view[top:bottom] = np.asarray(band, dtype=np.uint8).reshape(bottom - top, width, channels)
    return out
