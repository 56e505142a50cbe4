"""``edgefeed lag`` and ``edgefeed exporter``: lag, freshness and CDC health.

Exit codes of ``lag``: 0 everything OK, 3 a warning (a group falling behind,
an inactive slot, a region without data, new dead letters), 4 an error (a
stalled, stopped or rewound group, a stale region, a failed connector task, a
slot over its WAL bound, a system unreachable), 2 bad input. ``lag --watch``
stops at once on Ctrl-C or SIGTERM, with the code of its last report (130 if
it had none yet).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from edgefeed.cli._common import console, run_reported, settings_of

if TYPE_CHECKING:
    from edgefeed.settings import EdgefeedSettings
    from monitoring import LinkReader, Monitor, MonitorConfig, Report

__all__ = ["EXIT_CODES", "build_config", "link_reader", "register", "render"]

EXIT_CODES = {"OK": 0, "WARN": 3, "ERR": 4}
EXIT_INTERRUPTED = 130  # --watch stopped before its first report
T = TypeVar("T")
_COLOURS = {
    "OK": "green",
    "UP": "green",
    "CUT": "red",
    "IDLE": "green",
    "RUNNING": "green",
    "WARN": "yellow",
    "NODATA": "yellow",
    "REBUILDING": "yellow",
    "NOTFOUND": "yellow",
    "PAUSED": "yellow",
    "PACED": "green",
    "UNASSIGNED": "yellow",
    "ERR": "red",
    "STOP": "red",
    "STALL": "red",
    "REWIND": "red",
    "STALE": "red",
    "DOWN": "red",
    "FAILED": "red",
    "ABSENT": "red",
}

GroupOpt = Annotated[
    list[str] | None,
    typer.Option("--group", "-g", help="Only this consumer group (repeatable)."),
]
WindowOpt = Annotated[int, typer.Option(help="Observations per partition the status rules use.")]
BudgetOpt = Annotated[
    float, typer.Option("--freshness-budget", help="Seconds a region may lag its source.")
]
WalOpt = Annotated[
    int, typer.Option("--slot-wal-bound", help="Retained WAL bytes per slot before ERR.")
]
SampleOpt = Annotated[int, typer.Option("--sample-size", help="Vectors sampled per region.")]
MinIntervalOpt = Annotated[
    float, typer.Option("--min-interval", help="Seconds between observations kept.")
]
ScopeOpt = Annotated[
    str,
    typer.Option(
        "--scope",
        help="What to read: all; central (no region cache); region:NAME (that region's "
        "cache and group only, no PostgreSQL or Kafka Connect).",
    ),
]
StateDirOpt = Annotated[
    Path,
    typer.Option(
        "--state-dir",
        envvar="EDGEFEED_STATE_DIR",
        help="The local stack's folder (its WAN emulator reports the sites' links).",
    ),
]


def link_reader(control_path: Path) -> LinkReader:
    """Reads the links from the local stack's WAN emulator (``<state>/run/wan.sock``)."""
    from edgefeed.wan import WanControl, WanError
    from monitoring import SourceUnavailableError

    control = WanControl(control_path)

    async def read() -> list[dict[str, Any]]:
        try:
            return await asyncio.to_thread(control.status)
        except WanError as exc:
            raise SourceUnavailableError("wan", str(exc)) from None

    return read


