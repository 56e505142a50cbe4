"""The fast path (JPEG draft mode + reduce + box resize) against the full-decode path.

Stated tolerance (docs/preprocess.md), in uint8 grey levels, per photograph, at
the default reducing_gap=2.0: mean absolute difference <= 2, 99th percentile
<= 8, maximum <= 20 (at least 1.5x the worst measured, see
test_preprocess_parity_sweep.py). Measured on these 1080p frames: mean
0.19-0.46, p99 1-3, max 3-7.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from PIL import Image
from preprocess_photos import PHOTOS, encode, to_hd

from preprocess import ImageProfile, get_profile, preprocess_image

MEAN_LEVELS = 2.0
P99_LEVELS = 8.0
MAX_LEVELS = 20

UINT8_PROFILES = {
    "center-crop": get_profile("imagenet-224-uint8"),
    "letterbox": ImageProfile(
        name="lb-parity", size=(640, 640), fit="letterbox", layout="HWC", dtype="uint8"
    ),
    "shorter-side": ImageProfile(
        name="short-parity", resize_shorter=320, layout="HWC", dtype="uint8"
    ),
}


def _errors(data: bytes, profile: ImageProfile) -> np.ndarray:
    fast = preprocess_image(data, profile, fast=True).astype(np.int16)
    full = preprocess_image(data, profile, fast=False).astype(np.int16)
    assert fast.shape == full.shape
    return np.abs(fast - full)


@pytest.mark.parametrize("photo", PHOTOS)
@pytest.mark.parametrize("kind", sorted(UINT8_PROFILES))
def test_fast_path_matches_full_decode(
    hd_jpegs: dict[str, bytes], photo: str, kind: str, record_property: pytest.RecordProperty
) -> None:
    errors = _errors(hd_jpegs[photo], UINT8_PROFILES[kind])
    record_property("mean_abs_levels", float(errors.mean()))
    assert errors.mean() <= MEAN_LEVELS
    assert np.percentile(errors, 99) <= P99_LEVELS
    assert errors.max() <= MAX_LEVELS


def test_fast_path_really_differs_when_draft_applies(hd_jpegs: dict[str, bytes]) -> None:
    # If the fast path silently fell back to a full decode, the parity tests above
    # would pass trivially; on a 1080p JPEG to 224 the DCT scaling must show.
    errors = _errors(hd_jpegs["astronaut.png"], UINT8_PROFILES["center-crop"])
    assert errors.max() > 0


def test_reducing_gap_trades_accuracy(hd_jpegs: dict[str, bytes]) -> None:
    profile = UINT8_PROFILES["center-crop"]
    coarse = dataclasses.replace(profile, name="gap1", reducing_gap=1.0)
    data = hd_jpegs["motorcycle_left.png"]
    assert _errors(data, coarse).mean() > _errors(data, profile).mean()


def test_float_tensor_parity_in_normalised_units(hd_jpegs: dict[str, bytes]) -> None:
    profile = get_profile("imagenet-224")
    fast = preprocess_image(hd_jpegs["coffee.png"], profile)
    full = preprocess_image(hd_jpegs["coffee.png"], profile, fast=False)
    # One grey level is 1 / 255 / std ~= 0.0175 normalised units (std 0.224).
    level = 1 / 255 / min(profile.std)
    assert np.abs(fast - full).mean() <= MEAN_LEVELS * level


def test_png_and_small_inputs_are_identical_on_both_paths(astronaut_png: bytes) -> None:
    # No draft mode for PNG: with 512 -> 256 the reduce step is the only difference
    # and at reducing_gap=2 it does not apply (512 / 256 < 2 * 2).
    profile = get_profile("imagenet-224-uint8")
    np.testing.assert_array_equal(
        preprocess_image(astronaut_png, profile, fast=True),
        preprocess_image(astronaut_png, profile, fast=False),
    )


@pytest.mark.parametrize("photo", PHOTOS)
def test_throughput_profile_stays_within_its_looser_tolerance(
    hd_jpegs: dict[str, bytes], photo: str
) -> None:
    # imagenet-224-fast (reducing_gap=1): measured mean 0.5-1.8, p99 4-11, max 14-29;
    # stated mean <= 8.5, p99 <= 34, max <= 90.
    profile = dataclasses.replace(
        get_profile("imagenet-224-fast"), name="fast-u8", layout="HWC", dtype="uint8"
    )
    errors = _errors(hd_jpegs[photo], profile)
    assert errors.mean() <= 8.5
    assert np.percentile(errors, 99) <= 34
    assert errors.max() <= 90


def test_reduce_step_on_a_large_png_stays_within_tolerance(photos: dict[str, Image.Image]) -> None:
    # No draft mode for PNG; a 3840x2160 frame to 224 exercises Image.reduce (factor 4).
    big = to_hd(photos["motorcycle_left.png"]).resize((3840, 2160), Image.Resampling.BICUBIC)
    data = encode(big, "PNG", compress_level=1)
    errors = _errors(data, UINT8_PROFILES["center-crop"])
    assert errors.max() > 0  # the reduce step did run
    assert errors.mean() <= MEAN_LEVELS
    assert np.percentile(errors, 99) <= P99_LEVELS
    assert errors.max() <= MAX_LEVELS


# Stored so that each EXIF orientation displays the photo upright.
_STORED = {
    1: None,
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_90,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_270,
}


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("photo", ["motorcycle_left.png", "coffee.png"])
def test_fast_path_holds_its_tolerance_in_every_exif_orientation(
    photos: dict[str, Image.Image], photo: str, orientation: int
) -> None:
    # 1539x1027 decodes DCT-scaled to 770x514, of which 769.5x513.5 is image: the
    # half pixel ends up first once flipped or turned, and the box must follow it
    # (it did not: mean 4.6, p99 30, max 62 for motorcycle_left turned 180 degrees).
    upright = photos[photo].resize((1539, 1027), Image.Resampling.LANCZOS)
    method = _STORED[orientation]
    stored = upright if method is None else upright.transpose(method)
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = encode(stored, "JPEG", quality=90, exif=exif.tobytes())
    errors = _errors(data, UINT8_PROFILES["center-crop"])
    assert errors.mean() <= MEAN_LEVELS
    assert np.percentile(errors, 99) <= P99_LEVELS
    assert errors.max() <= MAX_LEVELS
    # And within what the upright image measures, not just within the tolerance.
    upright_errors = _errors(encode(upright, "JPEG", quality=90), UINT8_PROFILES["center-crop"])
    assert errors.mean() <= upright_errors.mean() * 1.5 + 0.1
