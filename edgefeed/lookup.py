"""Feature lookup clients built from the settings file: what serving code calls.

from edgefeed.lookup import feature_client
client = feature_client(load_settings("edgefeed.yaml"), region="eu-west")
vectors = client.get("user", [42])
"""

from __future__ import annotations

from typing import Any

from edge_cache import AsyncFeatureClient, FeatureClient, FeatureSchema
from edgefeed.settings import EdgefeedSettings
from pipeline.features import FeatureEngine

__all__ = ["async_feature_client", "feature_client", "feature_schemas"]


def feature_schemas(settings: EdgefeedSettings) -> list[FeatureSchema]:
    """The schema of every declared entity type, exactly as the pipeline writes it."""
    return FeatureEngine(settings.entities).schemas


def feature_client(settings: EdgefeedSettings, region: str, **options: Any) -> FeatureClient:
    """A blocking lookup client for ``region`` (options: timeout_s, near_cache, ...)."""
    return FeatureClient.from_settings(settings, region, feature_schemas(settings), **options)


def async_feature_client(
    settings: EdgefeedSettings, region: str, **options: Any
) -> AsyncFeatureClient:
    """The asyncio lookup client for ``region``."""
    return AsyncFeatureClient.from_settings(settings, region, feature_schemas(settings), **options)
