from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest
from PIL import Image
from preprocess_photos import encode

from preprocess import (
    ImageProfile,
    decode_image,
    get_profile,
    normalize,
    preprocess_image,
    probe_image,
)


def test_imagenet_tensor_from_real_photo(hd_jpegs: dict[str, bytes]) -> None:
    tensor = preprocess_image(hd_jpegs["astronaut.png"], get_profile("imagenet-224"))
    assert tensor.shape == (3, 224, 224)
    assert tensor.dtype == np.float32
    # Normalised values span roughly [-2.1, 2.6] for ImageNet statistics.
    assert -2.2 < float(tensor.min()) < -1.0
    assert 1.5 < float(tensor.max()) < 2.7
    half = preprocess_image(hd_jpegs["astronaut.png"], get_profile("imagenet-224-fp16"))
    assert half.dtype == np.float16
    np.testing.assert_array_equal(half, tensor.astype(np.float16))


def test_uint8_output_is_the_crop_of_the_resized_image(rocket_jpg: bytes) -> None:
    profile = get_profile("imagenet-224-uint8")
    out = preprocess_image(rocket_jpg, profile, fast=False)
    # rocket.jpg is 640x427: shorter side 427 -> 256, longer int(256 * 640 / 427) = 383.
    with Image.open(io.BytesIO(rocket_jpg)) as image:
        assert image.size == (640, 427)
        full = image.convert("RGB").resize((383, 256), Image.Resampling.BILINEAR)
    left = round((383 - 224) / 2)
    top = round((256 - 224) / 2)
    expected = np.asarray(full.crop((left, top, left + 224, top + 224)))
    np.testing.assert_array_equal(out, expected)


def test_normalize_lut_is_bit_identical_to_arithmetic() -> None:
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, size=(31, 17, 3), dtype=np.uint8)
    profile = get_profile("imagenet-224")
    mean = np.asarray(profile.mean, dtype=np.float32)
    std = np.asarray(profile.std, dtype=np.float32)
    expected = ((pixels.astype(np.float32) / np.float32(255.0) - mean) / std).transpose(2, 0, 1)
    np.testing.assert_array_equal(normalize(pixels, profile), expected)
    hwc = dataclasses.replace(profile, name="hwc", layout="HWC")
    np.testing.assert_array_equal(normalize(pixels, hwc), expected.transpose(1, 2, 0))


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_every_exif_orientation_decodes_as_exif_transpose_does(
    photos: dict[str, Image.Image], orientation: int, fmt: str
) -> None:
    # decode_image orients while copying out (NumPy views, no turned copy);
    # the reference path turns the Pillow image: both must be ImageOps.exif_transpose.
    from PIL import ImageOps

    exif = Image.Exif()
    exif[0x0112] = orientation
    data = encode(photos["chelsea.png"].crop((0, 0, 301, 200)), fmt, exif=exif.tobytes())
    with Image.open(io.BytesIO(data)) as image:
        expected = np.asarray(ImageOps.exif_transpose(image.convert("RGB")))
    np.testing.assert_array_equal(decode_image(data), expected)
    profile = ImageProfile(name="orient-none", layout="HWC", dtype="uint8")
    np.testing.assert_array_equal(preprocess_image(data, profile, fast=False), expected)
    np.testing.assert_array_equal(preprocess_image(data, profile, fast=True), expected)
    np.testing.assert_array_equal(
        decode_image(data, mode="L")[:, :, 0],
        np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("L")),
    )


def test_exif_orientation_is_applied(photos: dict[str, Image.Image]) -> None:
    upright = photos["chelsea.png"]  # 451x300 landscape
    # Stored rotated; orientation 6 tells viewers to turn it 90 degrees clockwise.
    stored = upright.transpose(Image.Transpose.ROTATE_90)
    exif = Image.Exif()
    exif[0x0112] = 6
    data = encode(stored, "JPEG", quality=95, exif=exif.tobytes())
    info = probe_image(data)
    assert (info.width, info.height, info.orientation) == (451, 300, 6)
    decoded = decode_image(data)
    assert decoded.shape == (300, 451, 3)
    reference = np.asarray(upright).astype(int)
    assert np.abs(decoded.astype(int) - reference).mean() < 3.0
    profile = get_profile("imagenet-224-uint8")
    fast = preprocess_image(data, profile).astype(int)
    slow = preprocess_image(data, profile, fast=False).astype(int)
    assert np.abs(fast - slow).mean() < 1.0


def test_letterbox_pads_with_grey(hd_jpegs: dict[str, bytes]) -> None:
    profile = ImageProfile(
        name="lb-test", size=(640, 640), fit="letterbox", layout="HWC", dtype="uint8"
    )
    out = preprocess_image(hd_jpegs["coffee.png"], profile)
    assert out.shape == (640, 640, 3)
    # 1920x1080 -> 640x360, centred: 140 rows of padding above and below.
    assert (out[:140] == 114).all() and (out[500:] == 114).all()
    assert not (out[140:500] == 114).all()
    floats = preprocess_image(hd_jpegs["coffee.png"], get_profile("letterbox-640"))
    assert floats.shape == (3, 640, 640)
    np.testing.assert_allclose(floats, out.transpose(2, 0, 1) / np.float32(255), rtol=1e-6)


def test_greyscale_png_and_rgba_png() -> None:
    from preprocess_photos import DATA

    camera = (DATA / "camera.png").read_bytes()
    profile = ImageProfile(
        name="grey",
        mode="L",
        resize_shorter=64,
        size=(64, 64),
        fit="center-crop",
        mean=(0.5,),
        std=(0.5,),
    )
    out = preprocess_image(camera, profile)
    assert out.shape == (1, 64, 64)
    assert float(out.min()) >= -1.0 and float(out.max()) <= 1.0
    rgba = Image.new("RGBA", (40, 30), (10, 20, 30, 0))
    rgb = preprocess_image(encode(rgba, "PNG"), get_profile("imagenet-224-uint8"))
    assert rgb.shape == (224, 224, 3)
    assert tuple(rgb[100, 100]) == (10, 20, 30)


def test_webp_input_and_no_upscale(photos: dict[str, Image.Image]) -> None:
    data = encode(photos["chelsea.png"], "WEBP", quality=90)
    out = preprocess_image(data, get_profile("webp-720"))
    assert out.shape == (300, 451, 3)  # already under 720: upscale=False keeps it


def test_16_bit_png_is_scaled_not_clipped() -> None:
    ramp = (np.arange(256, dtype=np.uint32) * 257).astype(np.uint16).reshape(16, 16)
    image = Image.fromarray(ramp)
    assert image.mode.startswith("I;16")
    profile = ImageProfile(
        name="grey16", mode="L", layout="HWC", dtype="uint8", mean=(0.0,), std=(1.0,)
    )
    out = preprocess_image(encode(image, "PNG"), profile)
    np.testing.assert_array_equal(out[:, :, 0].ravel(), np.arange(256))


@pytest.mark.parametrize(
    "name", ["imagenet-224", "imagenet-224-uint8", "letterbox-640", "webp-720"]
)
def test_every_registered_profile_runs_on_a_real_jpeg(rocket_jpg: bytes, name: str) -> None:
    profile = get_profile(name)
    out = preprocess_image(rocket_jpg, profile)
    assert out.dtype == np.dtype(profile.dtype)
    assert out.ndim == 3
