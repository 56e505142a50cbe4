"""``edgefeed dev``: the local stack (broker, PostgreSQL, Redis per region, Kafka Connect)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from edgefeed.cli._common import EXIT_ERROR, console, run_reported, settings_of

if TYPE_CHECKING:
    from edgefeed.devstack import DevStack, ServiceStatus

__all__ = ["register"]

dev_app = typer.Typer(
    help="Run the local stack: real services on loopback, no Docker.", no_args_is_help=True
)

StateDir = Annotated[
    Path,
    typer.Option(
        "--state-dir", envvar="EDGEFEED_STATE_DIR", help="Folder for pid files, logs and data."
    ),
]
JsonFlag = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]


def _stack(ctx: typer.Context, state_dir: Path) -> DevStack:
    from edgefeed.devstack import DevStack

    settings = settings_of(ctx)
    return run_reported(lambda: DevStack(settings, state_dir))


def print_status(statuses: list[ServiceStatus], as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps([s.as_dict() for s in statuses], indent=2))
        return
    table = Table(title="edgefeed local stack")
    for column in ("service", "kind", "port", "pid", "state", "detail"):
        table.add_column(column)
    colours = {"running": "green", "unhealthy": "yellow", "stopped": "red"}
    for s in statuses:
        table.add_row(
            s.name,
            s.kind,
            str(s.port),
            str(s.pid or "-"),
            f"[{colours[s.state]}]{s.state}[/]",
            s.detail,
        )
    console.print(table)


@dev_app.command("up")
def up(
    ctx: typer.Context,
    state_dir: StateDir = Path(".edgefeed"),
    timeout: Annotated[float | None, typer.Option(help="Seconds to wait per service.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Start every service that is not running yet and wait until all are healthy."""
    stack = _stack(ctx, state_dir)
    if not as_json:
        console.print(f"starting the local stack in {stack.state_dir} ...")
    statuses = run_reported(lambda: stack.up(timeout_s=timeout))
    print_status(statuses, as_json)
    if any(s.state != "running" for s in statuses):
        raise typer.Exit(EXIT_ERROR)


@dev_app.command("status")
def status(
    ctx: typer.Context, state_dir: StateDir = Path(".edgefeed"), as_json: JsonFlag = False
) -> None:
    """Show each service's state; exits 1 unless all are running and healthy."""
    stack = _stack(ctx, state_dir)
    statuses = stack.status()
    print_status(statuses, as_json)
    if any(s.state != "running" for s in statuses):
        raise typer.Exit(EXIT_ERROR)


@dev_app.command("down")
def down(
    ctx: typer.Context, state_dir: StateDir = Path(".edgefeed"), as_json: JsonFlag = False
) -> None:
    """Stop every process the stack started (and only those)."""
    stack = _stack(ctx, state_dir)
    outcome = stack.down()
    if as_json:
        typer.echo(json.dumps(outcome, indent=2))
        return
    for name, what in outcome.items():
        console.print(f"{name}: {what}")


@dev_app.command("logs")
def logs(
    ctx: typer.Context,
    service: Annotated[str | None, typer.Argument(help="Service name (default: all).")] = None,
    lines: Annotated[int, typer.Option("--lines", "-n", help="Lines per service.")] = 40,
    state_dir: StateDir = Path(".edgefeed"),
) -> None:
    """Print the end of a service's log (or of every service's)."""
    stack = _stack(ctx, state_dir)
    names = [service] if service else [s.name for s in stack.services]
    for name in names:
        text = run_reported(lambda name=name: stack.tail(name, lines))  # type: ignore[misc]
        console.rule(f"{name} ({stack.log_path(name)})")
        console.print(text, markup=False, highlight=False)


wan_app = typer.Typer(
    help="The emulated WAN links between the sites (settings: sites:).", no_args_is_help=True
)
dev_app.add_typer(wan_app, name="wan")
LinkName = Annotated[str, typer.Argument(help="Link name (see `edgefeed dev wan status`).")]


def _wan(state_dir: Path) -> Any:
    from edgefeed.wan import WanControl

    return WanControl(state_dir.resolve() / "run" / "wan.sock")


def _print_links(links: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(links, indent=2))
        return
    table = Table(title="edgefeed WAN links (seen: observed one-way delay)")
    columns = ("link", "state", "delay", "jitter", "Mbit/s", "seen", "up B", "down B", "conns")
    for column in columns:
        table.add_column(column)
    for link in links:
        state = link["state"]
        if link.get("cut_for_s") is not None:
            state = f"cut {link['cut_for_s']:.0f}s"
        table.add_row(
            link["name"],
            f"[{'green' if link['state'] == 'healed' else 'red'}]{state}[/]",
            f"{link['delay_ms']:g} ms",
            f"{link['jitter_ms']:g} ms",
            "-" if link["bandwidth_mbit"] is None else f"{link['bandwidth_mbit']:g}",
            f"{link['observed_delay_ms']:.1f} ms",
            str(link["bytes_up"]),
            str(link["bytes_down"]),
            str(link["connections_open"]),
        )
    console.print(table)


@wan_app.command("status")
def wan_status(state_dir: StateDir = Path(".edgefeed"), as_json: JsonFlag = False) -> None:
    """Each link: cut or healed, its settings, observed delay, bytes each way."""
    _print_links(run_reported(lambda: _wan(state_dir).status()), as_json)


@wan_app.command("cut")
def wan_cut(
    link: LinkName, state_dir: StateDir = Path(".edgefeed"), as_json: JsonFlag = False
) -> None:
    """Partition a link: nothing crosses it (connections stall, none is refused)."""
    _print_links([run_reported(lambda: _wan(state_dir).cut(link))], as_json)


@wan_app.command("heal")
def wan_heal(
    link: LinkName, state_dir: StateDir = Path(".edgefeed"), as_json: JsonFlag = False
) -> None:
    """End a partition: the held bytes cross, in order."""
    _print_links([run_reported(lambda: _wan(state_dir).heal(link))], as_json)


@wan_app.command("set")
def wan_set(
    link: LinkName,
    delay_ms: Annotated[float | None, typer.Option(help="One-way delay.")] = None,
    jitter_ms: Annotated[float | None, typer.Option(help="Delay variation, +/-.")] = None,
    bandwidth_mbit: Annotated[
        float | None, typer.Option(help="Cap per direction; 0 removes it.")
    ] = None,
    state_dir: StateDir = Path(".edgefeed"),
    as_json: JsonFlag = False,
) -> None:
    """Change a link's delay, jitter or bandwidth until the emulator restarts."""
    result = run_reported(
        lambda: _wan(state_dir).set(
            link, delay_ms=delay_ms, jitter_ms=jitter_ms, bandwidth_mbit=bandwidth_mbit
        )
    )
    _print_links([result], as_json)


def register(app: typer.Typer) -> None:
    """Add ``edgefeed dev`` to the root app."""
    app.add_typer(dev_app, name="dev")
