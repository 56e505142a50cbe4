"""The per-region Redis edge cache: key layout, writer and the feature lookup client."""

from __future__ import annotations

from edge_cache.breaker import CircuitBreaker
from edge_cache.client import AsyncFeatureClient, FeatureClient
from edge_cache.exceptions import (
    ConfigError,
    CorruptValueError,
    EdgeCacheError,
    ForeignValueError,
    InvalidValueError,
    LookupOverloadedError,
    LookupTimeoutError,
    PoolExhaustedError,
    RegionUnavailableError,
    SchemaError,
    SchemaVersionError,
    UnknownEntityError,
    UnknownFeatureError,
)
from edge_cache.freshness import FreshnessSnapshot, read_freshness
from edge_cache.layout import FreshnessRecord, KeyLayout, Position, Schedule
from edge_cache.nearcache import NearCacheConfig
from edge_cache.result import FeatureVectors
from edge_cache.schema import Dtype, Feature, FeatureSchema
from edge_cache.settings import RedisTLSSettings, RedisUserSettings, RegionSettings
from edge_cache.writer import AsyncFeatureWriter, Delete, FeatureWriter, Upsert, WriteOp

__all__ = [
    "AsyncFeatureClient",
    "AsyncFeatureWriter",
    "CircuitBreaker",
    "ConfigError",
    "CorruptValueError",
    "Delete",
    "Dtype",
    "EdgeCacheError",
    "Feature",
    "FeatureClient",
    "FeatureSchema",
    "FeatureVectors",
    "FeatureWriter",
    "ForeignValueError",
    "FreshnessRecord",
    "FreshnessSnapshot",
    "InvalidValueError",
    "KeyLayout",
    "LookupOverloadedError",
    "LookupTimeoutError",
    "NearCacheConfig",
    "PoolExhaustedError",
    "Position",
    "RedisTLSSettings",
    "RedisUserSettings",
    "RegionSettings",
    "RegionUnavailableError",
    "Schedule",
    "SchemaError",
    "SchemaVersionError",
    "UnknownEntityError",
    "UnknownFeatureError",
    "Upsert",
    "WriteOp",
    "read_freshness",
]