def build_config(
    settings: EdgefeedSettings,
    *,
    state_dir: Path | None = None,
    groups: list[str] | None = None,
    window: int = 10,
    min_interval_s: float = 1.0,
    freshness_budget_s: float = 5.0,
    slot_wal_bound_bytes: int = 1024**3,
    sample_size: int = 20,
    scope: str = "all",
) -> MonitorConfig:
    """The monitor's view of the settings file.

    With links in ``sites:``, their health is read from the WAN emulator of the
    local stack in ``state_dir`` (default ``.edgefeed``, as ``edgefeed dev``).
    ``scope`` is ``all``, ``central`` or ``region:NAME`` (monitoring.scope); a
    region scope is given neither the database (nor its password) nor the
    Connect URL, the sources nor the links: it reads none of them.

    Raises:
        MonitoringConfigError: a bad scope, or a region scope naming no declared region.
        SecretSourceError: a secret this scope reads (the database's for ``all`` and
            ``central``, the reader's of each cache it reads, Kafka's) gives no password.
    """
    from connectors.config import notification_topic
    from monitoring import MonitorConfig, RegionTarget, Scope, SourceTarget

    parsed = Scope.parse(scope)
    central = parsed.central

    if not groups and settings.sites.regions:
        # With sites, a region with a broker of its own has its worker's group there;
        # on the central broker, its forwarder's group is how far behind it is.
        names = settings.pipeline.names
        groups = [names.router_group] + [
            names.forward_group(r) if r in settings.sites.regions else names.region_group(r)
            for r in settings.region_names
        ]
    sites = settings.sites
    links = None
    if central and sites.all_links():
        control = (state_dir or Path(".edgefeed")).resolve() / "run" / "wan.sock"
        links = link_reader(control)
    return MonitorConfig(
        site_regions=tuple(r for r in settings.region_names if r in sites.regions),
        links=links,
        region_links={
            r: f"central-{r}"
            for r, site in sites.regions.items()
            if site.link is not None and r in settings.region_names
        },
        bootstrap_servers=tuple(settings.kafka.bootstrap_servers),
        # The reader's password only for the caches this scope reads: a central
        # exporter mounts no Redis secret, a region's only its own.
        regions=tuple(
            RegionTarget(
                r.name, r.redis_url, r.redis_options("reader") if parsed.owns(r.name) else {}
            )
            for r in settings.regions
        ),
        sources=tuple(
            SourceTarget(s.name, s.connector_name, s.effective_slot_name, notification_topic(s))
            for s in settings.sources
            if central
        ),
        database_dsn=settings.database.dsn() if central else None,
        kafka_options=settings.kafka.security.aiokafka_options(),
        connect_url=settings.connect.url if central else None,
        groups=tuple(groups or ()),
        names=settings.pipeline.names,
        window=window,
        min_interval_s=min_interval_s,
        freshness_budget_s=freshness_budget_s,
        slot_wal_bound_bytes=slot_wal_bound_bytes,
        sample_size=sample_size,
        timeout_s=settings.connect.timeout_s,
        client_id=f"{settings.kafka.client_id}-monitor",
        secrets=tuple(settings.database.secrets()) if central else (),
        scope=parsed,
    )


def _styled(value: str) -> Text:
    return Text(value, style=_COLOURS.get(value, ""))


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}s" if value < 600 else f"{value / 60:.0f}m"


def _bytes(value: int | None) -> str:
    from monitoring.page import human_bytes

    return human_bytes(value, "-")


