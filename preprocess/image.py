"""Decode an encoded image and turn it into a model tensor, as an :class:`ImageProfile` says.

Two paths give the same geometry:

* the fast path (``profile.fast``) asks the JPEG decoder for a DCT-scaled image
  (draft mode: a 1920x1080 JPEG decodes straight to 960x540 when that still
  leaves ``reducing_gap`` times the target), resamples only the region the
  crop keeps (Pillow's ``resize(box=...)``) after an ``Image.reduce`` step, and
  normalises through a 256-entry lookup table;
* the reference path decodes every pixel, resizes the whole image, crops.

They agree within the tolerance stated in docs/preprocess.md and enforced by
tests/unit/preprocess/test_parity.py.
"""

from __future__ import annotations

import io
import math
import struct
import warnings
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import numpy.typing as npt
from PIL import Image, UnidentifiedImageError

from preprocess.exceptions import (
    CorruptInputError,
    DecompressionBombError,
    InputTooLargeError,
    PreprocessError,
    UnsupportedInputError,
)
from preprocess.jpeg import JpegStructure, check_jpeg, load_jpeg
from preprocess.limits import DEFAULT_LIMITS, Limits
from preprocess.profiles import ImageProfile

__all__ = [
    "ImageInfo",
    "decode_image",
    "normalize",
    "preprocess_image",
    "probe_image",
]

# The JPEG opener also returns MPO (multi-picture JPEG from cameras) images.
_FORMATS = ("JPEG", "PNG", "WEBP")
_RESAMPLE = {
    "nearest": Image.Resampling.NEAREST,
    "box": Image.Resampling.BOX,
    "bilinear": Image.Resampling.BILINEAR,
    "hamming": Image.Resampling.HAMMING,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
}
# EXIF orientations 5-8 swap width and height.
_TRANSPOSED = frozenset({5, 6, 7, 8})
_OTHER_FORMATS = (
    (b"GIF8", "GIF"),
    (b"BM", "BMP"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"\x00\x00\x00\x0cjP  ", "JPEG 2000"),
)
# Bytes per pixel Pillow keeps for each mode (RGB and LA are padded to 4).
_STORED_BYTES = {"1": 1, "L": 1, "P": 1, "I;16": 2, "I;16B": 2, "I;16L": 2, "LA": 4, "PA": 4}
# Rows of pixels converted at a time from 16 bits to 8: bounds the temporaries.
_CONVERT_ROWS = 256
# Errors Pillow's decoders raise on damaged input.
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, struct.error)


@dataclass(frozen=True, slots=True)
class ImageInfo:
    """What an image header says, read without decoding pixels.

    Attributes:
        format: ``"JPEG"``, ``"PNG"``, ``"WEBP"`` or ``"MPO"``.
        mode: Pillow mode of the stored pixels (``"RGB"``, ``"L"``, ``"RGBA"``...).
        width: Displayed width (after EXIF orientation).
        height: Displayed height (after EXIF orientation).
        orientation: EXIF orientation tag (1 when absent).
    """

    format: str
    mode: str
    width: int
    height: int
    orientation: int


def _check_bytes(data: bytes | bytearray | memoryview, limits: Limits) -> bytes:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise UnsupportedInputError(
            f"expected the encoded image as bytes, got {type(data).__name__}"
        )
    size = len(data)
    if size > limits.max_input_bytes:
        raise InputTooLargeError(
            f"image is {size} bytes, over the limit of {limits.max_input_bytes} bytes "
            "(Limits.max_input_bytes); send a smaller file or raise the limit"
        )
    if size == 0:
        raise CorruptInputError("image is empty (0 bytes)")
    return bytes(data)


