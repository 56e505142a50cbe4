"""Model workers: dynamic batching, device/precision handling, the latency budget.

Heavy imports (torch, aiohttp) happen when a submodule is imported, so
``import workers`` stays cheap; the public names are listed here and loaded on
first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from workers.batcher import BatchingConfig, DynamicBatcher
    from workers.client import InferenceAnswer, WorkerClient
    from workers.featurelog import FeatureLogger, FeatureLogSettings
    from workers.features import EdgeCacheFeatureSource, FeatureSource
    from workers.logfiles import join_labels, summarize
    from workers.models import load_served_model
    from workers.runtime import ModelRunner, RuntimeConfig
    from workers.server import InferenceServer, ServerConfig
    from workers.settings import WorkerSettings
    from workers.timing import LatencyBreakdown, ServerTiming

__all__ = [
    "BatchingConfig",
    "DynamicBatcher",
    "EdgeCacheFeatureSource",
    "FeatureLogSettings",
    "FeatureLogger",
    "FeatureSource",
    "InferenceAnswer",
    "InferenceServer",
    "LatencyBreakdown",
    "ModelRunner",
    "RuntimeConfig",
    "ServerConfig",
    "ServerTiming",
    "WorkerClient",
    "WorkerSettings",
    "join_labels",
    "load_served_model",
    "summarize",
]

_HOME = {
    "BatchingConfig": "workers.batcher",
    "DynamicBatcher": "workers.batcher",
    "EdgeCacheFeatureSource": "workers.features",
    "FeatureLogSettings": "workers.featurelog",
    "FeatureLogger": "workers.featurelog",
    "FeatureSource": "workers.features",
    "InferenceAnswer": "workers.client",
    "InferenceServer": "workers.server",
    "LatencyBreakdown": "workers.timing",
    "ModelRunner": "workers.runtime",
    "RuntimeConfig": "workers.runtime",
    "ServerConfig": "workers.server",
    "ServerTiming": "workers.timing",
    "WorkerClient": "workers.client",
    "WorkerSettings": "workers.settings",
    "join_labels": "workers.logfiles",
    "load_served_model": "workers.models",
    "summarize": "workers.logfiles",
}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(f"module 'workers' has no attribute {name!r}")
