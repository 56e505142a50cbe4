"""Burrow-style status rules, the header decoding and the exporter's rendering."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from monitoring import (
    METRIC_NAMES,
    ConnectorReport,
    EntityFreshness,
    GroupReport,
    KafkaReport,
    MonitorConfig,
    MonitoringConfigError,
    Observation,
    OffsetHistory,
    PartitionLag,
    RegionReport,
    Report,
    ReportCollector,
    SlotReport,
    TaskReport,
    TopicOffsets,
    evaluate_partition,
    make_registry,
)


def window(*points: tuple[int, int], step: float = 1.0) -> list[Observation]:
    return [Observation(i * step, offset, lag) for i, (offset, lag) in enumerate(points)]


@pytest.mark.parametrize(
    ("points", "lag", "members", "expected"),
    [
        (((5, 0), (5, 3), (5, 6)), 6, True, "OK"),  # lag was 0 in the window
        (((5, 3), (5, 4), (5, 6)), 6, True, "STALL"),
        (((5, 3), (6, 4), (7, 6)), 6, True, "WARN"),
        (((5, 3), (7, 4), (9, 2)), 2, True, "OK"),
        (((9, 3), (5, 4), (6, 6)), 6, True, "REWIND"),
        (((5, 3), (5, 4)), 4, False, "STOP"),
        (((5, 3), (5, 3)), 0, False, "OK"),  # caught up and idle: never an error
        (((5, 3),), 3, True, "OK"),  # one observation: window incomplete
    ],
)
def test_burrow_rules(
    points: tuple[tuple[int, int], ...], lag: int, members: bool, expected: str
) -> None:
    status, reason = evaluate_partition(window(*points), current_lag=lag, has_members=members)
    assert status == expected, reason


def test_no_committed_offset_is_notfound_and_short_span_is_incomplete() -> None:
    assert evaluate_partition([], current_lag=None, has_members=True)[0] == "NOTFOUND"
    tight = window((5, 3), (5, 6), step=0.01)
    assert evaluate_partition(tight, current_lag=6, has_members=True, min_span_s=1)[0] == "OK"
    assert evaluate_partition(tight, current_lag=6, has_members=True)[0] == "STALL"


def test_history_keeps_the_window_and_merges_close_observations() -> None:
    history = OffsetHistory(window=3, min_interval_s=1.0)
    for i in range(5):
        history.add("g", "t", 0, Observation(float(i), i, 1))
    assert [o.offset for o in history.window_of("g", "t", 0, 4.0)] == [2, 3, 4]
    # Within 1 s of the observation before the last: it replaces the last one.
    history.add("g", "t", 0, Observation(3.5, 9, 1))
    assert [o.offset for o in history.window_of("g", "t", 0, 4.5)] == [2, 3, 9]
    history.forget_except([])
    assert history.window_of("g", "t", 0, 5.0) == []


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"window": 1}, "window 1"),
        ({"freshness_budget_s": 0}, "freshness budget"),
        ({"slot_wal_bound_bytes": -1}, "slot WAL bound"),
        ({"sample_size": -2}, "sample size"),
    ],
)
def test_bad_options_name_the_value(options: dict[str, object], needle: str) -> None:
    with pytest.raises(MonitoringConfigError) as info:
        MonitorConfig(bootstrap_servers=("127.0.0.1:9092",), **options)  # type: ignore[arg-type]
    assert needle in str(info.value)
    assert isinstance(info.value, ValueError)


def sample_report() -> Report:
    partition = PartitionLag("edgefeed.region.eu-west", 0, 5, 11, 6, 12.5, "STALL", "stuck")
    group = GroupReport(
        "edgefeed-region-eu-west", "eu-west", "Stable", 1, "STALL", "ERR", (partition,), {}
    )
    kafka = KafkaReport(
        groups=(group,),
        topics=(TopicOffsets("edgefeed.region.eu-west", {0: 0}, {0: 11}, 2.0),),
        brokers=1,
        deadletter_topic="edgefeed.deadletter",
        deadletters=4,
        deadletters_new=1,
        deadletters_by_reason=(
            ("edgefeed.deadletter", "bad-json", 3),
            ("edgefeed.deadletter", "unknown-entity", 1),
        ),
    )
    entity = EntityFreshness("users", 1.5, 0.2, "123", 3, 9.0, 1.5)
    region = RegionReport(
        "eu-west",
        "OK",
        "WARN",
        1.5,
        6,
        (entity,),
        quarantined=2,
        quarantine_sample=(("user:8", "OverflowError: too big"),),
    )
    slot = SlotReport(
        "edgefeed_shop",
        "pgoutput",
        "logical",
        "edgefeed",
        False,
        4096,
        2048,
        "reserved",
        "shop",
        "WARN",
        "inactive",
    )
    task = TaskReport(0, "FAILED", "w:8083", "boom")
    connector = ConnectorReport("edgefeed-shop", "RUNNING", (task,), "boom", "ERR")
    return Report(1.0, kafka, (region,), (slot,), (connector,), "ERR", ("x",))


def test_exporter_output_parses_and_uses_kafka_exporter_names() -> None:
    collector = ReportCollector(freshness_budget_s=5.0, slot_wal_bound_bytes=1024)
    collector.update(sample_report(), 0.1)
    text = generate_latest(make_registry(collector)).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    names = {s.name for f in families.values() for s in f.samples}
    for required in (
        "kafka_consumergroup_lag",
        "kafka_consumergroup_lag_sum",
        "kafka_consumergroup_current_offset",
        "kafka_topic_partition_current_offset",
        "edgefeed_consumergroup_lag_seconds",
        "edgefeed_cache_freshness_seconds",
        "edgefeed_replication_slot_retained_wal_bytes",
        "edgefeed_deadletter_messages_total",
        "edgefeed_connector_task_state",
    ):
        assert required in names
    assert names <= set(METRIC_NAMES)
    lag = next(s for s in families["kafka_consumergroup_lag"].samples)
    assert lag.labels == {
        "consumergroup": "edgefeed-region-eu-west",
        "topic": "edgefeed.region.eu-west",
        "partition": "0",
    }
    assert lag.value == 6
    failed = [
        s
        for s in families["edgefeed_connector_task_state"].samples
        if s.labels["state"] == "FAILED"
    ]
    assert [s.value for s in failed] == [1.0]
    (quarantined,) = families["edgefeed_region_quarantined_entities"].samples
    assert (quarantined.labels, quarantined.value) == ({"region": "eu-west"}, 2)
    reasons = {
        (s.labels["topic"], s.labels["reason"]): s.value
        for s in families["edgefeed_deadletter_reason_messages"].samples
        if s.name.endswith("_total")
    }
    assert reasons == {
        ("edgefeed.deadletter", "bad-json"): 3,
        ("edgefeed.deadletter", "unknown-entity"): 1,
    }


def test_series_rate_and_increase_over_the_window() -> None:
    from monitoring.status import Series

    series = Series(window=3, min_interval_s=1.0)
    assert series.rate() is None and series.increase() == 0
    series.add(0.0, 10)
    series.add(2.0, 30)
    assert series.rate() == 10.0 and series.increase() == 20
    series.add(4.0, 30)
    series.add(6.0, 30)  # the window keeps 3 points: 2.0, 4.0, 6.0
    assert series.increase() == 0 and series.rate() == 0.0


def test_lag_lists_quarantined_entities_with_the_reason() -> None:
    from rich.console import Console

    from edgefeed.cli.monitoring import render

    console = Console(width=200, record=True)
    console.print(render(sample_report()))
    text = console.export_text()
    assert "quarantined user:8" in text and "OverflowError: too big" in text
    assert "1 more quarantined" in text  # 2 quarantined, one of them listed
    assert "by reason on edgefeed.deadletter: bad-json 3, unknown-entity 1" in text


def test_a_rebuilding_region_is_shown_and_exported_never_ok() -> None:
    from dataclasses import replace

    from rich.console import Console

    from edgefeed.cli.monitoring import render

    report = sample_report()
    (region,) = report.regions
    rebuilding = replace(region, state="REBUILDING", rebuilding=("item", "user"))
    report = replace(report, regions=(rebuilding,))
    console = Console(width=200, record=True)
    console.print(render(report))
    text = console.export_text()
    assert "rebuilding item" in text and "rebuilding user" in text
    collector = ReportCollector(freshness_budget_s=5.0, slot_wal_bound_bytes=1024)
    collector.update(report, 0.1)
    exported = generate_latest(make_registry(collector)).decode()
    families = {f.name: f for f in text_string_to_metric_families(exported)}
    marks = {s.labels["entity"]: s.value for s in families["edgefeed_region_rebuilding"].samples}
    assert marks == {"item": 1.0, "user": 1.0}
    states = {
        s.labels["state"]: s.value
        for s in families["edgefeed_region_status"].samples
        if s.value == 1.0
    }
    assert states == {"REBUILDING": 1.0}
