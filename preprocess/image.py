"""Decode an encoded image and turn it into a model tensor, as an :class:`ImageProfile` says.

Two paths give the same geometry:

* the fast path (``profile.fast``) asks the JPEG decoder for a DCT-scaled image
  (draft mode: a 1920x1080 JPEG decodes straight to 960x540 when that still
  leaves ``reducing_gap`` times the target), resamples only the region the
  crop keeps (Pillow's ``resize(box=...)``) after an ``Image.reduce`` step, and
  normalises through a 256-entry lookup table;
* the reference path decodes every pixel, resizes the whole image, crops.

They agree within the tolerance stated in docs/preprocess.md and enforced by
tests/unit/preprocess/test_preprocess_parity*.py.

Every path is planned before a pixel is decoded: its peak memory, from the
header (:mod:`preprocess.footprint`), must fit ``Limits.max_image_bytes``.
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
from preprocess.footprint import DecodeCost, Plan, resample_bytes, stored_bytes
from preprocess.jpeg import JpegStructure, check_jpeg, load_jpeg
from preprocess.limits import DEFAULT_LIMITS, Limits
from preprocess.pixels import GREY_MODES, TRANSPOSED, orient, to_array, to_mode
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
_JPEG = ("JPEG", "MPO")
_RESAMPLE = {
    "nearest": Image.Resampling.NEAREST,
    "box": Image.Resampling.BOX,
    "bilinear": Image.Resampling.BILINEAR,
    "hamming": Image.Resampling.HAMMING,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
}
_OTHER_FORMATS = (
    (b"GIF8", "GIF"),
    (b"BM", "BMP"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"\x00\x00\x00\x0cjP  ", "JPEG 2000"),
)
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


@dataclass(frozen=True, slots=True)
class _Opened:
    """An image whose header passed the checks, not yet decoded."""

    image: Image.Image
    orientation: int
    jpeg: JpegStructure | None

    def cost(self) -> DecodeCost:
        """What decoding costs at the image's current (possibly DCT-scaled) size."""
        width, height = self.image.size
        coefficients = self.jpeg.coefficient_bytes if self.jpeg is not None else 0
        return DecodeCost.of(str(self.image.format), width, height, self.image.mode, coefficients)


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


def _open(data: bytes, limits: Limits) -> _Opened:
    """Parse the header only; check format, declared pixel count and JPEG markers."""
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
    structure = check_jpeg(data, limits) if image.format in _JPEG else None
    try:
        orientation = int(image.getexif().get(0x0112, 1))
    except _DECODE_ERRORS:
        orientation = 1  # an unreadable EXIF block is not worth refusing the image for
    if not 1 <= orientation <= 8:
        orientation = 1
    return _Opened(image, orientation, structure)


def _check_budget(opened: _Opened, plan: Plan, limits: Limits, what: str) -> None:
    """Refuse, before decoding, a path whose peak memory would pass ``max_image_bytes``."""
    peak = plan.peak()
    if peak.bytes > limits.max_image_bytes:
        image = opened.image
        width, height = image.size
        kind = str(image.format)
        if opened.jpeg is not None and opened.jpeg.coefficient_bytes:
            kind += ", progressive" if opened.jpeg.progressive else ", multi-scan"
        raise DecompressionBombError(
            f"image of {width}x{height} {image.mode} pixels needs about {peak.bytes} bytes "
            f"to {what} ({kind}; peak while {peak.name}), over the limit of "
            f"{limits.max_image_bytes} (Limits.max_image_bytes); refused before decoding: "
            "send a smaller image or raise the limit"
        )


def _plan_decode(opened: _Opened, mode: str) -> Plan:
    cost = opened.cost()
    plan = Plan.start(cost)
    channels = 1 if mode == "L" else len(mode)
    plan.add("copying out", cost.pixels + cost.width * cost.height * channels)
    return plan


