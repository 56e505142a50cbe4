"""``edgefeed connectors``: Debezium connectors on Kafka Connect, from the settings file.

Exit codes: 0 success (``plan``: nothing to change; ``status``: all running),
1 error (Connect unreachable, connector failed), 2 bad input (invalid settings,
config rejected by Connect), 3 ``plan``: changes pending / ``status``: not all running.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from edgefeed.cli._common import console, run_reported, settings_of

if TYPE_CHECKING:
    from connectors import deploy
    from connectors.client import ConnectClient
    from edgefeed.settings import EdgefeedSettings

__all__ = ["register"]

EXIT_PENDING = 3

connectors_app = typer.Typer(
    help="Debezium connectors on Kafka Connect, generated from the settings.",
    no_args_is_help=True,
)
JsonFlag = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
NameArg = Annotated[
    str | None, typer.Argument(help="Connector name (default: every declared one).")
]


def _client(settings: EdgefeedSettings) -> ConnectClient:
    from connectors.client import ConnectClient

    return ConnectClient(
        settings.connect.url,
        timeout_s=settings.connect.timeout_s,
        retries=settings.connect.retries,
        secrets=settings.database.secrets(),
    )


def _names(settings: EdgefeedSettings, name: str | None) -> list[str]:
    if name is not None:
        return [name]
    return [source.connector_name for source in settings.sources]


def _print_changes(changes: list[deploy.ConnectorChange], as_json: bool, applied: bool) -> None:
    if as_json:
        typer.echo(json.dumps([c.as_dict() for c in changes], indent=2))
        return
    if not changes:
        console.print("no sources declared and no edgefeed connectors deployed")
        return
    verbs = {
        "create": "created",
        "update": "updated",
        "unchanged": "unchanged",
        "delete": "deleted",
    }
    colours = {"create": "green", "update": "yellow", "unchanged": "dim", "delete": "red"}
    for change in changes:
        action = verbs[change.action] if applied else change.action
        console.print(f"[{colours[change.action]}]{action:>9}[/] {change.name}")
        if change.action == "update":
            for key, (old, new) in change.changed.items():
                console.print(
                    f"            {key}: {old!r} -> {new!r}", highlight=False, markup=False
                )
        elif change.action == "create" and not applied:
            console.print(f"            {len(change.changed)} settings", highlight=False)


@connectors_app.command("plan")
def plan_cmd(ctx: typer.Context, as_json: JsonFlag = False) -> None:
    """Show what `apply` would change (secrets masked); exits 3 when changes are pending."""
    from connectors import deploy

    settings = settings_of(ctx)
    with _client(settings) as client:
        changes = run_reported(lambda: deploy.plan(client, settings.database, settings.sources))
    _print_changes(changes, as_json, applied=False)
    if any(c.action != "unchanged" for c in changes):
        raise typer.Exit(EXIT_PENDING)


@connectors_app.command("apply")
def apply_cmd(
    ctx: typer.Context,
    prune: Annotated[bool, typer.Option(help="Delete edgefeed-* connectors not declared.")] = False,
    wait: Annotated[
        float, typer.Option(help="Seconds to wait for RUNNING (0: do not wait).")
    ] = 60.0,
    as_json: JsonFlag = False,
) -> None:
    """Validate every connector, then create or update them all (or none)."""
    from connectors import deploy

    settings = settings_of(ctx)
    with _client(settings) as client:
        changes = run_reported(
            lambda: deploy.apply(
                client, settings.database, settings.sources, prune=prune, wait_s=wait or None
            )
        )
    _print_changes(changes, as_json, applied=True)


@connectors_app.command("status")
def status_cmd(ctx: typer.Context, name: NameArg = None, as_json: JsonFlag = False) -> None:
    """Connector and task states, with the cause of any failure; exits 3 unless all run."""
    settings = settings_of(ctx)
    rows = []
    with _client(settings) as client:
        for connector in _names(settings, name):
            status = run_reported(lambda connector=connector: client.status(connector))  # type: ignore[misc]
            rows.append((connector, status))
    if as_json:
        typer.echo(
            json.dumps(
                [
                    s.as_dict() if s else {"name": n, "state": "ABSENT", "tasks": []}
                    for n, s in rows
                ],
                indent=2,
            )
        )
    else:
        table = Table(title="connectors")
        for column in ("connector", "state", "tasks", "cause"):
            table.add_column(column)
        for connector, status in rows:
            if status is None:
                table.add_row(connector, "[red]ABSENT[/]", "-", "not deployed: run apply")
                continue
            tasks = ", ".join(f"{t.id}:{t.state}" for t in status.tasks) or "-"
            colour = "green" if status.running else ("red" if status.failed else "yellow")
            table.add_row(connector, f"[{colour}]{status.state}[/]", tasks, status.failure() or "")
        console.print(table)
    if not rows or not all(s is not None and s.running for _, s in rows):
        raise typer.Exit(EXIT_PENDING)


@connectors_app.command("snapshot")
def snapshot_cmd(
    ctx: typer.Context,
    table: Annotated[
        str | None, typer.Option("--table", help="The captured table, schema.table.")
    ] = None,
    filter_sql: Annotated[
        str | None,
        typer.Option("--filter", help="SQL condition on the table's columns (default: all rows)."),
    ] = None,
    pace: Annotated[
        bool,
        typer.Option(
            help="Follow the snapshot to its end, paced to sources[].snapshot_rows_per_s so "
            "streaming keeps its freshness (--no-pace: signal it and return)."
        ),
    ] = True,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume",
            help="Resume the snapshots of every source (one a pacer killed while paused "
            "left PAUSED in `edgefeed lag`).",
        ),
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """Re-read a table's rows while streaming goes on (Debezium incremental snapshot)."""
    from connectors.pacing import write_signal
    from connectors.snapshot import request_snapshot, snapshot_paced

    settings = settings_of(ctx)
    if resume:
        for source in settings.sources:
            run_reported(
                lambda source=source: write_signal(  # type: ignore[misc]
                    settings.database, source, "resume-snapshot", {"type": "INCREMENTAL"}
                )
            )
            console.print(f"resume signalled to {source.connector_name}", highlight=False)
        return
    if table is None:
        raise typer.BadParameter("name the table to snapshot (or --resume)", param_hint="--table")
    wanted = table

    def announce(requests: list[Any]) -> None:
        if as_json:
            return
        for request in requests:
            console.print(
                f"snapshot {request.id} signalled to {request.connector}: {request.table}"
                + (f" where {request.filter}" if request.filter else " (every row)"),
                highlight=False,
                markup=False,
            )
        console.print(
            "following it to its end, paced (Ctrl-C stops following; the snapshot goes on); "
            "progress: `edgefeed lag`",
            highlight=False,
            markup=False,
        )

    with _client(settings) as client:
        if not pace:
            request = run_reported(
                lambda: request_snapshot(
                    client, settings.database, settings.sources, wanted, filter_sql
                )
            )
            if as_json:
                typer.echo(json.dumps(request.as_dict(), indent=2))
                return
            console.print(
                f"snapshot {request.id} signalled to {request.connector}: {request.table}"
                + (f" where {request.filter}" if request.filter else " (every row)"),
                highlight=False,
                markup=False,
            )
            console.print("progress: `edgefeed lag` (snapshots)", highlight=False, markup=False)
            return
        requests, reports = run_reported(
            lambda: snapshot_paced(
                client,
                settings.database,
                settings.sources,
                [(wanted, filter_sql)],
                settings.kafka.bootstrap_servers,
                client_options=settings.kafka.security.aiokafka_options(),
                on_signalled=announce,
            )
        )
    if as_json:
        typer.echo(
            json.dumps({**requests[0].as_dict(), "paced": [r.as_dict() for r in reports]}, indent=2)
        )
        return
    for report in reports:
        console.print(report.summary(), highlight=False, markup=False)


