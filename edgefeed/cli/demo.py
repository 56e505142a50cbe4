"""``edgefeed demo``: the end-to-end demonstration on the local stack (``make demo``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from edgefeed.cli._common import EXIT_ERROR, console, run_reported, settings_of
from edgefeed.cli.dev import print_status
from edgefeed.devstack import DevStack

__all__ = ["register"]

demo_app = typer.Typer(help="The end-to-end demo on the local stack.", no_args_is_help=True)


@demo_app.command("run")
def run(
    ctx: typer.Context,
    state_dir: Annotated[
        Path, typer.Option("--state-dir", envvar="EDGEFEED_STATE_DIR", help="Local stack state.")
    ] = Path(".edgefeed"),
) -> None:
    """Bring the local stack up and show that every service is healthy."""
    settings = settings_of(ctx)
    stack = run_reported(lambda: DevStack(settings, state_dir))
    console.rule("1. local stack")
    console.print(f"starting real services on loopback (state in {stack.state_dir}) ...")
    statuses = run_reported(stack.up)
    print_status(statuses, as_json=False)
    if any(s.state != "running" for s in statuses):
        raise typer.Exit(EXIT_ERROR)
    console.print("stop everything with: edgefeed --settings <file> dev down")


def register(app: typer.Typer) -> None:
    """Add ``edgefeed demo`` to the root app."""
    app.add_typer(demo_app, name="demo")
