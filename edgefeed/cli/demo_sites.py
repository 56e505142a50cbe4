"""``edgefeed demo sites``: the multi-site demo (``make demo-sites``).

A broker per region behind emulated WAN links (examples/edgefeed-sites.yaml),
the router, a forwarder and a feature worker per region, and a steady load.
A live line shows each region's freshness (now minus the source commit time of
the newest vector in its Redis) and the state of its link, while the demo cuts
central <-> eu-west, holds the cut, heals it and waits for eu-west to catch up;
it ends by checking every region against a recomputation from PostgreSQL.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from edgefeed.cli._common import EXIT_ERROR, console, fail, run_reported, settings_of
from edgefeed.cli._demostack import free_port, start_exporter
from edgefeed.cli.dev import print_status

if TYPE_CHECKING:
    from edgefeed.settings import EdgefeedSettings
    from edgefeed.verify import VerifyReport
    from edgefeed.wan import WanControl

__all__ = ["caught_up", "freshness_line", "print_verified", "sites_demo"]

StateDir = Annotated[
    Path, typer.Option("--state-dir", envvar="EDGEFEED_STATE_DIR", help="Local stack state.")
]


async def _freshness(settings: EdgefeedSettings) -> dict[str, float | None]:
    """Each region's freshness in seconds (None: no vector yet, or Redis unreachable)."""
    from monitoring.exceptions import SourceUnavailableError
    from monitoring.freshness import read_region

    async def one(name: str) -> float | None:
        region = settings.region(name)
        try:
            times = await read_region(
                name,
                region.redis_url,
                sample_size=0,
                timeout_s=2.0,
                redis_options=region.redis_options("reader"),
            )
        except SourceUnavailableError:
            return None
        commits = [e.commit_us for e in times.entities if e.commit_us is not None]
        return time.time() - max(commits) / 1e6 if commits else None

    values = await asyncio.gather(*(one(name) for name in settings.region_names))
    return dict(zip(settings.region_names, values, strict=True))


def freshness_line(
    elapsed_s: float, freshness: dict[str, float | None], links: dict[str, str]
) -> str:
    """One line: each region's freshness and, where it has one, its link's state."""
    parts = []
    for region, seconds in freshness.items():
        value = "   -  " if seconds is None else f"{seconds:5.1f}s"
        state = links.get(f"central-{region}")
        parts.append(f"{region} {value}" + (f" [{state}]" if state and state != "up" else ""))
    return f"  t+{elapsed_s:5.1f}s  freshness: " + "  ".join(parts)


def caught_up(freshness: dict[str, float | None], region: str, budget_s: float) -> bool:
    """``region`` is within ``budget_s`` of the freshest other region (or of the
    budget itself): what the cut cost it is gone, however loaded the machine is."""
    value = freshness.get(region)
    if value is None:
        return False
    others = [v for name, v in freshness.items() if name != region and v is not None]
    return value <= max(budget_s, min(others, default=0.0) + budget_s)


def print_verified(report: VerifyReport) -> None:
    """The verification's line: equal, or NOT equal with a few of the differences."""
    console.print(
        f"  {'[green]equal[/]' if report.ok else '[red]NOT equal[/]'}: "
        f"{sum(report.checked.values())} vectors checked, {len(report.mismatches)} mismatches"
    )
    for m in report.mismatches[:5]:
        console.print(
            f"    {m.region} {m.entity}:{m.entity_id} {m.what} expected {m.expected!r} "
            f"found {m.found!r}",
            markup=False,
        )


def _link_states(wan: WanControl) -> dict[str, str]:
    from edgefeed.wan import WanError

    try:
        return {
            link["name"]: "up" if link["state"] == "healed" else link["state"]
            for link in wan.status()
        }
    except WanError:
        return {}


def _watch(
    settings: EdgefeedSettings,
    wan: WanControl,
    started: float,
    seconds: float,
    until: str | None = None,
    budget_s: float = 2.0,
) -> float | None:
    """Print the live line once a second for ``seconds``; with ``until`` (a region),
    stop early once it has caught up (:func:`caught_up`) and return the time taken."""
    tty = sys.stdout.isatty()
    began = time.monotonic()
    while time.monotonic() - began < seconds:
        freshness = asyncio.run(_freshness(settings))
        line = freshness_line(time.monotonic() - started, freshness, _link_states(wan))
        if tty:
            sys.stdout.write("\r" + line + "\x1b[K")
            sys.stdout.flush()
        else:
            console.print(line, highlight=False, markup=False)
        if until and caught_up(freshness, until, budget_s):
            if tty:
                sys.stdout.write("\n")
            return time.monotonic() - began
        time.sleep(1.0)
    if tty:
        sys.stdout.write("\n")
    return None


