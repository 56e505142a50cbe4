"""Values written by another schema version are read safely or refused, never misread."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from edge_cache_stack import READ_TIMEOUT_S

from edge_cache import (
    Feature,
    FeatureClient,
    FeatureSchema,
    FeatureWriter,
    Position,
    RegionSettings,
    SchemaVersionError,
)

pytestmark = pytest.mark.integration
pytest_plugins = ["edge_cache_stack"]

V1 = FeatureSchema.of("user", {"a": "float32", "n": "int32"})
V2 = V1.evolve(Feature("b", "float32"), Feature("flag", "bool"))


def test_old_client_reads_newer_values_prefix(
    regions: list[RegionSettings], make_writer: Callable[..., FeatureWriter]
) -> None:
    writer = make_writer(regions[0], [V2])
    writer.publish_schemas()
    writer.upsert("user", 1, {"a": 1.5, "n": 7, "b": 2.5, "flag": True}, Position(1), time.time())
    writer.upsert("user", 2, {"b": 2.5}, Position(1), time.time())
    with FeatureClient("eu-west", regions, [V1], timeout_s=READ_TIMEOUT_S) as client:
        result = client.get("user", [1, 2])
        assert result.to_dicts() == [{"a": 1.5, "n": 7}, {"a": None, "n": None}]
        assert result.found.tolist() == [True, True]


def test_new_client_reads_older_values_with_new_features_missing(
    regions: list[RegionSettings], make_writer: Callable[..., FeatureWriter]
) -> None:
    old = make_writer(regions[0], [V1])
    old.publish_schemas()
    old.upsert("user", 1, {"a": 1.5, "n": -3}, Position(1), time.time())
    new = make_writer(regions[0], [V2])
    new.publish_schemas()
    new.upsert("user", 2, {"a": 0.5, "n": 1, "b": 4.0, "flag": False}, Position(1), time.time())
    with FeatureClient("eu-west", regions, [V2], timeout_s=READ_TIMEOUT_S) as client:
        result = client.get("user", [1, 2])
        assert result.to_dicts() == [
            {"a": 1.5, "n": -3, "b": None, "flag": None},
            {"a": 0.5, "n": 1, "b": 4.0, "flag": False},
        ]
        assert result.present.tolist() == [[True, True, False, False], [True] * 4]


def test_unpublished_newer_version_is_refused(
    regions: list[RegionSettings], make_writer: Callable[..., FeatureWriter]
) -> None:
    writer = make_writer(regions[0], [V2])  # never publishes its schema
    writer.upsert("user", 1, {"a": 1.0}, Position(1), time.time())
    with (
        FeatureClient("eu-west", regions, [V1], timeout_s=READ_TIMEOUT_S) as client,
        pytest.raises(SchemaVersionError, match=r"schema version 2.*not published.*publish"),
    ):
        client.get("user", [1])


def test_incompatible_version_is_refused(
    regions: list[RegionSettings], make_writer: Callable[..., FeatureWriter]
) -> None:
    # version 2 that reorders the features: reading its prefix would swap a and n
    reordered = FeatureSchema.of("user", {"n": "int32", "a": "float32"}, version=2)
    writer = make_writer(regions[0], [reordered])
    writer.publish_schemas()
    writer.upsert("user", 1, {"a": 1.0, "n": 5}, Position(1), time.time())
    with (
        FeatureClient("eu-west", regions, [V1], timeout_s=READ_TIMEOUT_S) as client,
        pytest.raises(SchemaVersionError, match="not an append-only evolution"),
    ):
        client.get("user", [1])


def test_same_version_different_schema_is_refused(
    regions: list[RegionSettings], make_writer: Callable[..., FeatureWriter]
) -> None:
    other = FeatureSchema.of("user", {"a": "float32", "m": "int32"})  # also version 1
    make_writer(regions[0], [other]).upsert("user", 1, {"a": 1.0, "m": 5}, Position(1), time.time())
    with (
        FeatureClient("eu-west", regions, [V1], timeout_s=READ_TIMEOUT_S) as client,
        pytest.raises(SchemaVersionError, match="two different schemas share one version"),
    ):
        client.get("user", [1])
