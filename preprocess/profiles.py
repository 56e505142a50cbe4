"""Image profiles: one declaration of an image pipeline, used alike for training and serving.

A profile names every step that changes pixels (mode, resize, crop, dtype,
normalisation). Training code and the edge both call
:func:`preprocess.preprocess_image` with the same profile, so a resize that
differs between the two (a classic silent accuracy loss) cannot happen.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from typing import Literal

from preprocess.exceptions import UnknownProfileError

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "Fit",
    "ImageProfile",
    "Layout",
    "OutputDType",
    "Resample",
    "get_profile",
    "list_profiles",
    "register_profile",
]

Fit = Literal["center-crop", "letterbox", "none"]
Layout = Literal["HWC", "CHW"]
OutputDType = Literal["uint8", "float16", "float32"]
Resample = Literal["nearest", "box", "bilinear", "hamming", "bicubic", "lanczos"]
ColorMode = Literal["RGB", "L"]
TransportEncoding = Literal["raw", "webp", "webp-lossless", "brotli", "arrow"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

_NAME = re.compile(r"^[a-z0-9][a-z0-9.-]{0,62}$")


@dataclass(frozen=True, slots=True)
class ImageProfile:
    """How to turn an encoded image into the tensor a model wants.

    Attributes:
        name: Registry name, lowercase letters, digits, dots and dashes.
        mode: Colour mode of the output: ``"RGB"`` (3 channels) or ``"L"`` (1).
        resize_shorter: Resize so the shorter side has this length (aspect kept);
            ``None`` keeps the size (``fit="none"``) or fits the image inside
            ``size`` (``fit="letterbox"``).
        size: Output ``(height, width)`` after the crop or letterbox; ``None``
            with ``fit="none"``.
        fit: ``"center-crop"`` (crop ``size`` from the centre of the resized
            image, as torchvision's CenterCrop), ``"letterbox"`` (fit the whole
            image inside ``size`` and pad with ``pad_value``) or ``"none"``.
        upscale: When False, an image already smaller than ``resize_shorter`` keeps
            its size instead of being enlarged.
        resample: Pillow filter for the resize; every filter but ``nearest``
            is antialiased when shrinking.
        layout: ``"HWC"`` or ``"CHW"``.
        dtype: ``"uint8"`` keeps pixel values; ``"float16"``/``"float32"``
            give ``(pixel / 255 - mean) / std`` per channel.
        mean: Per-channel mean subtracted after scaling to [0, 1].
        std: Per-channel standard deviation divided by after the mean.
        pad_value: Grey level of letterbox padding (114 is the YOLO convention).
        fast: Use JPEG draft mode (DCT-domain downscaling while decoding) and
            ``Image.reduce`` before the final filter. The result differs from
            the full-decode path by a small, tested amount (see
            docs/preprocess.md); set False for bit-exact parity with it.
        reducing_gap: The fast path keeps at least ``reducing_gap`` times the
            target size before the final antialiased resize. Larger is closer to
            the full-decode result and slower. Tolerance held against the
            full-decode path, in uint8 grey levels per image, at least 1.5x the
            worst measured over short sides up to 2048, every EXIF orientation,
            the tests' photos and scikit-image's others
            (benchmarks/preprocess_parity.py): 2.0 (the default): mean <= 2,
            p99 <= 8, max <= 20; 1.0: mean <= 8.5, p99 <= 34, max <= 90 (worst
            on fine textures, and when the short side is exactly twice the
            resize target: DCT scaling then replaces the whole bilinear resize).
        encoding: Default transport encoding for this profile's output.
        webp_quality: WebP quality (0-100) when ``encoding="webp"``.
    """

    name: str
    mode: ColorMode = "RGB"
    resize_shorter: int | None = None
    size: tuple[int, int] | None = None
    fit: Fit = "none"
    upscale: bool = True
    resample: Resample = "bilinear"
    layout: Layout = "CHW"
    dtype: OutputDType = "float32"
    mean: tuple[float, ...] = (0.0, 0.0, 0.0)
    std: tuple[float, ...] = (1.0, 1.0, 1.0)
    pad_value: int = 114
    fast: bool = True
    reducing_gap: float = 2.0
    encoding: TransportEncoding = "raw"
    webp_quality: int = 80

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(
                f"profile name {self.name!r} must be lowercase letters, digits, dots and dashes"
            )
        channels = 3 if self.mode == "RGB" else 1
        if len(self.mean) != channels or len(self.std) != channels:
            raise ValueError(
                f"profile {self.name!r}: mean and std need {channels} values for mode "
                f"{self.mode!r}, got {len(self.mean)} and {len(self.std)}"
            )
        if any(s <= 0 for s in self.std):
            raise ValueError(f"profile {self.name!r}: std values must be > 0, got {self.std}")
        if self.resize_shorter is not None and self.resize_shorter <= 0:
            raise ValueError(f"profile {self.name!r}: resize_shorter must be > 0")
        if self.fit in ("center-crop", "letterbox"):
            if self.size is None or min(self.size) <= 0:
                raise ValueError(
                    f"profile {self.name!r}: fit={self.fit!r} needs size=(height, width) > 0"
                )
        elif self.size is not None:
            raise ValueError(f"profile {self.name!r}: size is only used with a crop or letterbox")
        if self.fit == "center-crop" and (
            self.resize_shorter is None
            or self.size is None
            or self.resize_shorter < max(self.size)
            or not self.upscale
        ):
            raise ValueError(
                f"profile {self.name!r}: center-crop needs resize_shorter >= the crop size "
                "and upscale=True, so the crop always fits"
            )
        if self.fit == "letterbox" and self.resize_shorter is not None:
            raise ValueError(f"profile {self.name!r}: letterbox fits to size; drop resize_shorter")
        if not 0 <= self.pad_value <= 255:
            raise ValueError(f"profile {self.name!r}: pad_value must be 0-255")
        if self.reducing_gap < 1.0:
            raise ValueError(f"profile {self.name!r}: reducing_gap must be >= 1.0")
        if not 0 <= self.webp_quality <= 100:
            raise ValueError(f"profile {self.name!r}: webp_quality must be 0-100")
        if self.encoding in ("webp", "webp-lossless") and self.dtype != "uint8":
            raise ValueError(
                f"profile {self.name!r}: WebP carries uint8 pixels only; use dtype='uint8' "
                "or encoding 'raw'/'arrow'/'brotli'"
            )

    @property
    def channels(self) -> int:
        """Number of output channels (3 for RGB, 1 for L)."""
        return 3 if self.mode == "RGB" else 1


_lock = threading.Lock()
_registry: dict[str, ImageProfile] = {}


def register_profile(profile: ImageProfile, *, replace: bool = False) -> ImageProfile:
    """Add ``profile`` to the registry under its name.

    Raises:
        ValueError: a different profile already has that name and ``replace`` is False.
    """
    with _lock:
        existing = _registry.get(profile.name)
        if existing is not None and existing != profile and not replace:
            raise ValueError(
                f"profile {profile.name!r} is already registered; pass replace=True to override"
            )
        _registry[profile.name] = profile
    return profile


def get_profile(name: str) -> ImageProfile:
    """The profile registered as ``name``.

    Raises:
        UnknownProfileError: no such profile; the message lists the registered ones.
    """
    try:
        return _registry[name]
    except KeyError:
        raise UnknownProfileError(
            f"image profile {name!r} is not registered; known profiles: "
            f"{', '.join(sorted(_registry))}"
        ) from None


def list_profiles() -> list[ImageProfile]:
    """Every registered profile, sorted by name."""
    return [_registry[name] for name in sorted(_registry)]


# Torchvision's ImageNet evaluation transform: Resize(256) (bilinear, antialiased),
# CenterCrop(224), ToTensor, Normalize(mean, std).
for _dtype in ("float32", "float16"):
    register_profile(
        ImageProfile(
            name="imagenet-224" if _dtype == "float32" else "imagenet-224-fp16",
            resize_shorter=256,
            size=(224, 224),
            fit="center-crop",
            resample="bilinear",
            layout="CHW",
            dtype=_dtype,
            mean=IMAGENET_MEAN,
            std=IMAGENET_STD,
        )
    )
# Throughput-first variant: JPEG draft decodes straight to ~1.05x the target
# (1920x1080 -> 480x270). ~30% faster per image than imagenet-224, but differs
# from the full-decode path by ~1 grey level on average, and on photos whose
# short side is exactly 512 (the DCT scale lands on the 256 resize target) by
# up to mean 2.6, p99 18, max 58. Stated tolerance: mean <= 3, p99 <= 20,
# max <= 64 grey levels (docs/preprocess.md). Use it only when training used it too.
register_profile(
    ImageProfile(
        name="imagenet-224-fast",
        resize_shorter=256,
        size=(224, 224),
        fit="center-crop",
        resample="bilinear",
        layout="CHW",
        dtype="float32",
        mean=IMAGENET_MEAN,
        std=IMAGENET_STD,
        reducing_gap=1.0,
    )
)
# The same crop kept as bytes: 4x smaller on the wire than float32; the worker
# normalises on the GPU.
register_profile(
    ImageProfile(
        name="imagenet-224-uint8",
        resize_shorter=256,
        size=(224, 224),
        fit="center-crop",
        layout="HWC",
        dtype="uint8",
    )
)
# YOLO-style detector input: whole frame fitted in 640x640, grey padding, [0, 1] floats.
register_profile(
    ImageProfile(
        name="letterbox-640",
        size=(640, 640),
        fit="letterbox",
        layout="CHW",
        dtype="float32",
        mean=(0.0, 0.0, 0.0),
        std=(1.0, 1.0, 1.0),
    )
)
# A downscaled frame shipped as lossy WebP for a worker that decodes it itself.
register_profile(
    ImageProfile(
        name="webp-720",
        resize_shorter=720,
        upscale=False,
        layout="HWC",
        dtype="uint8",
        encoding="webp",
        webp_quality=80,
    )
)
