"""Generated data for the demo models: labelled shape images and a user-item click world.

Everything is a pure function of a seed, so the demo weights, the tests and the
benchmarks agree on the data without storing or downloading any.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["SHAPE_CLASSES", "ClickWorld", "click_world", "shape_images"]

SHAPE_CLASSES = ("circle", "square", "triangle", "h-stripes", "v-stripes", "checker")


def shape_images(count: int, size: int = 32, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``count`` uint8 ``(size, size, 3)`` images of :data:`SHAPE_CLASSES` and their labels.

    Shapes vary in position, size, colour and period; backgrounds are noisy.
    """
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, len(SHAPE_CLASSES), size=count)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    images = np.empty((count, size, size, 3), dtype=np.uint8)
    for n, label in enumerate(labels):
        cx, cy = rng.uniform(size * 0.3, size * 0.7, size=2)
        extent = rng.uniform(size * 0.15, size * 0.3)
        period = int(rng.integers(2, 6))
        phase = int(rng.integers(0, period * 2))
        if label == 0:
            mask = (xx - cx) ** 2 + (yy - cy) ** 2 < extent**2
        elif label == 1:
            mask = (np.abs(xx - cx) < extent * 0.8) & (np.abs(yy - cy) < extent * 0.8)
        elif label == 2:
            top = cy - extent
            mask = (yy >= top) & (yy <= cy + extent) & (np.abs(xx - cx) < (yy - top) * 0.6)
        elif label == 3:
            mask = ((yy.astype(int) + phase) // period) % 2 == 0
        elif label == 4:
            mask = ((xx.astype(int) + phase) // period) % 2 == 0
        else:
            mask = (((xx.astype(int) + phase) // period + (yy.astype(int)) // period) % 2) == 0
        background = rng.uniform(0, 150, size=3)
        foreground = rng.uniform(100, 255, size=3)
        image = np.where(mask[..., None], foreground, background)
        image += rng.normal(0, 60, size=image.shape)
        images[n] = np.clip(image, 0, 255).astype(np.uint8)
    return images, labels.astype(np.int64)


@dataclass(frozen=True, slots=True)
class ClickWorld:
    """Users and items with feature vectors, and how likely each user clicks each item.

    Attributes:
        user_ids: ``u0``, ``u1``, ...
        item_ids: ``i0``, ``i1``, ...
        user_features: float32 ``(users, 16)``.
        item_features: float32 ``(items, 16)``.
        affinity: Click probability of every (user, item) pair, ``(users, items)``.
    """

    user_ids: tuple[str, ...]
    item_ids: tuple[str, ...]
    user_features: np.ndarray
    item_features: np.ndarray
    affinity: np.ndarray

    def pairs(self, count: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``count`` random (user row, item row, clicked) samples."""
        rng = np.random.default_rng(seed)
        users = rng.integers(0, len(self.user_ids), size=count)
        items = rng.integers(0, len(self.item_ids), size=count)
        clicked = (rng.random(count) < self.affinity[users, items]).astype(np.float32)
        return users, items, clicked


def click_world(users: int = 200, items: int = 500, dims: int = 16, seed: int = 0) -> ClickWorld:
    """A generated recommendation world: latent tastes seen through noisy features."""
    rng = np.random.default_rng(seed)
    latent = 8
    user_latent = rng.normal(size=(users, latent))
    item_latent = rng.normal(size=(items, latent))
    user_proj = rng.normal(size=(latent, dims)) / np.sqrt(latent)
    item_proj = rng.normal(size=(latent, dims)) / np.sqrt(latent)
    user_features = np.tanh(user_latent @ user_proj) + rng.normal(0, 0.05, (users, dims))
    item_features = np.tanh(item_latent @ item_proj) + rng.normal(0, 0.05, (items, dims))
    popularity = rng.normal(0, 0.5, size=items)
    logits = 1.5 * (user_latent @ item_latent.T) / np.sqrt(latent) + popularity - 0.5
    return ClickWorld(
        user_ids=tuple(f"u{i}" for i in range(users)),
        item_ids=tuple(f"i{i}" for i in range(items)),
        user_features=user_features.astype(np.float32),
        item_features=item_features.astype(np.float32),
        affinity=(1.0 / (1.0 + np.exp(-logits))).astype(np.float32),
    )
