from __future__ import annotations

import dataclasses

import pytest

from edgefeed.errors import EdgefeedError
from preprocess import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    ImageProfile,
    PreprocessError,
    UnknownProfileError,
    get_profile,
    list_profiles,
    register_profile,
)


def test_imagenet_profile_is_torchvision_eval_transform() -> None:
    profile = get_profile("imagenet-224")
    assert profile.resize_shorter == 256
    assert profile.size == (224, 224)
    assert profile.fit == "center-crop"
    assert profile.resample == "bilinear"
    assert profile.layout == "CHW"
    assert profile.dtype == "float32"
    assert profile.mean == IMAGENET_MEAN
    assert profile.std == IMAGENET_STD
    assert get_profile("imagenet-224-fp16").dtype == "float16"


def test_unknown_profile_is_typed_and_lists_known_names() -> None:
    with pytest.raises(UnknownProfileError) as info:
        get_profile("imagenet-225")
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, PreprocessError)
    assert isinstance(info.value, EdgefeedError)
    assert "'imagenet-225'" in str(info.value)
    assert "imagenet-224" in str(info.value)


def test_register_refuses_silent_replacement() -> None:
    base = get_profile("imagenet-224")
    with pytest.raises(ValueError, match="already registered"):
        register_profile(dataclasses.replace(base, resample="bicubic"))
    custom = register_profile(dataclasses.replace(base, name="test-bicubic", resample="bicubic"))
    assert get_profile("test-bicubic") is custom
    assert custom in list_profiles()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "Bad Name"}, "profile name"),
        ({"name": "x", "mean": (0.5,)}, "mean and std"),
        ({"name": "x", "std": (1.0, 0.0, 1.0)}, "std values"),
        ({"name": "x", "fit": "center-crop", "size": (224, 224)}, "center-crop needs"),
        ({"name": "x", "fit": "center-crop", "resize_shorter": 200, "size": (224, 224)}, "fits"),
        ({"name": "x", "fit": "letterbox"}, "needs size"),
        ({"name": "x", "encoding": "webp"}, "uint8"),
        ({"name": "x", "reducing_gap": 0.5}, "reducing_gap"),
    ],
)
def test_invalid_profiles_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ImageProfile(**kwargs)  # type: ignore[arg-type]
