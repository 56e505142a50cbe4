"""`--scope`: a central exporter and one exporter per region, each reading only its part.

The monitor's reads (Kafka, each region's Redis, PostgreSQL, Kafka Connect, the
snapshot notifications, the WAN links) are replaced by recording fakes that
answer as a three-region deployment would: eu-west and us-east with their
worker's group on the central broker, ap-southeast behind a site of its own
(its forwarder's group, and a link), us-east's Redis down.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

import monitoring.monitor as monitor_module
from connectors.client import ConnectorStatus, TaskStatus
from edgefeed.cli import app
from edgefeed.cli.monitoring import build_config
from edgefeed.settings import load_settings
from edgefeed_base.errors import EdgefeedError
from monitoring import (
    Monitor,
    MonitorConfig,
    MonitoringConfigError,
    RegionTarget,
    Report,
    ReportCollector,
    Scope,
    SourceTarget,
    SourceUnavailableError,
    make_registry,
)
from monitoring.cdc import SlotRow
from monitoring.freshness import EntityTimes, RegionTimes
from monitoring.kafka import GroupOffsets, KafkaSnapshot
from monitoring.model import SnapshotReport, SnapshotTable
from pipeline.names import PipelineNames

NAMES = PipelineNames()
REGIONS = ("eu-west", "us-east", "ap-southeast")
SITE = "ap-southeast"  # a broker of its own: its forwarder's group is on the central one
LINK = f"central-{SITE}"
CDC_TOPIC = "shop.public.users"
STALE_GROUP = NAMES.region_group("retired")  # a region no longer declared: central's

#: Series that describe the exporter itself, so every exporter has its own: its
#: severity and collection, whether it could read Kafka (each reads it), and the
#: budget it judged regions by. Everything else has exactly one owner.
PER_EXPORTER = {
    ("edgefeed_monitor_severity", ()),
    ("edgefeed_monitor_last_collect_timestamp_seconds", ()),
    ("edgefeed_monitor_collect_duration_seconds", ()),
    ("edgefeed_freshness_budget_seconds", ()),
    ("edgefeed_up", (("component", "kafka"),)),
}

Key = tuple[str, tuple[tuple[str, str], ...]]


@dataclass
class Calls:
    """What the fakes were asked."""

    kafka_groups: list[set[str]] = field(default_factory=list)
    records_of: list[set[str]] = field(default_factory=list)  # groups whose records were read
    redis: list[str] = field(default_factory=list)
    postgres: int = 0
    connect: int = 0
    snapshots: int = 0
    links: int = 0


def _snapshot(
    select_group: Callable[[str], bool], read_records_of: Callable[[str], bool]
) -> KafkaSnapshot:
    now_ms = int(time.time() * 1000)
    end: dict[tuple[str, int], int] = {
        (CDC_TOPIC, 0): 100,
        (NAMES.history_topic, 0): 3,
        (NAMES.homes_changelog_topic, 0): 40,
        (NAMES.dead_letter_topic, 0): 3,
        **{(NAMES.region_topic(r), 0): 50 for r in REGIONS},
        **{(NAMES.region_dead_letter_topic(r), 0): i for i, r in enumerate(REGIONS)},
    }
    committed = {
        NAMES.router_group: {(CDC_TOPIC, 0): 90},
        NAMES.region_group("eu-west"): {(NAMES.region_topic("eu-west"), 0): 40},
        NAMES.region_group("us-east"): {(NAMES.region_topic("us-east"), 0): 50},
        NAMES.forward_group(SITE): {(NAMES.region_topic(SITE), 0): 45},
        STALE_GROUP: {},
    }
    groups = tuple(
        GroupOffsets(name, "Stable", 1, dict(offsets))
        for name, offsets in committed.items()
        if select_group(name)
    )
    # The router's oldest waiting change is 9 s old, the regions' 2 s.
    next_ts = {
        (g.group, topic, partition): now_ms - (9_000 if g.group == NAMES.router_group else 2_000)
        for g in groups
        if read_records_of(g.group)
        for (topic, partition), offset in g.committed.items()
        if offset < end[(topic, partition)]
    }
    return KafkaSnapshot(time.time(), {key: 0 for key in end}, end, groups, next_ts, 1)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Calls:
    """Install the fakes in place of the monitor's reads."""
    seen = Calls()

    async def read_kafka(
        bootstrap_servers: Sequence[str],
        *,
        select_group: Callable[[str], bool],
        read_records_of: Callable[[str], bool] | None = None,
        **_: Any,
    ) -> KafkaSnapshot:
        records_of = read_records_of or select_group
        snapshot = _snapshot(select_group, records_of)
        seen.kafka_groups.append({g.group for g in snapshot.groups})
        seen.records_of.append({g.group for g in snapshot.groups if records_of(g.group)})
        return snapshot

    async def read_region(region: str, redis_url: str, **_: Any) -> RegionTimes:
        seen.redis.append(region)
        if region == "us-east":
            raise SourceUnavailableError(f"redis:{region}", "down")
        now_us = int(time.time() * 1e6)
        entity = EntityTimes("user", now_us - 1_000_000, now_us - 900_000, "42", (now_us,))
        if region == "eu-west":
            return RegionTimes(region, (entity,), 1, (("user:8", "too big"),))
        return RegionTimes(region, (entity,), rebuilding=("item",))

    async def read_slots(dsn: str, **_: Any) -> list[SlotRow]:
        seen.postgres += 1
        return [SlotRow("edgefeed_shop", "pgoutput", "logical", "shop", True, 10, 5, "reserved")]

    async def read_connectors(url: str, declared: Sequence[str], **_: Any) -> dict[str, Any]:
        seen.connect += 1
        task = TaskStatus(0, "RUNNING", "w:8083", None)
        return {
            name: ConnectorStatus(name, "RUNNING", "w:8083", None, (task,)) for name in declared
        }

    async def read_snapshots(
        bootstrap_servers: Sequence[str], connectors: Mapping[str, str], **_: Any
    ) -> tuple[SnapshotReport, ...]:
        seen.snapshots += 1
        table = SnapshotTable("public.users", 7, "SUCCEEDED")
        return tuple(
            SnapshotReport(name, "s1", "COMPLETED", (table,), None, None, None, 1)
            for name in connectors
        )

    monkeypatch.setattr(monitor_module, "read_kafka", read_kafka)
    monkeypatch.setattr(monitor_module, "read_region", read_region)
    monkeypatch.setattr(monitor_module, "read_slots", read_slots)
    monkeypatch.setattr(monitor_module, "read_connectors", read_connectors)
    monkeypatch.setattr(monitor_module, "read_snapshots", read_snapshots)
    return seen


