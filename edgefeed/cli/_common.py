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

from connectors.secrets import redact, redact_urls
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
    "shown",
]

EXIT_ERROR = 1
EXIT_USAGE = 2

console = Console()
err_console = Console(stderr=True)

T = TypeVar("T")
# Secrets of the settings loaded in this process, masked in every reported error.
_SECRETS: set[str] = set()


def settings_path_of(ctx: typer.Context) -> Path | None:
    obj: dict[str, Any] = ctx.find_root().obj or {}
    path = obj.get("settings_path")
    return Path(path) if path is not None else None


def settings_of(ctx: typer.Context) -> EdgefeedSettings:
    """Load the settings named by ``--settings`` (or the defaults), reporting errors cleanly.

    The settings' secrets are remembered so that :func:`fail` redacts them from
    any error, whichever package raised it: those that can be read now. One that
    cannot is no error here (a command that never uses it must run without it);
    the component that needs it raises ``SecretSourceError`` naming the setting.
    """
    return settings_at(settings_path_of(ctx))


def settings_at(path: Path | None) -> EdgefeedSettings:
    """:func:`settings_of` for the settings file at ``path`` (None: the defaults), for
    code without the command's context (a worker process of a supervisor)."""
    from edgefeed.settings import load_settings, secrets_of  # imports every domain's settings

    settings = run_reported(lambda: load_settings(path))
    # SecretStr fields dump as "****"; the values come from their sources.
    _SECRETS.update(s for s in secrets_of(settings.model_dump(mode="json")) if s.strip("*"))
    _SECRETS.update(settings.database.secrets())
    _SECRETS.add(settings.kafka.security.secret_for_redaction())
    for region in settings.regions:
        _SECRETS.update(
            u.secret_for_redaction() for u in (region.reader, region.writer) if u is not None
        )
    _SECRETS.discard("")
    return settings


@contextmanager
def reported_errors() -> Iterator[None]:
    """Turn an :class:`EdgefeedError` into a one-paragraph message and a non-zero exit."""
    try:
        yield
    except EdgefeedError as exc:
        fail(exc)


def shown(text: str) -> str:
    """``text`` as it may be shown: URL userinfo and every known secret masked."""
    return redact(redact_urls(text), _SECRETS)


def fail(exc: EdgefeedError) -> NoReturn:
    """Print ``exc`` on stderr and exit: 2 for bad input (ValueError), 1 otherwise.

    The last line of defence for secrets: whatever the message, URL userinfo
    and the loaded settings' secrets are masked.
    """
    err_console.print(f"[bold red]error:[/] {escape(shown(str(exc)))}", highlight=False)
    raise typer.Exit(EXIT_USAGE if isinstance(exc, ValueError) else EXIT_ERROR) from None


def run_reported(func: Callable[[], T]) -> T:
    """Call ``func``; an :class:`EdgefeedError` becomes a message and an exit code."""
    try:
        return func()
    except EdgefeedError as exc:
        fail(exc)


def is_tty() -> bool:
    return sys.stdout.isatty()
