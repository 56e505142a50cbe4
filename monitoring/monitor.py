"""The monitor: one collection round over Kafka, the region caches and the CDC source.

:class:`Monitor` keeps the offset history between rounds (the Burrow window),
so ``edgefeed lag --watch`` and the exporter judge each group on how its
offsets moved, and a one-shot ``edgefeed lag`` takes a few observations first.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

from connectors.client import ConnectorStatus
from monitoring.cdc import SlotRow, read_connectors, read_slots
from monitoring.deadletters import ReasonTally
from monitoring.exceptions import MonitoringConfigError, SourceUnavailableError
from monitoring.freshness import RegionTimes, read_region
from monitoring.kafka import KafkaSnapshot, read_kafka
from monitoring.links import link_problems, link_reports
from monitoring.model import (
    ConnectorReport,
    EntityFreshness,
    GroupReport,
    KafkaReport,
    LinkReport,
    PartitionLag,
    RegionReport,
    RegionState,
    Report,
    SlotReport,
    SnapshotReport,
    TaskReport,
    TopicOffsets,
)
from monitoring.scope import ALL, Scope
from monitoring.snapshots import read_snapshots
from monitoring.status import (
    SEVERITY_OF,
    Observation,
    OffsetHistory,
    Series,
    Severity,
    evaluate_partition,
    worst,
    worst_severity,
)
from pipeline.names import PipelineNames

__all__ = [
    "DEADLETTER_TOPIC",
    "ROUTER_GROUP",
    "LinkReader",
    "Monitor",
    "MonitorConfig",
    "RegionTarget",
    "SourceTarget",
    "region_group",
]

_DEFAULT_NAMES = PipelineNames()
ROUTER_GROUP = _DEFAULT_NAMES.router_group
DEADLETTER_TOPIC = _DEFAULT_NAMES.dead_letter_topic


#: Reads the WAN links' state: one mapping per link, as the local stack's emulator
#: reports it (edgefeed.wan's ``status``). Raises SourceUnavailableError when it
#: cannot answer.
LinkReader = Callable[[], Awaitable[Sequence[Mapping[str, Any]]]]


def region_group(region: str) -> str:
    """The consumer group of a region's pipeline worker (default names)."""
    return _DEFAULT_NAMES.region_group(region)


@dataclass(frozen=True, slots=True)
class RegionTarget:
    name: str
    redis_url: str = field(repr=False)  # may hold a password
    #: More redis-py options: the reader's ACL user and TLS (holds a password).
    redis_options: Mapping[str, Any] = field(default_factory=dict, repr=False)


@dataclass(frozen=True, slots=True)
class SourceTarget:
    """A declared CDC source: its connector and its replication slot."""

    name: str
    connector: str
    slot: str
    #: Where its connector writes snapshot notifications (None: not read).
    notification_topic: str | None = None


