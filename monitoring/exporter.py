"""A Prometheus endpoint exposing what :class:`~monitoring.monitor.Monitor` collects.

Metric names follow kafka_exporter where they mean the same thing, so existing
Kafka dashboards and alerts keep working; the rest are ``edgefeed_*``. A
collection loop refreshes one :class:`Report` every interval and each scrape
renders the latest one, so a scrape never waits on Kafka, Redis or PostgreSQL
and many scrapers cost no extra load.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from monitoring.endpoint import EndpointSecurity, is_loopback, start_endpoint
from monitoring.exceptions import MonitoringConfigError
from monitoring.model import Report
from monitoring.monitor import Monitor
from monitoring.page import FreshnessHistory, StatusBoard
from monitoring.scope import ALL, Scope
from monitoring.status import STATUS_CODES

__all__ = ["METRIC_NAMES", "ReportCollector", "make_registry", "serve"]

log = logging.getLogger(__name__)

_SEVERITY_CODES = {"OK": 0, "WARN": 1, "ERR": 2}

#: Every metric family the exporter can emit (as exposed, counters with ``_total``).
METRIC_NAMES: tuple[str, ...] = (
    "kafka_brokers",
    "kafka_topic_partitions",
    "kafka_topic_partition_current_offset",
    "kafka_topic_partition_oldest_offset",
    "kafka_consumergroup_current_offset",
    "kafka_consumergroup_current_offset_sum",
    "kafka_consumergroup_lag",
    "kafka_consumergroup_lag_sum",
    "kafka_consumergroup_members",
    "edgefeed_consumergroup_lag_seconds",
    "edgefeed_consumergroup_max_lag_seconds",
    "edgefeed_consumergroup_status",
    "edgefeed_consumergroup_partition_status",
    "edgefeed_consumergroup_consume_rate",
    "edgefeed_topic_produce_rate",
    "edgefeed_deadletter_messages_total",
    "edgefeed_deadletter_reason_messages_total",
    "edgefeed_cache_freshness_seconds",
    "edgefeed_cache_write_delay_seconds",
    "edgefeed_cache_sample_oldest_seconds",
    "edgefeed_cache_sampled_vectors",
    "edgefeed_region_freshness_seconds",
    "edgefeed_region_pending_messages",
    "edgefeed_region_status",
    "edgefeed_region_quarantined_entities",
    "edgefeed_region_rebuilding",
    "edgefeed_region_behind_seconds",
    "edgefeed_link_up",
    "edgefeed_link_cut_seconds",
    "edgefeed_link_delay_seconds",
    "edgefeed_link_observed_delay_seconds",
    "edgefeed_link_bytes_per_second",
    "edgefeed_link_bytes_total",
    "edgefeed_link_connections",
    "edgefeed_freshness_budget_seconds",
    "edgefeed_replication_slot_retained_wal_bytes",
    "edgefeed_replication_slot_flush_lag_bytes",
    "edgefeed_replication_slot_active",
    "edgefeed_replication_slot_wal_bound_bytes",
    "edgefeed_connector_state",
    "edgefeed_connector_task_state",
    "edgefeed_connector_failed_tasks",
    "edgefeed_snapshot_state",
    "edgefeed_snapshot_rows",
    "edgefeed_up",
    "edgefeed_monitor_severity",
    "edgefeed_monitor_last_collect_timestamp_seconds",
    "edgefeed_monitor_collect_duration_seconds",
)

_SNAPSHOT_STATES = ("RUNNING", "PACED", "PAUSED", "COMPLETED", "ABORTED")
_CONNECT_STATES = ("RUNNING", "PAUSED", "STOPPED", "FAILED", "UNASSIGNED", "RESTARTING", "ABSENT")


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


class ReportCollector(Collector):
    """Renders the latest :class:`Report` (set by the collection loop) on each scrape.

    With a ``scope`` other than ``all`` it emits only what that scope owns
    (monitoring.scope), plus what describes the exporter itself (its severity,
    collection time and duration, whether it could read Kafka, the budget it
    judges regions by), so that the series of a central exporter and of every
    region's exporter add up to one ``all`` exporter's.
    """

    def __init__(
        self, freshness_budget_s: float, slot_wal_bound_bytes: int, scope: Scope = ALL
    ) -> None:
        self._lock = threading.Lock()
        self._report: Report | None = None
        self._duration = 0.0
        self._budget = freshness_budget_s
        self._bound = slot_wal_bound_bytes
        self._scope = scope

    def update(self, report: Report, duration_s: float) -> None:
        with self._lock:
            self._report, self._duration = report, duration_s

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            report, duration = self._report, self._duration
        central = self._scope.central
        if self._scope.judges_regions:
            budget = _gauge("edgefeed_freshness_budget_seconds", "Freshness budget per region.", [])
            budget.add_metric([], self._budget)
            yield budget
        if central:
            bound = _gauge(
                "edgefeed_replication_slot_wal_bound_bytes", "Retained WAL bound per slot.", []
            )
            bound.add_metric([], float(self._bound))
            yield bound
        if report is None:
            return
        yield from self._kafka(report)
        yield from self._regions(report)
        yield from self._cdc(report)
        yield from self._links(report)
        up = _gauge(
            "edgefeed_up", "1 when the last collection could read the component.", ["component"]
        )
        up.add_metric(["kafka"], 0.0 if report.kafka.error else 1.0)
        for region in report.regions:
            up.add_metric([f"redis:{region.region}"], 0.0 if region.state == "DOWN" else 1.0)
        if central:  # a region's exporter never reads them: not reported, not down
            up.add_metric(["postgres"], 0.0 if report.cdc_error else 1.0)
            up.add_metric(["connect"], 0.0 if report.connect_error else 1.0)
        if report.links or report.links_error:
            up.add_metric(["wan"], 0.0 if report.links_error else 1.0)
        yield up
        sev = _gauge("edgefeed_monitor_severity", "Overall: 0 OK, 1 WARN, 2 ERR.", [])
        sev.add_metric([], _SEVERITY_CODES[report.severity])
        yield sev
        last = _gauge(
            "edgefeed_monitor_last_collect_timestamp_seconds", "When the report was collected.", []
        )
        last.add_metric([], report.at)
        yield last
        took = _gauge(
            "edgefeed_monitor_collect_duration_seconds", "Last collection's duration.", []
        )
        took.add_metric([], duration)
        yield took

    def _kafka(self, report: Report) -> Iterator[Metric]:
        kafka = report.kafka
        if self._scope.central:  # the cluster's, not a region's
            brokers = _gauge("kafka_brokers", "Number of brokers in the cluster.", [])
            brokers.add_metric([], kafka.brokers)
            yield brokers
        partitions = _gauge("kafka_topic_partitions", "Number of partitions of a topic.", ["topic"])
        current = _gauge(
            "kafka_topic_partition_current_offset",
            "Current offset (end offset) of a partition.",
            ["topic", "partition"],
        )
        oldest = _gauge(
            "kafka_topic_partition_oldest_offset",
            "Oldest offset of a partition.",
            ["topic", "partition"],
        )
        produce = _gauge(
            "edgefeed_topic_produce_rate",
            "Messages per second appended over the window.",
            ["topic"],
        )
        for topic in kafka.topics:
            partitions.add_metric([topic.topic], len(topic.end))
            for index, end in sorted(topic.end.items()):
                current.add_metric([topic.topic, str(index)], end)
                oldest.add_metric([topic.topic, str(index)], topic.oldest.get(index, 0))
            if topic.produce_rate is not None:
                produce.add_metric([topic.topic], topic.produce_rate)
        yield from (partitions, current, oldest, produce)

        labels = ["consumergroup", "topic", "partition"]
        g_offset = _gauge(
            "kafka_consumergroup_current_offset", "Committed offset of a group.", labels
        )
        g_offset_sum = _gauge(
            "kafka_consumergroup_current_offset_sum",
            "Sum of a group's committed offsets.",
            labels[:2],
        )
        g_lag = _gauge("kafka_consumergroup_lag", "Lag of a group in messages.", labels)
        g_lag_sum = _gauge(
            "kafka_consumergroup_lag_sum", "A group's lag summed over partitions.", labels[:2]
        )
        members = _gauge(
            "kafka_consumergroup_members", "Live members of a group.", ["consumergroup"]
        )
        lag_s = _gauge(
            "edgefeed_consumergroup_lag_seconds",
            "Now minus the timestamp of the next unconsumed record.",
            [*labels, "region"],
        )
        max_lag_s = _gauge(
            "edgefeed_consumergroup_max_lag_seconds",
            "A group's largest lag in seconds over its partitions.",
            ["consumergroup", "region"],
        )
        status = _gauge(
            "edgefeed_consumergroup_status",
            "Burrow-style group status: 0 NOTFOUND, 1 OK, 2 WARN, 4 STOP, 5 STALL, 6 REWIND.",
            ["consumergroup", "region", "status"],
        )
        p_status = _gauge(
            "edgefeed_consumergroup_partition_status",
            "Burrow-style partition status (codes as edgefeed_consumergroup_status).",
            labels,
        )
        rate = _gauge(
            "edgefeed_consumergroup_consume_rate",
            "Messages per second a group committed over the window.",
            ["consumergroup", "topic", "region"],
        )
        for g in kafka.groups:
            region = g.region or ""
            if g.members is not None:
                members.add_metric([g.group], g.members)
            status.add_metric([g.group, region, g.status], STATUS_CODES[g.status])
            max_lag_s.add_metric([g.group, region], g.lag_seconds)
            sums: dict[str, tuple[int, int]] = {}
            for p in g.partitions:
                key = [g.group, p.topic, str(p.partition)]
                if p.committed is not None:
                    g_offset.add_metric(key, p.committed)
                if p.lag is not None:
                    g_lag.add_metric(key, p.lag)
                if p.lag_seconds is not None:
                    lag_s.add_metric([*key, region], p.lag_seconds)
                p_status.add_metric(key, STATUS_CODES[p.status])
                o, lag = sums.get(p.topic, (0, 0))
                sums[p.topic] = (o + (p.committed or 0), lag + (p.lag or 0))
            for name, (o, lag) in sums.items():
                g_offset_sum.add_metric([g.group, name], o)
                g_lag_sum.add_metric([g.group, name], lag)
            for name, r in g.consume_rate.items():
                rate.add_metric([g.group, name, region], r)
        yield from (g_offset, g_offset_sum, g_lag, g_lag_sum, members, lag_s, max_lag_s)
        yield from (status, p_status, rate)
        if kafka.deadletters is not None:
            dead = CounterMetricFamily(
                "edgefeed_deadletter_messages",
                "Messages ever written to a dead-letter topic (central, or a region's).",
                labels=["topic"],
            )
            for name, count in kafka.deadletters_by_topic or (
                (kafka.deadletter_topic, kafka.deadletters),
            ):
                dead.add_metric([name], count)
            yield dead
        if kafka.deadletters_by_reason:
            # Read from the dead letters' reason header since the exporter started
            # (monitoring.deadletters): a counter that starts again with the exporter.
            reasons = CounterMetricFamily(
                "edgefeed_deadletter_reason_messages",
                "Dead letters read since the exporter started, by topic and reason.",
                labels=["topic", "reason"],
            )
            for name, reason, count in kafka.deadletters_by_reason:
                reasons.add_metric([name, reason], count)
            yield reasons

    def _regions(self, report: Report) -> Iterator[Metric]:
        labels = ["region", "entity"]
        fresh = _gauge(
            "edgefeed_cache_freshness_seconds",
            "Now minus the source commit time of the newest vector written.",
            labels,
        )
        delay = _gauge(
            "edgefeed_cache_write_delay_seconds",
            "Write time minus source commit time of the newest vector.",
            labels,
        )
        oldest = _gauge(
            "edgefeed_cache_sample_oldest_seconds",
            "Now minus the oldest source commit time among sampled vectors.",
            labels,
        )
        sampled = _gauge("edgefeed_cache_sampled_vectors", "Vectors sampled.", labels)
        region_fresh = _gauge(
            "edgefeed_region_freshness_seconds",
            "A region's freshest entity's freshness.",
            ["region"],
        )
        pending = _gauge(
            "edgefeed_region_pending_messages",
            "Messages waiting for a region (router lag plus the region group's lag).",
            ["region"],
        )
        state = _gauge(
            "edgefeed_region_status",
            "1 for the region's current state (OK, IDLE, STALE, NODATA, DOWN, REBUILDING).",
            ["region", "state"],
        )
        quarantined = _gauge(
            "edgefeed_region_quarantined_entities",
            "Entities whose vectors the pipeline cannot write (stale until fixed).",
            ["region"],
        )
        rebuilding = _gauge(
            "edgefeed_region_rebuilding",
            "1 for each entity type whose history the pipeline is rebuilding from the "
            "source in the region (its windows are short until it ends).",
            ["region", "entity"],
        )
        behind = _gauge(
            "edgefeed_region_behind_seconds",
            "Age of the oldest change not yet past the router and the group that carries "
            "the region's changes (its forwarder's, with a site of its own).",
            ["region", "link"],
        )
        for r in report.regions:
            if r.behind_seconds is not None:
                behind.add_metric([r.region, r.link or ""], r.behind_seconds)
            if r.state != "DOWN":
                quarantined.add_metric([r.region], r.quarantined)
                for entity in r.rebuilding:
                    rebuilding.add_metric([r.region, entity], 1.0)
            for e in r.entities:
                key = [r.region, e.entity]
                if e.freshness_seconds is not None:
                    fresh.add_metric(key, e.freshness_seconds)
                if e.write_delay_seconds is not None:
                    delay.add_metric(key, e.write_delay_seconds)
                if e.sample_oldest_seconds is not None:
                    oldest.add_metric(key, e.sample_oldest_seconds)
                sampled.add_metric(key, e.sampled)
            if r.freshness_seconds is not None:
                region_fresh.add_metric([r.region], r.freshness_seconds)
            if r.pending is not None:
                pending.add_metric([r.region], r.pending)
            for s in ("OK", "IDLE", "STALE", "NODATA", "DOWN", "REBUILDING"):
                state.add_metric([r.region, s], 1.0 if r.state == s else 0.0)
        yield from (fresh, delay, oldest, sampled, region_fresh, pending, state, quarantined)
        yield rebuilding
        yield behind

    def _links(self, report: Report) -> Iterator[Metric]:
        up = _gauge(
            "edgefeed_link_up", "1 when the WAN link carries traffic; 0 cut or down.", ["link"]
        )
        cut = _gauge(
            "edgefeed_link_cut_seconds", "How long the link has been cut (0 when not).", ["link"]
        )
        delay = _gauge(
            "edgefeed_link_delay_seconds", "The link's configured one-way delay.", ["link"]
        )
        seen = _gauge(
            "edgefeed_link_observed_delay_seconds",
            "Moving average of the one-way delay chunks took across the link.",
            ["link"],
        )
        rate = _gauge(
            "edgefeed_link_bytes_per_second",
            "Bytes per second over the last seconds; up: towards the far endpoint.",
            ["link", "direction"],
        )
        total = CounterMetricFamily(
            "edgefeed_link_bytes", "Bytes carried across the link.", labels=["link", "direction"]
        )
        conns = _gauge("edgefeed_link_connections", "Connections open across the link.", ["link"])
        for link in report.links:
            up.add_metric([link.name], 1.0 if link.reachable else 0.0)
            cut.add_metric([link.name], link.cut_for_s or 0.0)
            delay.add_metric([link.name], link.delay_ms / 1000.0)
            seen.add_metric([link.name], link.observed_delay_ms / 1000.0)
            rate.add_metric([link.name, "up"], link.bytes_per_s_up)
            rate.add_metric([link.name, "down"], link.bytes_per_s_down)
            total.add_metric([link.name, "up"], link.bytes_up)
            total.add_metric([link.name, "down"], link.bytes_down)
            conns.add_metric([link.name], link.connections)
        yield from (up, cut, delay, seen, rate, total, conns)

    def _cdc(self, report: Report) -> Iterator[Metric]:
        labels = ["slot", "database", "source"]
        retained = _gauge(
            "edgefeed_replication_slot_retained_wal_bytes",
            "WAL the slot keeps from being recycled: current LSN minus restart_lsn.",
            labels,
        )
        flush = _gauge(
            "edgefeed_replication_slot_flush_lag_bytes",
            "Current LSN minus the slot's confirmed_flush_lsn.",
            labels,
        )
        active = _gauge(
            "edgefeed_replication_slot_active", "1 when a client reads the slot.", labels
        )
        for s in report.slots:
            key = [s.slot, s.database or "", s.source or ""]
            if s.retained_wal_bytes is not None:
                retained.add_metric(key, s.retained_wal_bytes)
            if s.flush_lag_bytes is not None:
                flush.add_metric(key, s.flush_lag_bytes)
            active.add_metric(key, 1.0 if s.active else 0.0)
        yield from (retained, flush, active)
        state = _gauge(
            "edgefeed_connector_state",
            "1 for the connector's current state.",
            ["connector", "state"],
        )
        task_state = _gauge(
            "edgefeed_connector_task_state",
            "1 for each task's current state.",
            ["connector", "task", "state"],
        )
        failed = _gauge("edgefeed_connector_failed_tasks", "Tasks in state FAILED.", ["connector"])
        for c in report.connectors:
            for value in _CONNECT_STATES:
                state.add_metric([c.name, value], 1.0 if c.state == value else 0.0)
            for t in c.tasks:
                for value in _CONNECT_STATES[:-1]:
                    task_state.add_metric(
                        [c.name, str(t.id), value], 1.0 if t.state == value else 0.0
                    )
            failed.add_metric([c.name], sum(1 for t in c.tasks if t.state == "FAILED"))
        yield from (state, task_state, failed)
        snapshot = _gauge(
            "edgefeed_snapshot_state",
            "1 for the state of the connector's newest incremental snapshot.",
            ["connector", "state"],
        )
        rows = _gauge(
            "edgefeed_snapshot_rows",
            "Rows the newest incremental snapshot read, per table whose scan completed.",
            ["connector", "table"],
        )
        for snap in report.snapshots:
            for value in _SNAPSHOT_STATES:
                snapshot.add_metric([snap.connector, value], 1.0 if snap.state == value else 0.0)
            for table in snap.tables:
                if table.rows is not None:
                    rows.add_metric([snap.connector, table.table], table.rows)
        yield from (snapshot, rows)


def make_registry(collector: ReportCollector) -> CollectorRegistry:
    """A registry holding only ``collector`` (no process metrics: they vary per host)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