def render(report: Report) -> Group:
    """The report as rich tables (groups, regions, CDC source, problems)."""
    groups = Table(title="Consumer groups", title_justify="left", expand=False)
    for column in ("group", "status", "topic", "part", "committed", "end", "lag", "lag s"):
        groups.add_column(
            column,
            overflow="fold",
            justify=("right" if column in ("part", "committed", "end", "lag", "lag s") else "left"),
        )
    for g in report.kafka.groups:
        if not g.partitions:
            groups.add_row(g.group, _styled(g.status), "-", "", "", "", "", "")
        for i, p in enumerate(g.partitions):
            groups.add_row(
                g.group if i == 0 else "",
                _styled(p.status),
                p.topic,
                str(p.partition),
                "-" if p.committed is None else str(p.committed),
                str(p.end),
                "-" if p.lag is None else str(p.lag),
                _seconds(p.lag_seconds),
            )
    regions = Table(title="Region caches", title_justify="left")
    for column in (
        "region",
        "state",
        "freshness",
        "behind",
        "pending",
        "entity",
        "entity fresh",
        "write delay",
        "sample oldest",
    ):
        regions.add_column(column, overflow="fold")
    for r in report.regions:
        head: list[str | Text] = [
            r.region,
            _styled(r.state),
            _seconds(r.freshness_seconds),
            _seconds(r.behind_seconds),
            "-" if r.pending is None else str(r.pending),
        ]
        if not r.entities:
            regions.add_row(*head, r.error or "-", "", "", "")
        for i, e in enumerate(r.entities):
            regions.add_row(
                *(head if i == 0 else ["", "", "", "", ""]),
                e.entity,
                _seconds(e.freshness_seconds),
                _seconds(e.write_delay_seconds),
                f"{_seconds(e.sample_oldest_seconds)} ({e.sampled})",
            )
    for r in report.regions:
        for entity in r.rebuilding:
            regions.add_row(
                r.region,
                _styled("REBUILDING"),
                "",
                "",
                "",
                f"rebuilding {entity}",
                "history the stream lacked, re-read from the source: windows short until done",
            )
        for entity, reason in r.quarantine_sample:
            regions.add_row(r.region, _styled("WARN"), "", "", "", f"quarantined {entity}", reason)
        if r.quarantined > len(r.quarantine_sample):
            hidden = r.quarantined - len(r.quarantine_sample)
            regions.add_row(r.region, _styled("WARN"), "", "", "", f"... {hidden} more quarantined")
    cdc = Table(title="CDC source", title_justify="left")
    for column in ("kind", "name", "state", "detail"):
        cdc.add_column(column, overflow="fold")
    for s in report.slots:
        cdc.add_row(
            "slot",
            s.slot,
            _styled(s.severity),
            f"{'active' if s.active else 'INACTIVE'}, retains {_bytes(s.retained_wal_bytes)} WAL",
        )
    for c in report.connectors:
        cdc.add_row("connector", c.name, _styled(c.state), c.failure or "")
        for t in c.tasks:
            cdc.add_row("  task", f"{c.name}/{t.id}", _styled(t.state), t.cause or t.worker_id)
    for snap in report.snapshots:
        done = [t for t in snap.tables if t.rows is not None]
        detail = f"{snap.rows} rows read, {len(done)}/{len(snap.tables)} tables"
        if snap.current_table:
            detail += f"; reading {snap.current_table} at key {snap.last_key} of {snap.max_key}"
        cdc.add_row("snapshot", snap.connector, _styled(snap.state), detail)
        for scanned in snap.tables:
            rows = "" if scanned.rows is None else f"{scanned.rows} rows"
            cdc.add_row("  table", scanned.table, _styled(scanned.status), rows)
    if report.snapshot_error:
        cdc.add_row("snapshot", "-", _styled("ERR"), report.snapshot_error)
    parts: list[Table | Text] = [groups, regions]
    if report.links or report.links_error:
        parts.append(_links_table(report))
    parts.append(cdc)
    if report.kafka.deadletters is not None:
        parts.append(
            Text(
                f"dead letters on {report.kafka.deadletter_topic}: {report.kafka.deadletters}"
                f" ({report.kafka.deadletters_new or 0} new in the window)"
            )
        )
        by_topic: dict[str, list[str]] = {}
        for topic, reason, count in report.kafka.deadletters_by_reason:
            by_topic.setdefault(topic, []).append(f"{reason} {count}")
        for topic, reasons in sorted(by_topic.items()):
            parts.append(Text(f"  by reason on {topic}: {', '.join(reasons)}"))
    summary = Text.assemble("overall: ", _styled(report.severity))
    parts.append(summary)
    for problem in report.problems:
        parts.append(Text(f"  - {problem}", style=_COLOURS.get(report.severity, "")))
    return Group(*parts)


def _rate(value: float) -> str:
    return f"{_bytes(int(value))}/s"


