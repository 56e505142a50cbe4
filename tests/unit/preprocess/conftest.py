"""Fixtures: real photographs shipped with scikit-image (see preprocess_photos.py)."""

from __future__ import annotations

from preprocess_photos import astronaut_png, hd_jpegs, photos, rocket_jpg

__all__ = ["astronaut_png", "hd_jpegs", "photos", "rocket_jpg"]