def _config(calls: Calls, scope: Scope) -> MonitorConfig:
    async def links() -> list[dict[str, Any]]:
        calls.links += 1
        return [{"name": LINK, "state": "healed", "delay_ms": 60, "connections_open": 2}]

    # Every source is configured, whatever the scope: the monitor itself must not read
    # what its scope does not own (the CLI does not even pass them; tested below).
    return MonitorConfig(
        bootstrap_servers=("kafka:9092",),
        regions=tuple(RegionTarget(r, f"redis://redis-{r}:6379/0") for r in REGIONS),
        sources=(SourceTarget("shop", "edgefeed-shop", "edgefeed_shop", "edgefeed.notes"),),
        database_dsn="host=postgres password=pg-secret",
        connect_url="http://connect:8083",
        site_regions=(SITE,),
        links=links,
        region_links={SITE: LINK},
        scope=scope,
    )


async def _collect(calls: Calls, scope: Scope) -> Report:
    monitor = Monitor(_config(calls, scope))
    await monitor.collect()  # a second round: rates and the dead-letter window have history
    return await monitor.collect()


def _values(report: Report, scope: Scope) -> dict[Key, float]:
    collector = ReportCollector(freshness_budget_s=5.0, slot_wal_bound_bytes=1024, scope=scope)
    collector.update(report, 0.1)
    text = generate_latest(make_registry(collector)).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _series(report: Report, scope: Scope) -> set[Key]:
    return set(_values(report, scope))


@pytest.mark.parametrize("region", REGIONS)
async def test_a_region_scope_reads_its_own_cache_and_group_only(calls: Calls, region: str) -> None:
    report = await _collect(calls, Scope("region", region))

    assert calls.redis == [region, region]  # two rounds, never another region's Redis
    assert (calls.postgres, calls.connect, calls.snapshots, calls.links) == (0, 0, 0, 0)
    carrier = NAMES.forward_group(region) if region == SITE else NAMES.region_group(region)
    # Read: its group, and the router's and its carrier's for its pending and behind.
    allowed = {NAMES.router_group, NAMES.region_group(region), carrier}
    assert all(read <= allowed for read in calls.kafka_groups), calls.kafka_groups
    # Records (for lag in seconds) of its own topic only: the router's source topics
    # hold every region's rows.
    assert all(read <= allowed - {NAMES.router_group} for read in calls.records_of)
    # Shown: its own worker's group only (a site region's is on its own broker).
    shown = {g.group for g in report.kafka.groups}
    assert shown == (set() if region == SITE else {NAMES.region_group(region)})
    assert [r.region for r in report.regions] == [region]
    assert report.kafka.topics == () and report.slots == () and report.connectors == ()
    assert report.links == () and report.snapshots == ()
    assert report.cdc_error is None and report.connect_error is None
    assert [name for name, _ in report.kafka.deadletters_by_topic] == [
        NAMES.region_dead_letter_topic(region)
    ]
    assert not any(p.startswith(("slot ", "connector ", "link ")) for p in report.problems)