def sites_demo(
    ctx: typer.Context,
    state_dir: StateDir = Path(".edgefeed"),
    rate: Annotated[float, typer.Option(help="Changes per second of the load.")] = 200.0,
    cut_region: Annotated[str, typer.Option(help="Region whose link is cut.")] = "eu-west",
    before_s: Annotated[float, typer.Option(help="Seconds of load before the cut.")] = 15.0,
    cut_s: Annotated[float, typer.Option(help="Seconds the link stays cut.")] = 20.0,
    catch_up_limit_s: Annotated[
        float, typer.Option(help="Most seconds to wait for the region to catch up.")
    ] = 120.0,
) -> None:
    """Sites behind WAN links: a partition and its catch-up, with a live freshness line."""
    from connectors import deploy
    from connectors.client import ConnectClient
    from edgefeed.devstack import DevStack
    from edgefeed.settings import SettingsError
    from edgefeed.shopload import ShopLoad, apply_schema
    from edgefeed.verify import verify_until
    from edgefeed.wan import WanControl

    settings = settings_of(ctx)
    link = f"central-{cut_region}"
    if link not in settings.sites.all_links():
        fail(
            SettingsError(
                f"no link {link!r} in the settings' sites: section; run with --settings "
                "examples/edgefeed-sites.yaml (or name a region with a link: --cut-region)"
            )
        )
    settings_path = ctx.find_root().obj.get("settings_path")
    stack = run_reported(lambda: DevStack(settings, state_dir))
    console.rule("1. the sites: a central site, a broker per region, WAN links")
    statuses = run_reported(stack.up)
    print_status(statuses, as_json=False)
    if any(s.state != "running" for s in statuses):
        raise typer.Exit(EXIT_ERROR)
    wan = WanControl(stack.wan_control_path)
    for entry in run_reported(wan.status):
        console.print(f"  link {entry['name']}: {entry['delay_ms']:g} ms one way")

    console.rule("2. source tables and the Debezium connector")
    run_reported(lambda: apply_schema(settings.database.dsn()))
    with ConnectClient(
        settings.connect.url,
        timeout_s=settings.connect.timeout_s,
        secrets=settings.database.secrets(),
    ) as client:
        run_reported(lambda: deploy.apply(client, settings.database, settings.sources, wait_s=120))

    console.rule("3. router; per region: forwarder (across its link) and feature worker")
    exe = str(Path(sys.executable).with_name("edgefeed"))
    settings_arg = str(Path(settings_path).resolve()) if settings_path else None
    base = [exe, "--settings", settings_arg] if settings_arg else [exe]
    apps: list[tuple[str, list[str], str]] = [("router", ["--role", "router"], "Worker]: Ready")]
    for region in settings.region_names:
        if region in settings.sites.regions:
            apps.append((f"forward-{region}", ["--role", "forwarder", "--region", region], "ready"))
        apps.append((region, ["--region", region], "Worker]: Ready"))
    for region in settings.region_names:
        # A single-site demo's worker of this region (same stack) reads the central
        # broker and would keep the region's cache fresh through the cut: stop it.
        stack.stop_app(f"pipeline-{region}")
    for name, args, ready in apps:
        stack.stop_app(f"pipeline-{name}")  # a previous run's, started with other settings
        port = free_port()
        command = [*base, "pipeline", "run", *args, "--metrics-port", str(port)]
        run_reported(
            lambda name=name, command=command, ready=ready: stack.start_app(  # type: ignore[misc]
                f"pipeline-{name}", command, ready=ready, timeout_s=180
            )
        )
        stack.scrape("edgefeed-pipeline", f"pipeline-{name}", port)
        console.print(f"  pipeline {name}: ready")
    start_exporter(stack, base, settings)

    console.rule(f"4. load {rate:.0f} changes/s; cut {link} for {cut_s:.0f}s, then heal")
    load = ShopLoad(settings.database.dsn(), settings.region_names)
    run_reported(load.seed_rows)
    stop = threading.Event()

    def write_load() -> None:
        while not stop.is_set():  # in 2 s runs, so that it stops soon after the heal
            load.run(rate, 2.0)

    writer = threading.Thread(target=write_load, daemon=True, name="demo-load")
    started = time.monotonic()
    writer.start()
    took = None
    try:
        _watch(settings, wan, started, before_s)
        console.print(f"  -> cut {link}: nothing crosses it; {cut_region} serves its cache")
        wan.cut(link)
        try:
            _watch(settings, wan, started, cut_s)
        finally:
            wan.heal(link)
        console.print(f"  -> healed {link}: the forwarder sends what it held")
        took = _watch(settings, wan, started, catch_up_limit_s, until=cut_region)
    finally:
        stop.set()
        writer.join(timeout=30)
    if took is None:
        console.print(f"[red]{cut_region} did not catch up within {catch_up_limit_s:.0f}s[/]")
        raise typer.Exit(EXIT_ERROR)
    console.print(
        f"  {cut_region} caught up {took:.1f}s after the heal (within 2 s of the other regions)"
    )

    console.rule("5. every region equals a recomputation from PostgreSQL (no loss, no double)")
    report = verify_until(settings, settings.region_names, timeout_s=120)
    print_verified(report)
    if settings.monitoring.prometheus_port is not None:
        console.rule("6. alerts: the rules of deploy/prometheus on the local Prometheus")
        from edgefeed.localalerts import print_alert_state

        print_alert_state(console, settings.monitoring)
    console.print(
        "the sites, the pipeline and the exporter keep running; `edgefeed --settings "
        f"{settings_path or 'edgefeed.yaml'} lag` shows links and seconds behind; stop "
        f"everything with: edgefeed --settings {settings_path or 'edgefeed.yaml'} dev down"
    )
    if not report.ok:
        raise typer.Exit(EXIT_ERROR)
