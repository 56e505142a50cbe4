"""Runs ``edgefeed workers ...`` as its own program, for tests that need a real process.

Mirrors the root of ``edgefeed.cli`` (the ``--settings`` option) with only the
workers commands registered.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from edgefeed.cli.workers import register

app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False)


@app.callback()
def _root(
    ctx: typer.Context,
    settings: Annotated[Path | None, typer.Option("--settings", "-s")] = None,
) -> None:
    ctx.obj = {"settings_path": settings}


register(app)

if __name__ == "__main__":
    app()