async def serve(
    monitor: Monitor,
    *,
    host: str = "127.0.0.1",
    port: int = 9308,
    interval_s: float = 15.0,
    security: EndpointSecurity | None = None,
    stop: asyncio.Event | None = None,
    on_ready: Callable[[int], None] | None = None,
) -> None:
    """Serve ``/metrics`` and the status page (``/status``, ``/status.json``: the same
    report, behind the same token) and refresh the report every ``interval_s`` until
    ``stop`` is set.

    Args:
        host: Address to listen on; loopback by default (the metrics name
            topics, groups, regions and connectors).
        port: TCP port (0: any free one).
        security: Bearer token and TLS; None serves plain HTTP to anyone who
            can reach ``host``.
        stop: Set it to stop serving.
        on_ready: Called with the bound port once the first report is in and
            the endpoint answers.

    Raises:
        MonitoringConfigError: bad interval or port, the port is taken, bad TLS files.
    """
    if interval_s <= 0:
        raise MonitoringConfigError(f"interval {interval_s}s must be positive")
    if not 0 <= port <= 65535:
        raise MonitoringConfigError(f"port {port} must be in 0..65535")
    security = security or EndpointSecurity()
    security.ssl_context()  # bad TLS files fail before the first (slow) collection
    if not is_loopback(host) and security.token is None:
        log.warning(
            "the exporter listens on %s without a bearer token: anyone who can reach it "
            "can read the metrics (give --token-file, or bind 127.0.0.1 behind a proxy)",
            host,
        )
    config = monitor.config
    collector = ReportCollector(
        config.freshness_budget_s, config.slot_wal_bound_bytes, config.scope
    )
    board = StatusBoard(
        budget_s=config.freshness_budget_s, refresh_s=interval_s, history=FreshnessHistory()
    )
    started = time.monotonic()
    first = await monitor.collect()
    collector.update(first, time.monotonic() - started)
    board.update(first)
    server, thread = start_endpoint(
        make_registry(collector), host=host, port=port, security=security, status=board
    )
    if on_ready is not None:
        on_ready(int(server.server_address[1]))
    stop = stop or asyncio.Event()
    try:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=interval_s)
                break
            except TimeoutError:
                pass
            started = time.monotonic()
            try:
                report = await monitor.collect()
            except Exception:  # keep serving the last report; the loop tries again
                log.exception("collection failed")
                continue
            collector.update(report, time.monotonic() - started)
            board.update(report)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
