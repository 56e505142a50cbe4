"""Model configs share one to_dict/from_dict and round-trip through plain types."""

from __future__ import annotations

import json

import pytest

from workers.models import ClassifierConfig, RankerConfig
from workers.models.config import PlainConfig


@pytest.mark.parametrize(
    "config",
    [ClassifierConfig(hidden=(64, 32)), RankerConfig(user_features=("a", "b"), hidden=(8,))],
    ids=["classifier", "ranker"],
)
def test_configs_round_trip_through_json_types(config: PlainConfig) -> None:
    plain = config.to_dict()
    assert json.loads(json.dumps(plain)) == plain  # plain types only
    assert type(config).from_dict(plain) == config


def test_one_implementation_serves_both_configs() -> None:
    for cls in (ClassifierConfig, RankerConfig):
        assert cls.to_dict is PlainConfig.to_dict
        assert cls.from_dict.__func__ is PlainConfig.from_dict.__func__  # type: ignore[attr-defined]