async def test_a_region_scope_counts_pending_as_all_does_and_behind_from_the_router(
    calls: Calls,
) -> None:
    everything = await _collect(calls, Scope())
    for region in REGIONS:
        alone = await _collect(calls, Scope("region", region))
        mine, whole = alone.region(region), everything.region(region)
        assert mine is not None and whole is not None
        # Offsets only: the router's lag is in it, exactly as with one exporter.
        assert mine.pending == whole.pending and mine.pending is not None
        assert mine.state == whole.state
        # Behind counts from the router's output (its record is not read here); the
        # router's own 9 s are the central exporter's.
        assert whole.behind_seconds == pytest.approx(9.0, abs=1.0)
        lagging = region != "us-east"  # us-east's worker is caught up
        assert mine.behind_seconds == (pytest.approx(2.0, abs=1.0) if lagging else 0.0)
    central = await _collect(calls, Scope("central"))
    router = central.group(NAMES.router_group)
    assert router is not None and router.lag_seconds == pytest.approx(9.0, abs=1.0)


async def test_the_central_scope_reads_no_cache(calls: Calls) -> None:
    report = await _collect(calls, Scope("central"))

    assert calls.redis == []
    assert (calls.postgres, calls.connect, calls.snapshots, calls.links) == (2, 2, 2, 2)
    region_groups = {NAMES.region_group(r) for r in REGIONS}
    assert all(not (read & region_groups) for read in calls.kafka_groups), calls.kafka_groups
    assert {g.group for g in report.kafka.groups} == {
        NAMES.router_group,
        NAMES.forward_group(SITE),
        STALE_GROUP,
    }
    assert report.regions == ()
    assert [name for name, _ in report.kafka.deadletters_by_topic] == [NAMES.dead_letter_topic]
    assert report.slots and report.connectors and report.links and report.snapshots
    assert NAMES.history_topic in {t.topic for t in report.kafka.topics}


async def test_scoped_exporters_add_up_to_the_all_exporter_without_a_series_twice(
    calls: Calls,
) -> None:
    everything = _series(await _collect(calls, Scope()), Scope())
    scopes = [Scope("central"), *(Scope("region", r) for r in REGIONS)]
    emitted = {str(scope): _series(await _collect(calls, scope), scope) for scope in scopes}

    counts = Counter(key for keys in emitted.values() for key in keys)
    assert set(counts) == everything, (
        f"missing from the split: {sorted(everything - set(counts))}; "
        f"not in all: {sorted(set(counts) - everything)}"
    )
    twice = sorted(key for key, n in counts.items() if n > 1 and key not in PER_EXPORTER)
    assert twice == [], twice
    # What every exporter says of itself (the central one judges no region: no budget).
    for name, keys in emitted.items():
        expected = PER_EXPORTER - (
            {("edgefeed_freshness_budget_seconds", ())} if name == "central" else set()
        )
        assert keys & PER_EXPORTER == expected, name
    # The split covers something of every kind (not vacuously equal).
    names = {name for name, _ in everything}
    for wanted in (
        "edgefeed_cache_freshness_seconds",
        "edgefeed_region_status",
        "edgefeed_region_behind_seconds",
        "edgefeed_region_quarantined_entities",
        "edgefeed_region_rebuilding",
        "kafka_consumergroup_lag",
        "edgefeed_consumergroup_lag_seconds",
        "edgefeed_deadletter_messages_total",
        "edgefeed_replication_slot_active",
        "edgefeed_connector_state",
        "edgefeed_snapshot_state",
        "edgefeed_link_up",
        "kafka_topic_partition_current_offset",
        "kafka_brokers",
    ):
        assert wanted in names, wanted


def _up(keys: set[Key]) -> set[str]:
    return {dict(labels)["component"] for name, labels in keys if name == "edgefeed_up"}