def probe_image(
    data: bytes | bytearray | memoryview,
    *,
    limits: Limits = DEFAULT_LIMITS,
    budget: bool = True,
) -> ImageInfo:
    """Read an image header: format, mode and displayed size; no pixel is decoded.

    Refuses what :func:`decode_image` would refuse before decoding (to RGB);
    with ``budget=False`` not the memory budget (a caller that compares the
    header with what it expects first, and decodes, budget checked, after).

    Raises:
        InputTooLargeError, DecompressionBombError, CorruptInputError, UnsupportedInputError.
    """
    opened = _open(_check_bytes(data, limits), limits)
    if budget:
        _check_budget(opened, _plan_decode(opened, "RGB"), limits, "decode")
    image = opened.image
    width, height = image.size
    if opened.orientation in TRANSPOSED:
        width, height = height, width
    return ImageInfo(str(image.format), image.mode, width, height, opened.orientation)


def _load(opened: _Opened, data: bytes) -> None:
    image = opened.image
    try:
        if opened.jpeg is not None:
            load_jpeg(image, data, opened.jpeg)  # type: ignore[arg-type]
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


def _work_mode(stored: str, mode: str) -> str:
    """The mode to resample in: a greyscale source stays one channel until the end.

    Resampling is per channel, so resizing in ``L`` and expanding to ``RGB``
    afterwards gives the same pixels as expanding first, at a quarter of the
    memory (Pillow keeps RGB in 4 bytes a pixel).
    """
    return "L" if mode == "RGB" and stored in GREY_MODES else mode


def decode_image(
    data: bytes | bytearray | memoryview,
    *,
    mode: str = "RGB",
    limits: Limits = DEFAULT_LIMITS,
) -> npt.NDArray[np.uint8]:
    """Fully decode an image to a uint8 ``(H, W, C)`` array (EXIF orientation applied).

    Args:
        data: JPEG, PNG or WebP bytes.
        mode: ``"RGB"``, ``"L"`` or ``"RGBA"``.
        limits: Input, pixel and memory bounds.

    Raises:
        InputTooLargeError, DecompressionBombError, CorruptInputError, UnsupportedInputError.
    """
    if mode not in ("RGB", "L", "RGBA"):
        raise UnsupportedInputError(f"decode_image mode must be RGB, L or RGBA, got {mode!r}")
    raw = _check_bytes(data, limits)
    opened = _open(raw, limits)
    _check_budget(opened, _plan_decode(opened, mode), limits, "decode")
    _load(opened, raw)
    return to_array(opened.image, mode, opened.orientation)


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


def _oriented(size: tuple[int, int], orientation: int) -> tuple[int, int]:
    return (size[1], size[0]) if orientation in TRANSPOSED else size


def _plan_tail(
    plan: Plan, alive: int, size: tuple[int, int], profile: ImageProfile, work: str, *, crop: bool
) -> None:
    """Phases after the resize: crop or letterbox, the final mode, the tensor."""
    work_bytes = stored_bytes(work)
    width, height = size
    box = _crop_box(size, profile) if crop else None
    if box is not None:
        width, height = box[2] - box[0], box[3] - box[1]
        plan.add("cropping", alive + width * height * work_bytes)
        alive = width * height * work_bytes
    if profile.fit == "letterbox":
        assert profile.size is not None  # guaranteed by ImageProfile validation
        box_h, box_w = profile.size
        # The canvas, and the image converted to its mode to be pasted.
        plan.add("letterboxing", alive + (box_w * box_h + width * height) * 4)
        width, height = box_w, box_h
        alive = width * height * stored_bytes(profile.mode)
        work = profile.mode
    pixels = width * height
    channels = 3 if profile.mode == "RGB" else 1
    final = pixels * stored_bytes(profile.mode) if work != profile.mode else 0
    array = pixels * channels  # to_array's uint8 copy
    if profile.dtype == "uint8":
        tensor = array if profile.layout == "CHW" else 0  # the transposed copy
    else:  # the tensor, and np.take's int64 copy of one channel's indices
        tensor = pixels * channels * np.dtype(profile.dtype).itemsize + pixels * 8
    plan.add("making the tensor", alive + final + array + tensor)


