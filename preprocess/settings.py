"""Settings of the edge preprocessing stage (the ``preprocess:`` key of edgefeed.yaml)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from preprocess.limits import DEFAULT_LIMITS, Limits
from preprocess.profiles import get_profile

__all__ = ["PreprocessSettings"]


class PreprocessSettings(BaseModel):
    """Bounds and defaults of the preprocessing stage.

    Attributes:
        profile: Default image profile name (must be registered).
        workers: Processes of the preprocessing pool.
        max_input_bytes: Largest encoded input (image, envelope) accepted.
        max_pixels: Largest image, in pixels, as declared by its header.
        max_decoded_bytes: Largest output of a Brotli stream or declared array.
        max_image_bytes: Largest memory one decoded image may take (see
            :class:`~preprocess.limits.Limits`).
        max_jpeg_scans: Most scans a JPEG may hold (bounds decode CPU time).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    profile: str = "imagenet-224"
    workers: int = Field(default=1, ge=1, le=256)
    max_input_bytes: int = Field(default=DEFAULT_LIMITS.max_input_bytes, gt=0)
    max_pixels: int = Field(default=DEFAULT_LIMITS.max_pixels, gt=0)
    max_decoded_bytes: int = Field(default=DEFAULT_LIMITS.max_decoded_bytes, gt=0)
    max_image_bytes: int = Field(default=DEFAULT_LIMITS.max_image_bytes, gt=0)
    max_jpeg_scans: int = Field(default=DEFAULT_LIMITS.max_jpeg_scans, gt=0)

    @field_validator("profile")
    @classmethod
    def _known_profile(cls, value: str) -> str:
        get_profile(value)  # UnknownProfileError is a ValueError: pydantic reports it
        return value

    def limits(self) -> Limits:
        """The :class:`~preprocess.limits.Limits` these settings describe."""
        return Limits(
            max_input_bytes=self.max_input_bytes,
            max_pixels=self.max_pixels,
            max_decoded_bytes=self.max_decoded_bytes,
            max_image_bytes=self.max_image_bytes,
            max_jpeg_scans=self.max_jpeg_scans,
        )