def _open(data: bytes, limits: Limits) -> tuple[Image.Image, int, JpegStructure | None]:
    """Parse the header only; check format and declared pixel count."""
    try:
        with warnings.catch_warnings():
            # Pillow warns (or raises past 2x) for canvases over its own global
            # limit; ours is lower and typed, so turn the warning into an error.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=_FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise DecompressionBombError(
            f"image declares more pixels than Pillow's own bomb limit, far over "
            f"Limits.max_pixels ({limits.max_pixels}); refused before decoding ({exc})"
        ) from None
    except UnidentifiedImageError:
        for magic, name in _OTHER_FORMATS:
            if data.startswith(magic):
                raise UnsupportedInputError(
                    f"{name} images are not supported; send JPEG, PNG or WebP"
                ) from None
        raise CorruptInputError(
            f"not a readable JPEG, PNG or WebP image (starts with {data[:8]!r}); "
            "the file is damaged or of another format"
        ) from None
    except _DECODE_ERRORS as exc:
        raise CorruptInputError(
            f"image header is truncated or damaged ({exc}); re-encode or resend the file"
        ) from None
    width, height = image.size
    if width <= 0 or height <= 0:
        raise CorruptInputError(f"image header declares an empty {width}x{height} canvas")
    if width * height > limits.max_pixels:
        raise DecompressionBombError(
            f"image declares {width}x{height} = {width * height} pixels, over the limit of "
            f"{limits.max_pixels} (Limits.max_pixels); refused before decoding"
        )
    working = width * height * (_STORED_BYTES.get(image.mode, 4) + 3)
    if working > limits.max_image_bytes:
        raise DecompressionBombError(
            f"image of {width}x{height} {image.mode} pixels needs about {working} bytes "
            f"decoded, over the limit of {limits.max_image_bytes} (Limits.max_image_bytes); "
            "refused before decoding"
        )
    structure = check_jpeg(data, limits) if image.format in ("JPEG", "MPO") else None
    try:
        orientation = int(image.getexif().get(0x0112, 1))
    except _DECODE_ERRORS:
        orientation = 1  # an unreadable EXIF block is not worth refusing the image for
    if not 1 <= orientation <= 8:
        orientation = 1
    return image, orientation, structure


def probe_image(
    data: bytes | bytearray | memoryview, *, limits: Limits = DEFAULT_LIMITS
) -> ImageInfo:
    """Read an image header: format, mode and displayed size; no pixel is decoded.

    Raises:
        InputTooLargeError, DecompressionBombError, CorruptInputError, UnsupportedInputError.
    """
    image, orientation, _ = _open(_check_bytes(data, limits), limits)
    width, height = image.size
    if orientation in _TRANSPOSED:
        width, height = height, width
    return ImageInfo(str(image.format), image.mode, width, height, orientation)


_ORIENT = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


def _orient(image: Image.Image, orientation: int) -> Image.Image:
    """Apply the EXIF orientation (as ImageOps.exif_transpose, without its copy when upright)."""
    method = _ORIENT.get(orientation)
    return image if method is None else image.transpose(method)


def _load(image: Image.Image, data: bytes, structure: JpegStructure | None) -> None:
    try:
        if structure is not None:
            load_jpeg(image, data, structure)  # type: ignore[arg-type]
        else:
            image.load()
    except Image.DecompressionBombError as exc:
        raise DecompressionBombError(str(exc)) from None
    except PreprocessError:
        raise
    except _DECODE_ERRORS as exc:
        raise CorruptInputError(
            f"image data is truncated or damaged ({exc}); re-encode or resend the file"
        ) from None


_GREY = frozenset({"1", "L", "I;16", "I;16B", "I;16L", "I"})


def _work_mode(image: Image.Image, mode: str) -> str:
    """The mode to resample in: a greyscale source stays one channel until the end.

    Resampling is per channel, so resizing in ``L`` and expanding to ``RGB``
    afterwards gives the same pixels as expanding first, at a quarter of the
    memory (Pillow keeps RGB in 4 bytes a pixel).
    """
    return "L" if mode == "RGB" and image.mode in _GREY else mode


def _to_mode(image: Image.Image, mode: str) -> Image.Image:
    if image.mode == mode:
        return image
    if image.mode in ("I;16", "I;16B", "I;16L", "I") and mode in ("RGB", "L"):
        # 16-bit greyscale: scale to 8 bits instead of clipping at 255, a band of
        # rows at a time so no full-size 16- or 32-bit copy is ever made.
        width, height = image.size
        peak = 65535
        if not image.mode.startswith("I;16"):
            extrema = image.getextrema()
            peak = max(int(extrema[1]), 1) if isinstance(extrema[1], int | float) else 65535
        out = np.empty((height, width), dtype=np.uint8)
        for top in range(0, height, _CONVERT_ROWS):
            band = np.asarray(image.crop((0, top, width, min(top + _CONVERT_ROWS, height))))
            out[top : top + _CONVERT_ROWS] = band.astype(np.uint32) * 255 // peak
        grey = Image.fromarray(out, mode="L")
        return grey if mode == "L" else grey.convert(mode)
    return image.convert(mode)


