"""Real photographs shipped with scikit-image, as encoded bytes."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import skimage
from PIL import Image

DATA = Path(skimage.__file__).parent / "data"
# Colour photographs (the PNGs are lossless scans; the JPEGs are as shipped).
PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "motorcycle_left.png", "rocket.jpg")


def photo(name: str) -> Image.Image:
    with Image.open(DATA / name) as image:
        return image.convert("RGB")


def to_hd(image: Image.Image) -> Image.Image:
    """Upscale (Lanczos) to cover 1920x1080, then centre-crop to exactly 1920x1080."""
    scale = max(1920 / image.width, 1080 / image.height)
    big = image.resize(
        (round(image.width * scale), round(image.height * scale)), Image.Resampling.LANCZOS
    )
    left, top = (big.width - 1920) // 2, (big.height - 1080) // 2
    return big.crop((left, top, left + 1920, top + 1080))


def encode(image: Image.Image, fmt: str = "JPEG", **options: object) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


@pytest.fixture(scope="session")
def photos() -> dict[str, Image.Image]:
    return {name: photo(name) for name in PHOTOS}


@pytest.fixture(scope="session")
def hd_jpegs(photos: dict[str, Image.Image]) -> dict[str, bytes]:
    """1920x1080 JPEGs (quality 90) made from the real photos."""
    return {name: encode(to_hd(image), "JPEG", quality=90) for name, image in photos.items()}


@pytest.fixture(scope="session")
def astronaut_png() -> bytes:
    return (DATA / "astronaut.png").read_bytes()


@pytest.fixture(scope="session")
def rocket_jpg() -> bytes:
    return (DATA / "rocket.jpg").read_bytes()


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    from skimage.metrics import structural_similarity

    return float(structural_similarity(a, b, channel_axis=-1, data_range=255))
