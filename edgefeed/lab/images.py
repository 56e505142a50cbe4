"""The image path of the lab: a generated 1080p photo, and a classifier worker that
takes either the raw JPEG (it preprocesses itself: its T_data) or the edge's
preprocessed envelope.

The photo is synthetic (smooth colour fields, shapes and sensor-like noise, a
fixed seed) so that its JPEG is about the size of a camera photo's; nothing is
downloaded. The classifier is the shipped demo CNN (global average pooling, so
it takes 224x224 crops): the image path measures bytes and time, not accuracy.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Mapping
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from preprocess import ImageProfile, PreprocessError, encode_image, preprocess_image
from workers.exceptions import InvalidTensorError
from workers.models import ImageClassifier, Prepared, load_served_model

__all__ = ["JPEG_TYPE", "PHOTO_PROFILE", "PhotoClassifier", "edge_envelope", "synthetic_photo"]

JPEG_TYPE = "image/jpeg"
PHOTO_PROFILE = ImageProfile(
    name="lab-224-webp",
    resize_shorter=256,
    size=(224, 224),
    fit="center-crop",
    layout="HWC",
    dtype="uint8",
    encoding="webp",
    webp_quality=85,
)
"""What the edge does to the photo: shorter side to 256, centre crop 224, uint8
pixels (the worker normalises on its device), sent as WebP."""


def synthetic_photo(
    width: int = 1920, height: int = 1080, *, seed: int = 3, quality: int = 90
) -> bytes:
    """A generated ``width`` x ``height`` JPEG that compresses like a photo."""
    rng = np.random.default_rng(seed)
    coarse = rng.uniform(0, 255, size=(9, 16, 3)).astype(np.uint8)
    image = Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC)
    draw = ImageDraw.Draw(image)
    for _ in range(40):
        x, y = int(rng.integers(width)), int(rng.integers(height))
        w, h = int(rng.integers(40, 400)), int(rng.integers(40, 300))
        colour = tuple(int(c) for c in rng.integers(0, 256, size=3))
        if rng.random() < 0.5:
            draw.ellipse((x, y, x + w, y + h), fill=colour)
        else:
            draw.rectangle((x, y, x + w, y + h), fill=colour)
    image = image.filter(ImageFilter.GaussianBlur(2))
    pixels = np.asarray(image, dtype=np.float32)
    # Texture and sensor noise: what makes a photo's JPEG hundreds of kilobytes.
    pixels += rng.normal(0, 9, size=pixels.shape)
    out = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(
        out, format="JPEG", quality=quality
    )
    return out.getvalue()


def edge_envelope(jpeg: bytes) -> bytes:
    """The edge's work: :data:`PHOTO_PROFILE` applied, framed as a preprocess envelope."""
    return encode_image(jpeg, PHOTO_PROFILE)


class PhotoClassifier(ImageClassifier):
    """The image classifier, also taking ``image/jpeg`` bodies: the worker then
    decodes, resizes and crops the photo itself with :data:`PHOTO_PROFILE`."""

    async def parse(
        self,
        body: bytes,
        content_type: str | None,
        headers: Mapping[str, str],
        *,
        max_rows: int,
        max_bytes: int | None = None,
    ) -> Prepared:
        media = (content_type or "").split(";", 1)[0].strip().lower()
        if media != JPEG_TYPE:
            return await super().parse(
                body, content_type, headers, max_rows=max_rows, max_bytes=max_bytes
            )
        try:
            pixels: Any = await asyncio.to_thread(preprocess_image, body, PHOTO_PROFILE)
        except PreprocessError as exc:
            raise InvalidTensorError(f"the JPEG body could not be preprocessed: {exc}") from None
        rows = np.ascontiguousarray(np.asarray(pixels, dtype=np.uint8)[np.newaxis])
        return Prepared(inputs=(rows,), rows=1)


def photo_classifier(name: str = "photo-classifier") -> PhotoClassifier:
    """The shipped demo classifier's weights served on 224x224 crops."""
    base = load_served_model("image-classifier")
    if not isinstance(base, ImageClassifier):  # pragma: no cover - the built-in is one
        raise TypeError(f"the built-in image-classifier is a {type(base).__name__}")
    size = PHOTO_PROFILE.size[0] if PHOTO_PROFILE.size else 224
    return PhotoClassifier(name, base.module, base.labels, size, version=base.version)