def decode_image(
    data: bytes | bytearray | memoryview,
    *,
    mode: str = "RGB",
    limits: Limits = DEFAULT_LIMITS,
) -> npt.NDArray[np.uint8]:
    """Fully decode an image to a uint8 ``(H, W, C)`` array (EXIF orientation applied).

    Raises:
        InputTooLargeError, DecompressionBombError, CorruptInputError, UnsupportedInputError.
    """
    raw = _check_bytes(data, limits)
    image, orientation, structure = _open(raw, limits)
    _load(image, raw, structure)
    image = _to_mode(_orient(image, orientation), mode)
    array = np.asarray(image, dtype=np.uint8)
    return array[:, :, None] if array.ndim == 2 else array


def _resized_size(width: int, height: int, profile: ImageProfile) -> tuple[int, int]:
    """Output size of the resize step, as torchvision's Resize(int) computes it."""
    if profile.fit == "letterbox":
        assert profile.size is not None  # guaranteed by ImageProfile validation
        box_h, box_w = profile.size
        scale = min(box_w / width, box_h / height)
        if not profile.upscale:
            scale = min(scale, 1.0)
        return max(1, round(width * scale)), max(1, round(height * scale))
    target = profile.resize_shorter
    if target is None:
        return width, height
    short, long = min(width, height), max(width, height)
    if not profile.upscale and short <= target:
        return width, height
    new_long = int(target * long / short)
    return (target, new_long) if width <= height else (new_long, target)


def _crop_box(resized: tuple[int, int], profile: ImageProfile) -> tuple[int, int, int, int] | None:
    if profile.fit != "center-crop":
        return None
    assert profile.size is not None  # guaranteed by ImageProfile validation
    crop_h, crop_w = profile.size
    width, height = resized
    left = round((width - crop_w) / 2.0)
    top = round((height - crop_h) / 2.0)
    return left, top, left + crop_w, top + crop_h