@dataclass(frozen=True, slots=True)
class MonitorConfig:
    """What to watch and the bounds to judge by.

    Attributes:
        bootstrap_servers: Kafka brokers.
        regions: Region caches.
        sources: Declared CDC sources.
        database_dsn: libpq DSN of the source database; None skips the slots.
        connect_url: Kafka Connect REST URL; None skips the connectors.
        groups: Only these consumer groups; empty: the router's, every
            region's and any other ``edgefeed-*`` group.
        names: The pipeline's topic and group names (pipeline.names, from the
            ``pipeline:`` settings): the same object the pipeline's apps use.
        window: Observations per partition the status rules look at.
        min_interval_s: Observations closer than this to the previous one
            replace it (Burrow's ``min-distance``), so rapid rounds do not
            judge a consumer over a few milliseconds.
        freshness_budget_s: A region is STALE past this with messages pending.
        slot_wal_bound_bytes: Retained WAL past this is an error.
        sample_size: Vectors sampled per region.
        secrets: Values never shown (the database password).
        kafka_options: Security options of the Kafka clients (kafka.security: SASL and
            TLS, as ``aiokafka_options()`` names them; holds a password).
        site_regions: Regions with a broker of their own: a forwarder carries their
            changes, so its group (``<prefix>-forward-<region>``) on the central
            broker is how far behind they are; the other regions' own groups are.
        links: Reads the WAN links (the local stack's emulator); None: no links.
        region_links: Region -> the name of the link its changes cross.
        scope: What this monitor reads and reports (monitoring.scope): all of it,
            the central part (no cache is read), or one region's cache and group
            (no slot, connector, snapshot, link, nor another region's cache or group).
    """

    bootstrap_servers: tuple[str, ...]
    regions: tuple[RegionTarget, ...] = ()
    sources: tuple[SourceTarget, ...] = ()
    database_dsn: str | None = field(default=None, repr=False)
    kafka_options: Mapping[str, Any] = field(default_factory=dict, repr=False)
    connect_url: str | None = field(default=None, repr=False)
    groups: tuple[str, ...] = ()
    names: PipelineNames = _DEFAULT_NAMES
    window: int = 10
    min_interval_s: float = 1.0
    freshness_budget_s: float = 5.0
    slot_wal_bound_bytes: int = 1024**3
    sample_size: int = 20
    timeout_s: float = 10.0
    client_id: str = "edgefeed-monitor"
    secrets: tuple[str, ...] = field(default=(), repr=False)
    site_regions: tuple[str, ...] = ()
    links: LinkReader | None = field(default=None, repr=False)
    region_links: Mapping[str, str] = field(default_factory=dict)
    scope: Scope = ALL

    def __post_init__(self) -> None:
        self.scope.check([r.name for r in self.regions])
        if self.window < 2:
            raise MonitoringConfigError(f"window {self.window} must be at least 2 observations")
        if self.freshness_budget_s <= 0:
            raise MonitoringConfigError(
                f"freshness budget {self.freshness_budget_s}s must be positive"
            )
        if self.slot_wal_bound_bytes <= 0:
            raise MonitoringConfigError(
                f"slot WAL bound {self.slot_wal_bound_bytes} bytes must be positive"
            )
        if self.sample_size < 0:
            raise MonitoringConfigError(f"sample size {self.sample_size} must be 0 or more")

    def selects(self, group: str) -> bool:
        if self.groups:
            return group in self.groups
        return group.startswith("edgefeed-") or self.names.owns_group(group)

    def reads_group(self, group: str) -> bool:
        """Whether a round reads ``group``'s offsets: selected, and reported in this
        scope or needed by it (a region's pending and behind need the router's group
        and the group that carries the region's changes)."""
        return self.selects(group) and self._scope_reads(group)

    def reports_group(self, group: str) -> bool:
        """Whether the report shows ``group``: a declared region's feature group is
        that region's; every other group (router, forwarders) is central."""
        region = self.names.region_of_group(group)
        declared = any(r.name == region for r in self.regions)
        return self.scope.owns(region if declared else None)

    def reads_records_of(self, group: str) -> bool:
        """Whether a round reads the next records of ``group`` (their timestamps give
        its lag in seconds). Not the router's in a region scope: the source topics
        hold every region's rows, and a region's exporter reads only its own."""
        return self.scope.region is None or group != self.names.router_group

    def _scope_reads(self, group: str) -> bool:
        if self.reports_group(group):
            return True
        region = self.scope.region
        return region is not None and group in (
            self.names.router_group,
            self.carrier_group(region),
        )

    @property
    def read_regions(self) -> tuple[RegionTarget, ...]:
        """The region caches this scope reads (none for ``central``)."""
        return tuple(r for r in self.regions if self.scope.owns(r.name))

    @property
    def deadletter_topics(self) -> list[str]:
        """The dead-letter topics this scope counts: the central one is central's, a
        region's is the region's."""
        owned: list[tuple[str | None, str]] = [(None, self.names.dead_letter_topic)]
        owned += [(r.name, self.names.region_dead_letter_topic(r.name)) for r in self.regions]
        return [topic for owner, topic in owned if self.scope.owns(owner)]

    @property
    def deadletter_topic(self) -> str:
        """The dead-letter topic a report names first (the scope's own)."""
        return self.deadletter_topics[0]

    @property
    def expected_groups(self) -> tuple[str, ...]:
        if self.groups:
            expected = self.groups
        else:
            expected = (
                self.names.router_group,
                *(self.carrier_group(r.name) for r in self.regions),
            )
        return tuple(g for g in expected if self._scope_reads(g))

    def carrier_group(self, region: str) -> str:
        """The group on the central broker whose progress is the region's: its
        forwarder's when the region has a site, else its feature worker's."""
        if region in self.site_regions:
            return self.names.forward_group(region)
        return self.names.region_group(region)


