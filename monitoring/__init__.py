"""Lag and freshness monitoring: consumer lag with Burrow-style status, per-region
cache freshness, CDC slot and connector health, and a Prometheus exporter."""

from __future__ import annotations

from monitoring.endpoint import EndpointSecurity
from monitoring.exceptions import MonitoringConfigError, MonitoringError, SourceUnavailableError
from monitoring.exporter import METRIC_NAMES, ReportCollector, make_registry, serve
from monitoring.model import (
    ConnectorReport,
    EntityFreshness,
    GroupReport,
    KafkaReport,
    LinkReport,
    PartitionLag,
    RegionReport,
    Report,
    SlotReport,
    TaskReport,
    TopicOffsets,
)
from monitoring.monitor import (
    DEADLETTER_TOPIC,
    ROUTER_GROUP,
    LinkReader,
    Monitor,
    MonitorConfig,
    RegionTarget,
    SourceTarget,
    region_group,
)
from monitoring.scope import Scope
from monitoring.status import Observation, OffsetHistory, evaluate_partition

__all__ = [
    "DEADLETTER_TOPIC",
    "METRIC_NAMES",
    "ROUTER_GROUP",
    "ConnectorReport",
    "EndpointSecurity",
    "EntityFreshness",
    "GroupReport",
    "KafkaReport",
    "LinkReader",
    "LinkReport",
    "Monitor",
    "MonitorConfig",
    "MonitoringConfigError",
    "MonitoringError",
    "Observation",
    "OffsetHistory",
    "PartitionLag",
    "RegionReport",
    "RegionTarget",
    "Report",
    "ReportCollector",
    "Scope",
    "SlotReport",
    "SourceTarget",
    "SourceUnavailableError",
    "TaskReport",
    "TopicOffsets",
    "evaluate_partition",
    "make_registry",
    "region_group",
    "serve",
]