def _links_table(report: Report) -> Table:
    """The WAN links: reachable, delay set and observed, throughput each way."""
    table = Table(title="WAN links", title_justify="left")
    columns = ("link", "state", "region", "behind", "delay", "observed", "up", "down", "conns")
    for column in columns:
        table.add_column(column, overflow="fold")
    if report.links_error:
        table.add_row("-", _styled("WARN"), "", "", "", "", "", "", report.links_error)
    for link in report.links:
        region = next((r for r in report.regions if r.link == link.name), None)
        state = _styled(link.state)
        if link.cut_for_s is not None:
            state.append(f" {link.cut_for_s:.0f}s")
        table.add_row(
            link.name,
            state,
            region.region if region else "-",
            _seconds(region.behind_seconds) if region else "-",
            f"{link.delay_ms:g} ms",
            f"{link.observed_delay_ms:.1f} ms",
            _rate(link.bytes_per_s_up),
            _rate(link.bytes_per_s_down),
            str(link.connections),
        )
    return table


async def _observe(monitor: Monitor, samples: int, interval_s: float) -> Report:
    report = await monitor.collect()
    for _ in range(samples - 1):
        await asyncio.sleep(interval_s)
        report = await monitor.collect()
    return report


def register(app: typer.Typer) -> None:
    """Add ``lag`` and ``exporter`` to the ``edgefeed`` command."""

    @app.command("lag")
    def lag_cmd(
        ctx: typer.Context,
        as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
        watch: Annotated[bool, typer.Option("--watch", "-w", help="Refresh in place.")] = False,
        interval: Annotated[float, typer.Option(help="Seconds between observations.")] = 2.0,
        samples: Annotated[
            int, typer.Option(help="Observations taken before a one-shot report (1 or more).")
        ] = 3,
        group: GroupOpt = None,
        window: WindowOpt = 10,
        min_interval: MinIntervalOpt = 1.0,
        freshness_budget: BudgetOpt = 5.0,
        slot_wal_bound: WalOpt = 1024**3,
        sample_size: SampleOpt = 20,
        state_dir: StateDirOpt = Path(".edgefeed"),
        scope: ScopeOpt = "all",
    ) -> None:
        """Consumer lag (messages, seconds, Burrow status), region freshness, slots, connectors.

        With sites: each region's seconds behind and the WAN links (reachable,
        delay set and observed, bytes per second each way). ``--scope`` as the
        exporter's.
        """
        from monitoring import Monitor

        settings = settings_of(ctx)
        if samples < 1 or interval <= 0:
            raise typer.BadParameter("--samples must be >= 1 and --interval > 0")
        config = run_reported(
            lambda: build_config(
                settings,
                state_dir=state_dir,
                groups=group,
                window=window,
                min_interval_s=min(min_interval, interval),
                freshness_budget_s=freshness_budget,
                slot_wal_bound_bytes=slot_wal_bound,
                sample_size=sample_size,
                scope=scope,
            )
        )
        monitor = Monitor(config)
        if not watch:
            report = asyncio.run(_observe(monitor, samples, interval))
            if as_json:
                typer.echo(json.dumps(report.as_dict(), indent=2))
            else:
                console.print(render(report))
            raise typer.Exit(EXIT_CODES[report.severity])
        raise typer.Exit(asyncio.run(_watch(monitor, interval, as_json)))

    @app.command("exporter")
    def exporter_cmd(
        ctx: typer.Context,
        host: Annotated[
            str,
            typer.Option(
                help="Address to listen on (loopback by default; 0.0.0.0 for every interface).",
                envvar="EDGEFEED_EXPORTER_HOST",
            ),
        ] = "127.0.0.1",
        port: Annotated[
            int, typer.Option(help="Port of /metrics.", envvar="EDGEFEED_EXPORTER_PORT")
        ] = 9308,
        token_file: Annotated[
            Path | None,
            typer.Option(
                help="File holding the bearer token scrapers must send.",
                envvar="EDGEFEED_EXPORTER_TOKEN_FILE",
            ),
        ] = None,
        token_env: Annotated[
            str | None,
            typer.Option(
                help="Name of an environment variable holding the bearer token.",
                envvar="EDGEFEED_EXPORTER_TOKEN_ENV",
            ),
        ] = None,
        tls_cert: Annotated[
            Path | None,
            typer.Option(
                help="PEM certificate chain: serve HTTPS only.", envvar="EDGEFEED_EXPORTER_TLS_CERT"
            ),
        ] = None,
        tls_key: Annotated[
            Path | None,
            typer.Option(help="PEM private key of --tls-cert.", envvar="EDGEFEED_EXPORTER_TLS_KEY"),
        ] = None,
        interval: Annotated[float, typer.Option(help="Seconds between collections.")] = 15.0,
        group: GroupOpt = None,
        window: WindowOpt = 10,
        freshness_budget: BudgetOpt = 5.0,
        slot_wal_bound: WalOpt = 1024**3,
        sample_size: SampleOpt = 20,
        state_dir: StateDirOpt = Path(".edgefeed"),
        scope: ScopeOpt = "all",
    ) -> None:
        """Serve Prometheus metrics (kafka_exporter names plus edgefeed_*) on /metrics.

        ``--scope`` splits the reads between exporters, for Kubernetes, where a
        region's cache may be read only from inside the region: ``central`` reads
        everything but the region caches, ``region:NAME`` that region's cache and
        consumer group (docs/operations.md). Their series add up to ``all``'s.
        """
        from monitoring import EndpointSecurity, Monitor, serve

        settings = settings_of(ctx)
        security = run_reported(
            lambda: EndpointSecurity.load(
                token_file=token_file, token_env=token_env, certfile=tls_cert, keyfile=tls_key
            )
        )
        config = run_reported(
            lambda: build_config(
                settings,
                state_dir=state_dir,
                groups=group,
                window=window,
                min_interval_s=min(1.0, interval),
                freshness_budget_s=freshness_budget,
                slot_wal_bound_bytes=slot_wal_bound,
                sample_size=sample_size,
                scope=scope,
            )
        )

        def ready(bound: int) -> None:
            scheme = "https" if security.tls else "http"
            auth = " (bearer token required)" if security.token is not None else ""
            console.print(
                f"serving metrics on {scheme}://{host}:{bound}/metrics{auth}, "
                f"the status page on {scheme}://{host}:{bound}/status",
                highlight=False,
                soft_wrap=True,
            )

        async def main() -> None:
            import signal

            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)

            await serve(
                Monitor(config),
                host=host,
                port=port,
                interval_s=interval,
                security=security,
                stop=stop,
                on_ready=ready,
            )

        run_reported(lambda: asyncio.run(main()))