async def test_a_scoped_exporter_reports_only_the_components_it_reads(calls: Calls) -> None:
    central = _series(await _collect(calls, Scope("central")), Scope("central"))
    assert _up(central) == {"kafka", "postgres", "connect", "wan"}
    # Region series need a cache read or are the region's own: none from central.
    assert not {n for n, _ in central if n.startswith(("edgefeed_region_", "edgefeed_cache_"))}
    eu = _series(await _collect(calls, Scope("region", "eu-west")), Scope("region", "eu-west"))
    assert _up(eu) == {"kafka", "redis:eu-west"}
    assert {n for n, _ in eu if n.startswith(("edgefeed_replication_", "edgefeed_connector_"))} == (
        set()
    )
    assert "kafka_brokers" not in {n for n, _ in eu}
    # A cache that is down is reported down by the one exporter that reads it.
    us = _values(await _collect(calls, Scope("region", "us-east")), Scope("region", "us-east"))
    assert us[("edgefeed_up", (("component", "redis:us-east"),))] == 0.0
    assert us[("edgefeed_region_status", (("region", "us-east"), ("state", "DOWN")))] == 1.0


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("regional:eu-west", "scope 'regional:eu-west' is not all, central or region:NAME"),
        ("region:", "scope 'region:' is not all, central or region:NAME"),
        ("", "is not all, central or region:NAME"),
    ],
)
def test_a_malformed_scope_is_a_typed_error(text: str, needle: str) -> None:
    with pytest.raises(MonitoringConfigError) as info:
        Scope.parse(text)
    assert needle in str(info.value)
    assert isinstance(info.value, ValueError)


def test_a_scope_naming_no_declared_region_lists_the_regions(calls: Calls) -> None:
    with pytest.raises(MonitoringConfigError) as info:
        _config(calls, Scope.parse("region:eu-wset"))
    assert str(info.value) == (
        "scope 'region:eu-wset': region 'eu-wset' not in regions: eu-west, us-east, ap-southeast"
    )


def _settings_file(tmp_path: Path) -> Path:
    path = tmp_path / "edgefeed.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "kafka": {"bootstrap_servers": "kafka:9092"},
                "connect": {"url": "http://connect:8083"},
                # Not mounted in a region's namespace: a region scope must not need it.
                "database": {"host": "postgres", "password_file": str(tmp_path / "pg_password")},
                "regions": [
                    {"name": r, "redis_url": f"redis://redis-{r}:6379/0", "residency_zone": r}
                    for r in REGIONS
                ],
                "sources": [{"name": "shop", "tables": [{"name": "users", "key": ["id"]}]}],
                "sites": {
                    "regions": {
                        SITE: {"bootstrap_servers": "kafka-ap:9092", "link": {"listen_port": 9193}}
                    }
                },
            }
        )
    )
    return path


def test_the_cli_gives_a_region_scope_no_database_nor_connect(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from connectors.settings import DatabaseSettings

    settings = load_settings(_settings_file(tmp_path))
    with pytest.raises(EdgefeedError, match=r"database\.password_file .*does not exist"):
        build_config(settings, state_dir=tmp_path, scope="central")  # central reads it
    (tmp_path / "pg_password").write_text("pg-scope-test-pw\n")
    central = build_config(settings, state_dir=tmp_path, scope="central")
    assert central.database_dsn and central.connect_url == "http://connect:8083"
    assert central.links is not None and central.sources
    (tmp_path / "pg_password").unlink()

    def no_dsn(self: DatabaseSettings) -> str:
        raise AssertionError("a region scope built the database DSN")

    monkeypatch.setattr(DatabaseSettings, "dsn", no_dsn)
    config = build_config(settings, state_dir=tmp_path, scope="region:us-east")
    assert (config.database_dsn, config.connect_url, config.links) == (None, None, None)
    assert config.sources == () and config.secrets == ()
    assert [r.name for r in config.read_regions] == ["us-east"]
    assert str(config.scope) == "region:us-east"


@pytest.mark.parametrize("command", ["exporter", "lag"])
def test_a_bad_scope_on_the_command_line_is_a_usage_error(tmp_path: Path, command: str) -> None:
    settings = _settings_file(tmp_path)
    port = ["--port", "0"] if command == "exporter" else []  # never a fixed port, even failing
    args = ["--settings", str(settings), command, "--scope", "region:eu", *port]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split())
    assert "region 'eu' not in regions: eu-west, us-east, ap-southeast" in message