def _each(ctx: typer.Context, name: str | None, verb: str) -> None:
    settings = settings_of(ctx)
    with _client(settings) as client:
        for connector in _names(settings, name):
            if verb == "restart":
                run_reported(lambda c=connector: client.restart(c))  # type: ignore[misc]
            elif verb == "pause":
                run_reported(lambda c=connector: client.pause(c))  # type: ignore[misc]
            elif verb == "resume":
                run_reported(lambda c=connector: client.resume(c))  # type: ignore[misc]
            elif verb == "delete":
                run_reported(lambda c=connector: client.delete(c))  # type: ignore[misc]
            console.print(f"{verb}: {connector}")


@connectors_app.command("restart")
def restart_cmd(ctx: typer.Context, name: NameArg = None) -> None:
    """Restart a connector and its failed tasks."""
    _each(ctx, name, "restart")


@connectors_app.command("pause")
def pause_cmd(ctx: typer.Context, name: NameArg = None) -> None:
    """Pause a connector (its slot keeps retaining WAL meanwhile)."""
    _each(ctx, name, "pause")


@connectors_app.command("resume")
def resume_cmd(ctx: typer.Context, name: NameArg = None) -> None:
    """Resume a paused connector."""
    _each(ctx, name, "resume")


@connectors_app.command("delete")
def delete_cmd(
    ctx: typer.Context,
    name: NameArg = None,
    yes: Annotated[bool, typer.Option("--yes", help="Do not ask for confirmation.")] = False,
) -> None:
    """Delete a connector (its replication slot stays in PostgreSQL: drop it if unneeded)."""
    if not yes:
        typer.confirm("delete the connector(s)?", abort=True)
    _each(ctx, name, "delete")


def register(app: typer.Typer) -> None:
    """Add ``edgefeed connectors`` to the root app."""
    app.add_typer(connectors_app, name="connectors")
