"""The ``edgefeed`` command: one entry point, one sub-command group per concern.

Each concern lives in its own module with a ``register(app)`` function, so the
modules stay small and a concern's heavy imports (torch, Pillow, Faust) happen
only when its command runs.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Annotated

import typer

from edgefeed import __version__

__all__ = ["app", "main"]

_COMMAND_MODULES = (
    "dev",
    "demo",
    "connectors",
    "pipeline",
    "cache",
    "preprocess",
    "workers",
    "monitoring",
)

app = typer.Typer(
    name="edgefeed",
    help="Edge feature cache and CDC sync pipeline for multi-region AI services.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"edgefeed {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    ctx: typer.Context,
    settings: Annotated[
        Path | None,
        typer.Option(
            "--settings",
            "-s",
            help="Settings file (default: $EDGEFEED_SETTINGS, else ./edgefeed.yaml).",
            envvar="EDGEFEED_SETTINGS",
        ),
    ] = None,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    ctx.obj = {"settings_path": settings}


for _name in _COMMAND_MODULES:
    importlib.import_module(f"edgefeed.cli.{_name}").register(app)


def main() -> None:
    """Console-script entry point."""
    app()