def _letterbox(image: Image.Image, profile: ImageProfile) -> Image.Image:
    assert profile.size is not None  # guaranteed by ImageProfile validation
    box_h, box_w = profile.size
    fill = profile.pad_value if profile.mode == "L" else (profile.pad_value,) * 3
    canvas = Image.new(profile.mode, (box_w, box_h), fill)
    canvas.paste(image, ((box_w - image.width) // 2, (box_h - image.height) // 2))
    return canvas


def _geometry_reference(image: Image.Image, profile: ImageProfile) -> Image.Image:
    resized = _resized_size(image.width, image.height, profile)
    if resized != image.size:
        image = image.resize(resized, _RESAMPLE[profile.resample])
    box = _crop_box(resized, profile)
    if box is not None:
        image = image.crop(box)
    if profile.fit == "letterbox":
        image = _letterbox(image, profile)
    return image


def _pixels_reference(data: bytes, profile: ImageProfile, limits: Limits) -> Image.Image:
    image, orientation, structure = _open(data, limits)
    _load(image, data, structure)
    image = _to_mode(_orient(image, orientation), _work_mode(image, profile.mode))
    return _to_mode(_geometry_reference(image, profile), profile.mode)


def _pixels_fast(data: bytes, profile: ImageProfile, limits: Limits) -> Image.Image:
    image, orientation, structure = _open(data, limits)
    stored_w, stored_h = image.size
    width, height = (stored_h, stored_w) if orientation in _TRANSPOSED else (stored_w, stored_h)
    resized = _resized_size(width, height, profile)
    scale = 1.0
    if image.format in ("JPEG", "MPO") and resized[0] < width:
        want = (
            math.ceil(resized[0] * profile.reducing_gap),
            math.ceil(resized[1] * profile.reducing_gap),
        )
        if orientation in _TRANSPOSED:
            want = (want[1], want[0])
        draft_mode = profile.mode if image.mode in ("RGB", "L") else None
        drafted = image.draft(draft_mode, want)
        if drafted is not None:
            # The box is the original image inside the scaled one: its width is
            # stored_w / scale, the DCT scale factor (1, 2, 4 or 8).
            scale = stored_w / drafted[1][2]
    _load(image, data, structure)
    image = _to_mode(_orient(image, orientation), _work_mode(image, profile.mode))
    factor = 1.0 / scale
    crop = _crop_box(resized, profile)
    if crop is not None:
        # Resample only the region the crop keeps: same taps as resize-then-crop.
        sx, sy = width / resized[0] * factor, height / resized[1] * factor
        box = (crop[0] * sx, crop[1] * sy, crop[2] * sx, crop[3] * sy)
        out_size = (crop[2] - crop[0], crop[3] - crop[1])
    else:
        box = (0.0, 0.0, min(width * factor, image.width), min(height * factor, image.height))
        out_size = resized
    if out_size != image.size or box != (0.0, 0.0, float(image.width), float(image.height)):
        image = image.resize(
            out_size,
            _RESAMPLE[profile.resample],
            box=box,
            reducing_gap=profile.reducing_gap,
        )
    if profile.fit == "letterbox":
        image = _letterbox(image, profile)
    return _to_mode(image, profile.mode)


@lru_cache(maxsize=64)
def _lut(
    channels: int, mean: tuple[float, ...], std: tuple[float, ...], dtype: str
) -> npt.NDArray[np.floating]:
    values = np.arange(256, dtype=np.float32) / np.float32(255.0)
    mean32 = np.asarray(mean, dtype=np.float32)[:channels, None]
    std32 = np.asarray(std, dtype=np.float32)[:channels, None]
    table = ((values[None, :] - mean32) / std32).astype(dtype)
    table.setflags(write=False)
    return table


def normalize(
    pixels: npt.NDArray[np.uint8], profile: ImageProfile
) -> npt.NDArray[np.uint8] | npt.NDArray[np.floating]:
    """Turn uint8 ``(H, W, C)`` pixels into the profile's dtype and layout.

    Floats are ``(pixel / 255 - mean) / std`` computed in float32 (then cast),
    bit-identical to doing that arithmetic on the whole array, but through a
    per-channel 256-entry lookup table.
    """
    if profile.dtype == "uint8":
        if profile.layout == "CHW":
            return np.ascontiguousarray(pixels.transpose(2, 0, 1))
        return np.ascontiguousarray(pixels)
    height, width, channels = pixels.shape
    table = _lut(channels, profile.mean, profile.std, profile.dtype)
    shape = (channels, height, width) if profile.layout == "CHW" else (height, width, channels)
    out = np.empty(shape, dtype=profile.dtype)
    for c in range(channels):
        target = out[c] if profile.layout == "CHW" else out[:, :, c]
        np.take(table[c], pixels[:, :, c], out=target)
    return out


def preprocess_image(
    data: bytes | bytearray | memoryview,
    profile: ImageProfile,
    *,
    limits: Limits = DEFAULT_LIMITS,
    fast: bool | None = None,
) -> npt.NDArray[np.uint8] | npt.NDArray[np.floating]:
    """Decode ``data`` (JPEG, PNG or WebP) and apply ``profile``.

    Args:
        data: The encoded image.
        profile: The pipeline to apply (see :func:`preprocess.get_profile`).
        limits: Input size and pixel count bounds.
        fast: Override ``profile.fast``: True for draft mode and reduce, False
            for the full-decode reference path.

    Returns:
        The tensor in ``profile.layout`` and ``profile.dtype``.

    Raises:
        InputTooLargeError: more bytes than ``limits.max_input_bytes``.
        DecompressionBombError: more pixels than ``limits.max_pixels``.
        CorruptInputError: truncated or damaged data.
        UnsupportedInputError: a format other than JPEG, PNG, WebP.
    """
    raw = _check_bytes(data, limits)
    use_fast = profile.fast if fast is None else fast
    try:
        image = (_pixels_fast if use_fast else _pixels_reference)(raw, profile, limits)
        pixels = np.asarray(image, dtype=np.uint8)
    except PreprocessError:
        raise
    except _DECODE_ERRORS as exc:
        raise CorruptInputError(f"cannot process image: {exc}") from None
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    return normalize(pixels, profile)