async def _watch(monitor: Monitor, interval_s: float, as_json: bool) -> int:
    """Report every ``interval_s`` until SIGINT/SIGTERM; the exit code of the last report.

    A signal cancels whatever is pending (a collection round stuck on a slow
    system, or the pause between rounds) at once; 130 if no round completed.
    """
    import signal

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        severity = await _watch_until(monitor, interval_s, as_json, stop)
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
    return EXIT_INTERRUPTED if severity is None else EXIT_CODES[severity]


async def _watch_until(
    monitor: Monitor, interval_s: float, as_json: bool, stop: asyncio.Event
) -> str | None:
    severity: str | None = None
    with contextlib.ExitStack() as stack:
        live = None if as_json else stack.enter_context(_live())
        while not stop.is_set():
            started = time.monotonic()
            report = await _unless_stopped(monitor.collect(), stop)
            if report is None:
                break
            severity = report.severity
            if live is None:
                typer.echo(json.dumps(report.as_dict()))
            else:
                live.update(render(report), refresh=True)
            pause = max(interval_s - (time.monotonic() - started), 0.0)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), pause)
    return severity


def _live() -> Live:
    return Live(console=console, auto_refresh=False, screen=False)


async def _unless_stopped(work: Coroutine[Any, Any, T], stop: asyncio.Event) -> T | None:
    """The result of ``work``, or None once ``stop`` is set first (``work`` is cancelled)."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if task.done():
        return task.result()
    task.cancel()
    # Give the reads a moment to close their connections; never wait on them.
    await asyncio.wait({task}, timeout=1.0)
    return None
