"""Sites in `edgefeed lag` and the exporter: WAN link health and seconds behind.

The links come from a real WAN emulator link (edgefeed.wan) in front of an echo
server, read through its control socket as `edgefeed lag` reads the local
stack's; the Kafka side is unreachable here (a closed port), so each report
also shows that links are judged on their own.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from edgefeed.cli.monitoring import link_reader, render
from edgefeed.wan import ControlServer, Link, LinkParams, LinkSpec
from monitoring import (
    GroupReport,
    KafkaReport,
    Monitor,
    MonitorConfig,
    PartitionLag,
    RegionTarget,
    Report,
    ReportCollector,
    SourceUnavailableError,
    make_registry,
)
from monitoring.links import link_problems
from pipeline.names import PipelineNames

NAMES = PipelineNames()
LINK = "central-eu-west"


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()


@dataclass
class Emulator:
    link: Link
    socket_path: Path


@pytest.fixture
async def emulator() -> AsyncIterator[Emulator]:
    echo = await asyncio.start_server(_echo, "127.0.0.1", 0)
    target = echo.sockets[0].getsockname()[1]
    link = Link(LinkSpec(LINK, _closed_port(), "127.0.0.1", target, LinkParams(delay_ms=20)))
    await link.start()
    folder = Path(tempfile.mkdtemp(prefix="edgefeed-lag-links-"))
    control = ControlServer({LINK: link}, folder / "wan.sock")
    await control.start()
    try:
        yield Emulator(link, folder / "wan.sock")
    finally:
        await control.close()
        await link.close()
        echo.close()
        await echo.wait_closed()
        shutil.rmtree(folder, ignore_errors=True)


def _monitor(socket_path: Path) -> Monitor:
    return Monitor(
        MonitorConfig(
            bootstrap_servers=(f"127.0.0.1:{_closed_port()}",),
            site_regions=("eu-west",),
            links=link_reader(socket_path),
            region_links={"eu-west": LINK},
            timeout_s=2.0,
        )
    )


def _metrics(report: Report) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    collector = ReportCollector(freshness_budget_s=5.0, slot_wal_bound_bytes=1024)
    collector.update(report, 0.1)
    text = generate_latest(make_registry(collector)).decode()
    found: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return found


def _text(report: Report) -> str:
    console = Console(width=220, record=True)
    console.print(render(report))
    return console.export_text()


async def _traffic(link: Link, seconds: float) -> None:
    """Echo bytes across the link for a while (the rate needs whole seconds of them)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", link.spec.listen_port)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            writer.write(b"x" * 10_000)
            await writer.drain()
            await reader.readexactly(10_000)
    finally:
        writer.close()


async def test_lag_and_exporter_show_a_link_cut_and_healed(emulator: Emulator) -> None:
    monitor = _monitor(emulator.socket_path)
    await _traffic(emulator.link, 2.2)

    report = await monitor.collect()
    link = report.link(LINK)
    assert link is not None
    assert (link.state, link.reachable, link.severity) == ("UP", True, "OK")
    assert link.delay_ms == 20
    assert link.observed_delay_ms >= 15  # 20 ms, less the moving average's warm-up
    assert link.bytes_up >= 10_000 and link.bytes_down >= 10_000
    assert link.bytes_per_s_up > 0 and link.bytes_per_s_down > 0
    metrics = _metrics(report)
    assert metrics["edgefeed_link_up"][(("link", LINK),)] == 1.0
    assert metrics["edgefeed_link_observed_delay_seconds"][(("link", LINK),)] >= 0.015
    assert metrics["edgefeed_link_bytes_per_second"][(("direction", "up"), ("link", LINK))] > 0
    assert metrics["edgefeed_up"][(("component", "wan"),)] == 1.0
    assert not any(p.startswith(f"link {LINK}") for p in report.problems)

    emulator.link.cut()
    report = await monitor.collect()
    link = report.link(LINK)
    assert link is not None
    assert (link.state, link.reachable, link.severity) == ("CUT", False, "ERR")
    assert link.cut_for_s is not None
    assert report.severity == "ERR"
    assert any(p.startswith(f"link {LINK} CUT") for p in report.problems)
    metrics = _metrics(report)
    assert metrics["edgefeed_link_up"][(("link", LINK),)] == 0.0
    assert metrics["edgefeed_link_cut_seconds"][(("link", LINK),)] >= 0.0
    text = _text(report)
    assert "WAN links" in text and "CUT" in text and LINK in text

    emulator.link.heal()
    report = await monitor.collect()
    link = report.link(LINK)
    assert link is not None
    assert (link.state, link.reachable, link.cut_for_s) == ("UP", True, None)
    assert _metrics(report)["edgefeed_link_up"][(("link", LINK),)] == 1.0
    assert not any(p.startswith(f"link {LINK}") for p in report.problems)


async def test_a_silent_emulator_is_a_warning_naming_the_socket(tmp_path: Path) -> None:
    report = await _monitor(tmp_path / "absent.sock").collect()
    assert report.links == ()
    assert report.links_error is not None
    assert "absent.sock" in report.links_error and "edgefeed dev up" in report.links_error
    assert _metrics(report)["edgefeed_up"][(("component", "wan"),)] == 0.0
    assert report.links_error in report.problems


def _group(name: str, region: str | None, lag_seconds: float) -> GroupReport:
    topic = NAMES.region_topic("eu-west") if region else "shop.public.events"
    part = PartitionLag(topic, 0, 10, 50, 40, lag_seconds, "WARN", "behind")
    return GroupReport(name, region, "Stable", 1, "WARN", "WARN", (part,))


def test_a_region_across_a_link_is_as_far_behind_as_its_forwarder() -> None:
    monitor = Monitor(
        MonitorConfig(
            bootstrap_servers=("127.0.0.1:1",),
            regions=(RegionTarget("eu-west", "redis://127.0.0.1:1/0"),),
            site_regions=("eu-west",),
            region_links={"eu-west": LINK},
            freshness_budget_s=5.0,
        )
    )
    kafka = KafkaReport(
        groups=(
            _group(NAMES.router_group, None, 0.4),
            _group(NAMES.forward_group("eu-west"), "eu-west", 42.0),
            # Another region's group does not count for eu-west.
            _group(NAMES.region_group("us-east"), "us-east", 99.0),
        ),
        topics=(),
        brokers=1,
        deadletter_topic=NAMES.dead_letter_topic,
        deadletters=None,
        deadletters_new=None,
    )
    region = monitor._region_report(
        monitor.config.regions[0], SourceUnavailableError("redis:eu-west", "down"), kafka, 0.0
    )
    assert (region.behind_seconds, region.link) == (42.0, LINK)
    assert monitor.config.expected_groups == (
        NAMES.router_group,
        NAMES.forward_group("eu-west"),
    )
    problems = link_problems((), None, (region,), 5.0)
    assert problems == (f"region eu-west 42.0 s behind (budget 5 s), across link {LINK}",)
    report = Report(0.0, kafka, (region,), (), (), "WARN", problems)
    behind = _metrics(report)["edgefeed_region_behind_seconds"]
    assert behind == {(("link", LINK), ("region", "eu-west")): 42.0}
    assert "42.0s" in _text(report)
