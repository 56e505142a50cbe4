"""What one collection round found: plain frozen values, with ``as_dict`` for ``--json``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from monitoring.status import PartitionStatus, Severity

__all__ = [
    "ConnectorReport",
    "EntityFreshness",
    "GroupReport",
    "KafkaReport",
    "LinkReport",
    "LinkState",
    "PartitionLag",
    "RegionReport",
    "RegionState",
    "Report",
    "SlotReport",
    "SnapshotReport",
    "SnapshotTable",
    "TaskReport",
    "TopicOffsets",
]

RegionState = Literal["OK", "IDLE", "STALE", "NODATA", "DOWN", "REBUILDING"]
LinkState = Literal["UP", "CUT", "DOWN"]


@dataclass(frozen=True, slots=True)
class PartitionLag:
    """One partition of one consumer group.

    Attributes:
        committed: The group's committed offset (the next record it will read);
            None when it has none.
        end: The partition's end offset (high watermark).
        lag: ``end - committed``; None without a committed offset.
        lag_seconds: Now minus the timestamp of the next unconsumed record (the
            one at ``committed``); 0 when caught up; None when unknown.
        status: Burrow-style status over the window.
        reason: Why, in one line.
    """

    topic: str
    partition: int
    committed: int | None
    end: int
    lag: int | None
    lag_seconds: float | None
    status: PartitionStatus
    reason: str


@dataclass(frozen=True, slots=True)
class GroupReport:
    """One consumer group.

    Attributes:
        group: The group id.
        region: The region of a regional group (``edgefeed-region-<region>``).
        state: The coordinator's group state (Stable, Empty, ...).
        members: Live members (None when the coordinator could not say).
        status: Worst partition status (OK, WARN, STOP, STALL, REWIND, NOTFOUND).
        severity: Burrow's group status: OK, WARN or ERR.
        consume_rate: Messages per second committed over the window, per topic.
    """

    group: str
    region: str | None
    state: str
    members: int | None
    status: PartitionStatus
    severity: Severity
    partitions: tuple[PartitionLag, ...]
    consume_rate: dict[str, float] = field(default_factory=dict)

    @property
    def lag(self) -> int:
        return sum(p.lag or 0 for p in self.partitions)

    @property
    def lag_seconds(self) -> float:
        return max((p.lag_seconds or 0.0 for p in self.partitions), default=0.0)


@dataclass(frozen=True, slots=True)
class TopicOffsets:
    """A topic's partitions' oldest and end offsets and its produce rate."""

    topic: str
    oldest: dict[int, int]
    end: dict[int, int]
    produce_rate: float | None


@dataclass(frozen=True, slots=True)
class KafkaReport:
    """The Kafka side: groups, topics and the dead-letter topic."""

    groups: tuple[GroupReport, ...]
    topics: tuple[TopicOffsets, ...]
    brokers: int
    deadletter_topic: str
    deadletters: int | None
    deadletters_new: int | None
    error: str | None = None
    # Per dead-letter topic (the central one and each region's): messages ever written.
    deadletters_by_topic: tuple[tuple[str, int], ...] = ()
    # (topic, reason, count) of the dead letters read so far (monitoring.deadletters).
    deadletters_by_reason: tuple[tuple[str, str, int], ...] = ()


@dataclass(frozen=True, slots=True)
class EntityFreshness:
    """One entity (table) in one region's cache.

    Attributes:
        freshness_seconds: Now minus the source commit time of the newest vector
            the pipeline wrote (from ``ef:freshness:<entity>``).
        write_delay_seconds: Write time minus commit time of that vector: how
            long the change took from the source commit into the cache.
        lsn: Source log position of that vector.
        sampled: Vectors read from the sample of keys.
        sample_oldest_seconds: Now minus the oldest source commit time in the sample.
        sample_newest_seconds: Now minus the newest source commit time in the sample.
    """

    entity: str
    freshness_seconds: float | None
    write_delay_seconds: float | None
    lsn: str | None
    sampled: int
    sample_oldest_seconds: float | None
    sample_newest_seconds: float | None


@dataclass(frozen=True, slots=True)
class RegionReport:
    """One region's cache.

    Attributes:
        state: OK (within budget), IDLE (over budget but nothing pending for the
            region: the source is quiet), STALE (over budget with messages
            pending), NODATA (no freshness record yet), DOWN (Redis unreachable).
        pending: Messages waiting for this region (router lag + its group's lag).
        quarantined: Entities the pipeline cannot write (their vectors stay stale until
            the cause is fixed); any makes the region WARN.
        quarantine_sample: A few of them: (``<entity>:<id>``, why).
        rebuilding: Entity types whose history the pipeline is rebuilding from the
            source (pipeline.history): the region is REBUILDING, not OK, until it ends.
    """

    region: str
    state: RegionState
    severity: Severity
    freshness_seconds: float | None
    pending: int | None
    entities: tuple[EntityFreshness, ...]
    error: str | None = None
    quarantined: int = 0
    quarantine_sample: tuple[tuple[str, str], ...] = ()
    behind_seconds: float | None = None
    link: str | None = None
    rebuilding: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class LinkReport:
    """One WAN link between two sites (what the local stack's emulator reports).

    Attributes:
        name: The link (``central-<region>`` for a region's link).
        state: UP (carries traffic), CUT (a partition: nothing crosses), DOWN
            (the endpoint behind it refuses connections).
        reachable: True when UP.
        cut_for_s: How long the current cut has lasted.
        delay_ms: The link's configured one-way delay.
        observed_delay_ms: Moving average of the one-way delay chunks took.
        bytes_per_s_up: Towards the endpoint (central -> region), recent seconds.
        bytes_per_s_down: Back from the endpoint, recent seconds.
        bytes_up: Bytes ever carried towards the endpoint.
        bytes_down: Bytes ever carried back.
        connections: Connections open across it.
        error: Why the endpoint is unreachable (state DOWN).
    """

    name: str
    state: LinkState
    severity: Severity
    reachable: bool
    cut_for_s: float | None
    delay_ms: float
    observed_delay_ms: float
    bytes_per_s_up: float
    bytes_per_s_down: float
    bytes_up: int
    bytes_down: int
    connections: int
    error: str | None = None


@dataclass(frozen=True, slots=True)
class SlotReport:
    """One PostgreSQL replication slot."""

    slot: str
    plugin: str | None
    slot_type: str
    database: str | None
    active: bool
    retained_wal_bytes: int | None
    flush_lag_bytes: int | None
    wal_status: str | None
    source: str | None
    severity: Severity
    reason: str


@dataclass(frozen=True, slots=True)
class TaskReport:
    id: int
    state: str
    worker_id: str
    cause: str | None


@dataclass(frozen=True, slots=True)
class ConnectorReport:
    """One Kafka Connect connector (ABSENT when declared but not deployed)."""

    name: str
    state: str
    tasks: tuple[TaskReport, ...]
    failure: str | None
    severity: Severity


@dataclass(frozen=True, slots=True)
class SnapshotTable:
    """One table of an incremental snapshot.

    Attributes:
        rows: Rows read, once its scan completed (Debezium reports no count before).
        status: PENDING, RUNNING, or Debezium's scan status (SUCCEEDED, EMPTY, ...).
    """

    table: str
    rows: int | None
    status: str


@dataclass(frozen=True, slots=True)
class SnapshotReport:
    """A connector's newest incremental snapshot (``edgefeed connectors snapshot``).

    Attributes:
        id: Debezium's notification id of the snapshot.
        state: RUNNING, PACED (held between an edgefeed pacer's pulses), PAUSED,
            COMPLETED or ABORTED.
        current_table: The table being read, while one is.
        last_key / max_key: The last key read of it and its largest key (how far).
        updated_ms: When the newest notification was written.
    """

    connector: str
    id: str
    state: str
    tables: tuple[SnapshotTable, ...]
    current_table: str | None
    last_key: str | None
    max_key: str | None
    updated_ms: int | None

    @property
    def rows(self) -> int:
        """Rows read by the tables done so far."""
        return sum(t.rows or 0 for t in self.tables)


@dataclass(frozen=True, slots=True)
class Report:
    """Everything one round collected, and the overall severity."""

    at: float
    kafka: KafkaReport
    regions: tuple[RegionReport, ...]
    slots: tuple[SlotReport, ...]
    connectors: tuple[ConnectorReport, ...]
    severity: Severity
    problems: tuple[str, ...]
    cdc_error: str | None = None
    connect_error: str | None = None
    snapshots: tuple[SnapshotReport, ...] = ()
    snapshot_error: str | None = None
    links: tuple[LinkReport, ...] = ()
    links_error: str | None = None

    def link(self, name: str) -> LinkReport | None:
        return next((link for link in self.links if link.name == name), None)

    def group(self, name: str) -> GroupReport | None:
        return next((g for g in self.kafka.groups if g.group == name), None)

    def region(self, name: str) -> RegionReport | None:
        return next((r for r in self.regions if r.region == name), None)

    def slot(self, name: str) -> SlotReport | None:
        return next((s for s in self.slots if s.slot == name), None)

    def connector(self, name: str) -> ConnectorReport | None:
        return next((c for c in self.connectors if c.name == name), None)

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for group, raw in zip(self.kafka.groups, data["kafka"]["groups"], strict=True):
            raw["lag"] = group.lag
            raw["lag_seconds"] = group.lag_seconds
        return data