def _plan_reference(opened: _Opened, profile: ImageProfile) -> Plan:
    cost = opened.cost()
    plan = Plan.start(cost)
    if opened.orientation != 1:
        plan.add("orienting", 2 * cost.pixels)
    width, height = _oriented((cost.width, cost.height), opened.orientation)
    work = _work_mode(cost.mode, profile.mode)
    work_bytes = stored_bytes(work)
    alive = width * height * work_bytes
    if cost.mode != work:
        plan.add("converting colours", cost.pixels + alive)
    resized = _resized_size(width, height, profile)
    if resized != (width, height):
        # Pillow resamples rows first into a (new width x old height) image.
        rows_first = resized[0] * height * work_bytes if resized[0] != width else 0
        out = resized[0] * resized[1] * work_bytes
        taps = resample_bytes((width, height), resized, profile.resample)
        plan.add("resizing", alive + rows_first + out + taps)
        alive = out
    _plan_tail(plan, alive, resized, profile, work, crop=True)
    return plan


def _pixels_reference(data: bytes, profile: ImageProfile, limits: Limits) -> Image.Image:
    opened = _open(data, limits)
    _check_budget(opened, _plan_reference(opened, profile), limits, "preprocess")
    _load(opened, data)
    image, orientation = opened.image, opened.orientation
    del opened  # each step below then frees the image it replaces
    image = orient(image, orientation)
    image = to_mode(image, _work_mode(image.mode, profile.mode))
    resized = _resized_size(image.width, image.height, profile)
    if resized != image.size:
        image = image.resize(resized, _RESAMPLE[profile.resample])
    box = _crop_box(resized, profile)
    if box is not None:
        image = image.crop(box)
    if profile.fit == "letterbox":
        image = _letterbox(image, profile)
    return to_mode(image, profile.mode)


@dataclass(frozen=True, slots=True)
class _FastGeometry:
    """Where the fast path resamples from (in the decoded, oriented image) and to."""

    box: tuple[float, float, float, float]
    size: tuple[int, int]

    def reduce_factors(self, profile: ImageProfile) -> tuple[int, int]:
        """The ``Image.reduce`` factors ``resize(reducing_gap=...)`` will apply."""
        if profile.resample == "nearest":
            return 1, 1
        gap = profile.reducing_gap
        return (
            int((self.box[2] - self.box[0]) / self.size[0] / gap) or 1,
            int((self.box[3] - self.box[1]) / self.size[1] / gap) or 1,
        )


# Which stored axis's DCT-scaling slack each EXIF orientation turns to the start
# of the displayed x and y axes. A 1411-pixel side scaled by 1/2 decodes to 706
# pixels of which 705.5 are image: the half pixel is at the end as stored, at
# the start once flipped or turned.
_SLACK_FIRST = {
    2: ("x", ""),
    3: ("x", "y"),
    4: ("", "y"),
    6: ("y", ""),
    7: ("y", "x"),
    8: ("", "x"),
}


def _draft(opened: _Opened, profile: ImageProfile) -> _FastGeometry:
    """Ask the JPEG decoder for a DCT-scaled image; return the resampling geometry."""
    image = opened.image
    stored_w, stored_h = image.size
    width, height = _oriented(image.size, opened.orientation)
    resized = _resized_size(width, height, profile)
    scale = 1.0
    if image.format in _JPEG and resized[0] < width:
        want = (
            math.ceil(resized[0] * profile.reducing_gap),
            math.ceil(resized[1] * profile.reducing_gap),
        )
        draft_mode = profile.mode if image.mode in ("RGB", "L") else None
        drafted = image.draft(draft_mode, _oriented(want, opened.orientation))
        if drafted is not None:
            # The box is the original image inside the scaled one: its width is
            # stored_w / scale, the DCT scale factor (1, 2, 4 or 8).
            scale = stored_w / drafted[1][2]
    factor = 1.0 / scale
    slack = {"x": image.width - stored_w * factor, "y": image.height - stored_h * factor, "": 0.0}
    x_from, y_from = _SLACK_FIRST.get(opened.orientation, ("", ""))
    left, top = slack[x_from], slack[y_from]
    crop = _crop_box(resized, profile)
    if crop is not None:
        # Resample only the region the crop keeps: same taps as resize-then-crop.
        sx, sy = width / resized[0] * factor, height / resized[1] * factor
        box = (
            left + crop[0] * sx,
            top + crop[1] * sy,
            left + crop[2] * sx,
            top + crop[3] * sy,
        )
        return _FastGeometry(box, (crop[2] - crop[0], crop[3] - crop[1]))
    box = (left, top, left + width * factor, top + height * factor)
    return _FastGeometry(box, resized)