class Monitor:
    """Collects rounds and keeps the history that the status rules need."""

    def __init__(self, config: MonitorConfig) -> None:
        self.config = config
        self.history = OffsetHistory(
            window=config.window, max_age_s=3600.0, min_interval_s=config.min_interval_s
        )
        self._topic_history: dict[Any, Series] = {}
        self._group_history: dict[Any, Series] = {}
        self._deadletters = Series(config.window, config.min_interval_s)
        self._reasons = ReasonTally(config.deadletter_topics)

    async def collect(self) -> Report:
        """One round: everything the scope covers read concurrently, then judged."""
        config = self.config
        central = config.scope.central  # slots, connectors, snapshots, links: central's
        kafka_task = read_kafka(
            config.bootstrap_servers,
            select_group=config.reads_group,
            read_records_of=config.reads_records_of,
            client_id=config.client_id,
            request_timeout_ms=int(config.timeout_s * 1000),
            client_options=config.kafka_options,
            reasons=self._reasons,
        )
        region_tasks = [
            read_region(
                r.name,
                r.redis_url,
                sample_size=config.sample_size,
                timeout_s=config.timeout_s,
                redis_options=r.redis_options,
            )
            for r in config.read_regions
        ]
        slot_task = (
            read_slots(config.database_dsn, timeout_s=config.timeout_s)
            if central and config.database_dsn
            else _nothing()
        )
        connect_task = (
            read_connectors(
                config.connect_url,
                [s.connector for s in config.sources],
                timeout_s=config.timeout_s,
                secrets=config.secrets,
            )
            if central and config.connect_url
            else _nothing()
        )
        watched = {s.connector: s.notification_topic for s in config.sources}
        snapshot_task = (
            read_snapshots(
                config.bootstrap_servers,
                {name: topic for name, topic in watched.items() if topic},
                client_id=config.client_id,
                timeout_s=config.timeout_s,
                client_options=config.kafka_options,
            )
            if central
            else _nothing()
        )
        link_task = config.links() if central and config.links is not None else _nothing()
        results = await asyncio.gather(
            kafka_task,
            slot_task,
            connect_task,
            snapshot_task,
            link_task,
            *region_tasks,
            return_exceptions=True,
        )
        now = time.time()
        kafka_result, slot_result, connect_result, snapshot_result, link_result, *region_results = (
            results
        )
        kafka = self._kafka_report(kafka_result, now)
        links: tuple[LinkReport, ...] = ()
        links_error = None if link_result is None else _unavailable(link_result)
        if link_result is not None and links_error is None:
            links = link_reports(cast(Sequence[Mapping[str, Any]], link_result))
        regions = tuple(
            self._region_report(target, result, kafka, now)
            for target, result in zip(config.read_regions, region_results, strict=True)
        )
        # Groups and topics read only for the regions' pending and behind are not shown.
        kafka = replace(
            kafka,
            groups=tuple(g for g in kafka.groups if config.reports_group(g.group)),
            topics=kafka.topics if central else (),
        )
        slots, cdc_error = self._slot_reports(slot_result)
        connectors, connect_error = self._connector_reports(connect_result)
        snapshot_error = _unavailable(snapshot_result)
        snapshots = cast(
            "tuple[SnapshotReport, ...]",
            () if snapshot_error is not None or snapshot_result is None else snapshot_result,
        )
        problems = self._problems(kafka, regions, slots, connectors, cdc_error, connect_error)
        problems += link_problems(links, links_error, regions, config.freshness_budget_s)
        severities: list[Severity] = [g.severity for g in kafka.groups]
        severities += [r.severity for r in regions]
        severities += [s.severity for s in slots]
        severities += [c.severity for c in connectors]
        severities += [link.severity for link in links]
        if kafka.error or cdc_error or connect_error:
            severities.append("ERR")
        if links_error:
            severities.append("WARN")
        if kafka.deadletters_new:
            severities.append("WARN")
        return Report(
            at=now,
            kafka=kafka,
            regions=regions,
            slots=slots,
            connectors=connectors,
            severity=worst_severity(severities),
            problems=problems,
            cdc_error=cdc_error,
            connect_error=connect_error,
            snapshots=snapshots,
            snapshot_error=snapshot_error,
            links=links,
            links_error=links_error,
        )

    # -- Kafka --------------------------------------------------------------------------

    def _kafka_report(self, result: object, now: float) -> KafkaReport:
        topic = self.config.deadletter_topic
        if (error := _unavailable(result)) is not None:
            return KafkaReport((), (), 0, topic, None, None, error=error)
        snap = cast(KafkaSnapshot, result)
        topics: dict[str, tuple[dict[int, int], dict[int, int]]] = {}
        for (name, partition), end in snap.end.items():
            oldest, ends = topics.setdefault(name, ({}, {}))
            ends[partition] = end
            oldest[partition] = snap.oldest.get((name, partition), 0)
        topic_reports = []
        for name in sorted(topics):
            oldest, ends = topics[name]
            rate = self._rate(self._topic_history, name, snap.at, sum(ends.values()))
            topic_reports.append(TopicOffsets(name, oldest, ends, rate))

        seen_keys: list[tuple[str, str, int]] = []
        groups = []
        found = {g.group: g for g in snap.groups}
        names = sorted(set(found) | set(self.config.expected_groups))
        for name in names:
            offsets = found.get(name)
            if offsets is None:
                groups.append(
                    GroupReport(name, self._region_of(name), "Dead", 0, "NOTFOUND", "WARN", ())
                )
                continue
            partitions = []
            per_topic: dict[str, int] = {}
            for (topic_name, partition), committed in sorted(offsets.committed.items()):
                end_offset = snap.end.get((topic_name, partition))
                if end_offset is None:
                    continue
                lag = max(end_offset - committed, 0)
                self.history.add(name, topic_name, partition, Observation(snap.at, committed, lag))
                seen_keys.append((name, topic_name, partition))
                window = self.history.window_of(name, topic_name, partition, snap.at)
                status, reason = evaluate_partition(
                    window,
                    current_lag=lag,
                    has_members=offsets.members is None or offsets.members > 0,
                    min_span_s=self.config.min_interval_s,
                )
                ts = snap.next_timestamp_ms.get((name, topic_name, partition))
                lag_seconds = 0.0 if lag == 0 else (max(now - ts / 1000, 0.0) if ts else None)
                partitions.append(
                    PartitionLag(
                        topic_name,
                        partition,
                        committed,
                        end_offset,
                        lag,
                        lag_seconds,
                        status,
                        reason,
                    )
                )
                per_topic[topic_name] = per_topic.get(topic_name, 0) + committed
            rates = {
                t: r
                for t, total in per_topic.items()
                if (r := self._rate(self._group_history, (name, t), snap.at, total)) is not None
            }
            status = worst(p.status for p in partitions) if partitions else "NOTFOUND"
            groups.append(
                GroupReport(
                    group=name,
                    region=self._region_of(name),
                    state=offsets.state,
                    members=offsets.members,
                    status=status,
                    severity=SEVERITY_OF[status],
                    partitions=tuple(partitions),
                    consume_rate=rates,
                )
            )
        self.history.forget_except(seen_keys)

        dead_topics = self.config.deadletter_topics
        by_topic = tuple(
            (name, sum(topics[name][1].values())) for name in dead_topics if name in topics
        )
        deadletters = sum(count for _name, count in by_topic) if by_topic else None
        new = None
        if deadletters is not None:
            self._deadletters.add(snap.at, deadletters)
            new = self._deadletters.increase()
        return KafkaReport(
            groups=tuple(groups),
            topics=tuple(topic_reports),
            brokers=snap.brokers,
            deadletter_topic=topic,
            deadletters=deadletters,
            deadletters_new=new,
            deadletters_by_topic=by_topic,
            deadletters_by_reason=self._reasons.counts(),
        )

    def _rate(self, store: dict[Any, Series], key: Any, at: float, total: int) -> float | None:
        series = store.get(key)
        if series is None:
            series = store[key] = Series(self.config.window, self.config.min_interval_s)
        series.add(at, total)
        return series.rate()

    # -- regions ------------------------------------------------------------------------

    def _region_report(
        self, target: RegionTarget, result: object, kafka: KafkaReport, now: float
    ) -> RegionReport:
        pending = self._pending(kafka, target.name)
        behind = self._behind(kafka, target.name)
        link = self.config.region_links.get(target.name)
        if (error := _unavailable(result)) is not None:
            return RegionReport(
                target.name,
                "DOWN",
                "ERR",
                None,
                pending,
                (),
                error=error,
                behind_seconds=behind,
                link=link,
            )
        times = cast(RegionTimes, result)
        entities = []
        for e in times.entities:
            sample = [now - us / 1e6 for us in e.sample_commit_us]
            entities.append(
                EntityFreshness(
                    entity=e.entity,
                    freshness_seconds=None if e.commit_us is None else now - e.commit_us / 1e6,
                    write_delay_seconds=(
                        None
                        if e.commit_us is None or e.write_us is None
                        else (e.write_us - e.commit_us) / 1e6
                    ),
                    lsn=e.lsn,
                    sampled=len(sample),
                    sample_oldest_seconds=max(sample) if sample else None,
                    sample_newest_seconds=min(sample) if sample else None,
                )
            )
        ages = [e.freshness_seconds for e in entities if e.freshness_seconds is not None]
        freshness = min(ages) if ages else None
        budget = self.config.freshness_budget_s
        state: RegionState
        severity: Severity
        if freshness is None:
            state, severity = "NODATA", "WARN"
        elif freshness <= budget:
            state, severity = "OK", "OK"
        elif pending:
            state, severity = "STALE", "ERR"
        else:
            state, severity = "IDLE", "OK"
        if times.rebuilding and state in ("OK", "IDLE", "NODATA"):
            # Windows short of the history being rebuilt: never shown as complete.
            state, severity = "REBUILDING", "WARN"
        if times.quarantined and severity == "OK":
            severity = "WARN"  # some entities' vectors are stuck; the rest flow
        if behind is not None and behind > budget and severity == "OK":
            severity = "WARN"  # changes wait for it (a cut link, a slow forwarder)
        return RegionReport(
            target.name,
            state,
            severity,
            freshness,
            pending,
            tuple(entities),
            quarantined=times.quarantined,
            quarantine_sample=times.quarantine_sample,
            rebuilding=times.rebuilding,
            behind_seconds=behind,
            link=link,
        )

    def _behind(self, kafka: KafkaReport, region: str) -> float | None:
        """Seconds behind: the oldest change not yet past the router or the region's
        carrier group (its forwarder's with a site: held by a cut link, it grows).

        A region scope reads no record of the source topics (they hold every region's
        rows), so the router's seconds are unknown there: its behind counts from the
        router's output, and the central scope exports the router's own seconds.
        """
        if kafka.error:
            return None
        router, carrier = self.config.names.router_group, self.config.carrier_group(region)
        wanted = (router, carrier) if self.config.reads_records_of(router) else (carrier,)
        found = [g.lag_seconds for g in kafka.groups if g.group in wanted and g.partitions]
        return max(found) if found else None

    # -- CDC ----------------------------------------------------------------------------

    def _slot_reports(self, result: object) -> tuple[tuple[SlotReport, ...], str | None]:
        if result is None:
            return (), None
        if (error := _unavailable(result)) is not None:
            return (), error
        rows: Sequence[SlotRow] = result  # type: ignore[assignment]
        owners = {s.slot: s.name for s in self.config.sources}
        bound = self.config.slot_wal_bound_bytes
        reports = []
        for row in rows:
            retained = row.retained_wal_bytes or 0
            severity: Severity
            if retained > bound:
                severity, reason = "ERR", f"retains {retained} bytes of WAL, over {bound}"
            elif row.wal_status in ("lost", "unreserved"):
                severity, reason = (
                    "ERR",
                    f"wal_status {row.wal_status}: WAL needed is being removed",
                )
            elif not row.active:
                severity, reason = "WARN", "inactive: nothing reads it, WAL accumulates"
            else:
                severity, reason = "OK", "active"
            reports.append(
                SlotReport(
                    slot=row.slot,
                    plugin=row.plugin,
                    slot_type=row.slot_type,
                    database=row.database,
                    active=row.active,
                    retained_wal_bytes=row.retained_wal_bytes,
                    flush_lag_bytes=row.flush_lag_bytes,
                    wal_status=row.wal_status,
                    source=owners.get(row.slot),
                    severity=severity,
                    reason=reason,
                )
            )
        return tuple(reports), None

    def _connector_reports(self, result: object) -> tuple[tuple[ConnectorReport, ...], str | None]:
        if result is None:
            return (), None
        if (error := _unavailable(result)) is not None:
            return (), error
        statuses: dict[str, ConnectorStatus | None] = result  # type: ignore[assignment]
        reports = []
        for name, status in statuses.items():
            if status is None:
                reports.append(
                    ConnectorReport(name, "ABSENT", (), "declared but not deployed", "ERR")
                )
                continue
            tasks = tuple(TaskReport(t.id, t.state, t.worker_id, t.cause) for t in status.tasks)
            severity: Severity
            if status.failed:
                severity = "ERR"
            elif status.running:
                severity = "OK"
            else:
                severity = "WARN"
            reports.append(ConnectorReport(name, status.state, tasks, status.failure(), severity))
        return tuple(reports), None

    def _region_of(self, group: str) -> str | None:
        names = self.config.names
        forwarded = next(
            (r for r in self.config.site_regions if names.forward_group(r) == group), None
        )
        return forwarded or names.region_of_group(group)

    def _pending(self, kafka: KafkaReport, region: str) -> int | None:
        """Messages waiting for ``region``: the router's lag, plus the region's topic
        beyond its group's committed offsets (all of it where the group never committed)."""
        if kafka.error:
            return None
        names = self.config.names
        router = next((g for g in kafka.groups if g.group == names.router_group), None)
        total = router.lag if router else 0
        topic_name = names.region_topic(region)
        topic = next((t for t in kafka.topics if t.topic == topic_name), None)
        if topic is None:
            return total
        group_name = self.config.carrier_group(region)
        group = next((g for g in kafka.groups if g.group == group_name), None)
        committed = {
            p.partition: p.lag or 0
            for p in (group.partitions if group else ())
            if p.topic == topic_name
        }
        for partition, end in topic.end.items():
            if partition in committed:
                total += committed[partition]
            else:
                total += max(end - topic.oldest.get(partition, 0), 0)
        return total

    @staticmethod
    def _problems(
        kafka: KafkaReport,
        regions: Sequence[RegionReport],
        slots: Sequence[SlotReport],
        connectors: Sequence[ConnectorReport],
        cdc_error: str | None,
        connect_error: str | None,
    ) -> tuple[str, ...]:
        problems = [e for e in (kafka.error, cdc_error, connect_error) if e]
        for g in kafka.groups:
            if g.severity != "OK":
                bad = next((p for p in g.partitions if p.status == g.status), None)
                where = f" {bad.topic}[{bad.partition}]: {bad.reason}" if bad else ""
                problems.append(f"group {g.group} {g.status}{where}")
        for r in regions:
            if r.severity != "OK" and r.state != "OK":
                problems.append(
                    f"region {r.region} {r.state}" + (f": {r.error}" if r.error else "")
                )
            if r.rebuilding:
                problems.append(
                    f"region {r.region}: rebuilding {', '.join(r.rebuilding)} from the source "
                    "(the stream's history did not cover the windows; vectors short until done)"
                )
            if r.quarantined:
                first = r.quarantine_sample[0] if r.quarantine_sample else None
                problems.append(
                    f"region {r.region}: {r.quarantined} entit"
                    f"{'y' if r.quarantined == 1 else 'ies'} quarantined (vectors not written)"
                    + (f", e.g. {first[0]}: {first[1]}" if first else "")
                )
        for s in slots:
            if s.severity != "OK":
                problems.append(f"slot {s.slot}: {s.reason}")
        for c in connectors:
            if c.severity != "OK":
                problems.append(
                    f"connector {c.name} {c.state}" + (f": {c.failure}" if c.failure else "")
                )
        if kafka.deadletters_new:
            problems.append(
                f"{kafka.deadletters_new} new dead letter(s) on {kafka.deadletter_topic}"
                + (
                    " and the regions' dead-letter topics"
                    if len(kafka.deadletters_by_topic) > 1
                    else ""
                )
            )
        return tuple(problems)


def _unavailable(result: object) -> str | None:
    """The message of a source that could not be read this round, else None.

    ``collect`` gathers its reads with ``return_exceptions=True``: a
    :class:`SourceUnavailableError` marks its section of the report, any other
    exception is a bug and propagates.
    """
    if not isinstance(result, BaseException):
        return None
    if isinstance(result, SourceUnavailableError):
        return str(result)
    raise result


async def _nothing() -> None:
    return None
