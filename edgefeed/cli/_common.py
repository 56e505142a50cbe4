"""Helpers shared by the CLI modules: settings from the context, error reporting."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from edgefeed.errors import EdgefeedError

if TYPE_CHECKING:
    from edgefeed.settings import EdgefeedSettings

__all__ = [
    "EXIT_ERROR",
    "EXIT_USAGE",
    "console",
    "err_console",
    "fail",
    "reported_errors",
    "run_reported",
    "settings_of",
]

EXIT_ERROR = 1
EXIT_USAGE = 2

console = Console()
err_console = Console(stderr=True)

T = TypeVar("T")


def settings_path_of(ctx: typer.Context) -> Path | None:
    obj: dict[str, Any] = ctx.find_root().obj or {}
    path = obj.get("settings_path")
    return Path(path) if path is not None else None


def settings_of(ctx: typer.Context) -> EdgefeedSettings:
    """Load the settings named by ``--settings`` (or the defaults), reporting errors cleanly."""
    from edgefeed.settings import load_settings  # imports every domain's settings

    return run_reported(lambda: load_settings(settings_path_of(ctx)))


@contextmanager
def reported_errors() -> Iterator[None]:
    """Turn an :class:`EdgefeedError` into a one-paragraph message and a non-zero exit."""
    try:
        yield
    except EdgefeedError as exc:
        fail(exc)


def fail(exc: EdgefeedError) -> NoReturn:
    """Print ``exc`` on stderr and exit: 2 for bad input (ValueError), 1 otherwise."""
    err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
    raise typer.Exit(EXIT_USAGE if isinstance(exc, ValueError) else EXIT_ERROR) from None


def run_reported(func: Callable[[], T]) -> T:
    """Call ``func``; an :class:`EdgefeedError` becomes a message and an exit code."""
    try:
        return func()
    except EdgefeedError as exc:
        fail(exc)


def is_tty() -> bool:
    return sys.stdout.isatty()
