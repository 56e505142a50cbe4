from __future__ import annotations

import pytest
from pydantic import ValidationError

from preprocess import DEFAULT_LIMITS, Limits, PreprocessSettings


def test_defaults_match_the_default_limits() -> None:
    assert PreprocessSettings().limits() == DEFAULT_LIMITS


def test_settings_build_limits() -> None:
    settings = PreprocessSettings(profile="webp-720", workers=2, max_pixels=1_000)
    assert settings.limits() == Limits(max_pixels=1_000)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"profile": "imagenet-999"}, "not registered"),
        ({"max_pixel": 3}, "Extra inputs"),
        ({"max_input_bytes": 0}, "greater than 0"),
        ({"workers": 0}, "greater than or equal to 1"),
    ],
)
def test_bad_settings_are_refused(values: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        PreprocessSettings(**values)  # type: ignore[arg-type]


def test_limits_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="max_pixels"):
        Limits(max_pixels=0)