def _plan_fast(opened: _Opened, profile: ImageProfile, geometry: _FastGeometry) -> Plan:
    cost = opened.cost()  # at the DCT-scaled size
    plan = Plan.start(cost)
    if opened.orientation != 1:
        plan.add("orienting", 2 * cost.pixels)
    width, height = _oriented((cost.width, cost.height), opened.orientation)
    work = _work_mode(cost.mode, profile.mode)
    work_bytes = stored_bytes(work)
    alive = width * height * work_bytes
    if cost.mode != work:
        plan.add("converting colours", cost.pixels + alive)
    out_w, out_h = geometry.size
    if geometry.size != (width, height) or geometry.box != (0.0, 0.0, width, height):
        fx, fy = geometry.reduce_factors(profile)
        box_w, box_h = geometry.box[2] - geometry.box[0], geometry.box[3] - geometry.box[1]
        columns, rows = math.ceil(box_w / fx) + 2, math.ceil(box_h / fy) + 2
        reduced = columns * rows * work_bytes if fx * fy > 1 else 0
        taps = resample_bytes((box_w / fx, box_h / fy), geometry.size, profile.resample)
        plan.add("resizing", alive + reduced + (out_w * rows + out_w * out_h) * work_bytes + taps)
        alive = out_w * out_h * work_bytes
    _plan_tail(plan, alive, geometry.size, profile, work, crop=False)
    return plan


def _pixels_fast(data: bytes, profile: ImageProfile, limits: Limits) -> Image.Image:
    opened = _open(data, limits)
    geometry = _draft(opened, profile)
    _check_budget(opened, _plan_fast(opened, profile, geometry), limits, "preprocess")
    _load(opened, data)
    image, orientation = opened.image, opened.orientation
    del opened  # each step below then frees the image it replaces
    image = orient(image, orientation)
    image = to_mode(image, _work_mode(image.mode, profile.mode))
    box, size = geometry.box, geometry.size
    if size != image.size or box != (0.0, 0.0, float(image.width), float(image.height)):
        image = image.resize(
            size, _RESAMPLE[profile.resample], box=box, reducing_gap=profile.reducing_gap
        )
    if profile.fit == "letterbox":
        image = _letterbox(image, profile)
    return to_mode(image, profile.mode)


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
        limits: Input size, pixel count and memory bounds.
        fast: Override ``profile.fast``: True for draft mode and reduce, False
            for the full-decode reference path.

    Returns:
        The tensor in ``profile.layout`` and ``profile.dtype``.

    Raises:
        InputTooLargeError: more bytes than ``limits.max_input_bytes``.
        DecompressionBombError: more pixels than ``limits.max_pixels``, or a
            path whose peak memory would pass ``limits.max_image_bytes``.
        CorruptInputError: truncated (a JPEG cut short included) or damaged data.
        UnsupportedInputError: a format other than JPEG, PNG, WebP.
    """
    raw = _check_bytes(data, limits)
    use_fast = profile.fast if fast is None else fast
    try:
        image = (_pixels_fast if use_fast else _pixels_reference)(raw, profile, limits)
        pixels = to_array(image, profile.mode)
    except PreprocessError:
        raise
    except _DECODE_ERRORS as exc:
        raise CorruptInputError(f"cannot process image: {exc}") from None
    return normalize(pixels, profile)
