"""The ``edgefeed`` command: one entry point, one sub-command group per concern.

Each concern lives in its own module with a ``register(app)`` function. The root
group imports a module only when one of its commands is invoked (click's "lazy
group" pattern), and the modules import their domain (torch, Pillow, Faust,
redis, psycopg, aiokafka) inside the commands, so ``edgefeed --help`` and
``edgefeed <group> --help`` start in a fraction of the time a command takes.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from typer.core import TyperCommand, TyperGroup

from edgefeed import __version__
from edgefeed_base.errors import EdgefeedError

if TYPE_CHECKING:
    # Typer vendors click (0.2x); only the types are needed, and only by mypy.
    from typer._click import Command, Context, HelpFormatter

__all__ = ["COMMANDS", "LazyCommand", "LazyGroup", "app", "main"]


@dataclass(frozen=True, slots=True)
class LazyCommand:
    """A root command whose module is imported only when the command runs.

    Attributes:
        module: The module whose ``register(app)`` adds the command.
        help: Its one-line help, as ``edgefeed --help`` lists it (a unit test
            checks that it matches the module's own text).
    """

    module: str
    help: str


# In the order `edgefeed --help` lists them.
COMMANDS: dict[str, LazyCommand] = {
    "preprocess": LazyCommand(
        "edgefeed.cli.preprocess",
        "Preprocess images into envelopes for the model workers; print bytes before/after.",
    ),
    "lag": LazyCommand(
        "edgefeed.cli.monitoring",
        "Consumer lag (messages, seconds, Burrow status), region freshness, slots, connectors.",
    ),
    "exporter": LazyCommand(
        "edgefeed.cli.monitoring",
        "Serve Prometheus metrics (kafka_exporter names plus edgefeed_*) on /metrics.",
    ),
    "dev": LazyCommand(
        "edgefeed.cli.dev", "Run the local stack: real services on loopback, no Docker."
    ),
    "demo": LazyCommand("edgefeed.cli.demo", "The end-to-end demo on the local stack."),
    "connectors": LazyCommand(
        "edgefeed.cli.connectors",
        "Debezium connectors on Kafka Connect, generated from the settings.",
    ),
    "pipeline": LazyCommand(
        "edgefeed.cli.pipeline", "The Faust pipeline: router and regional feature workers."
    ),
    "features": LazyCommand(
        "edgefeed.cli.features",
        "Feature-set changes per region: plan, then apply with backfill.",
    ),
    "cache": LazyCommand(
        "edgefeed.cli.cache",
        "The per-region edge caches: read feature vectors like a serving process.",
    ),
    "workers": LazyCommand(
        "edgefeed.cli.workers",
        "Model workers: dynamic batching on GPU or CPU, per-request latency budget.",
    ),
    "deploy": LazyCommand(
        "edgefeed.cli.deploy",
        "Deployment files generated from the settings: Kubernetes overlays.",
    ),
    "lab": LazyCommand(
        "edgefeed.cli.lab",
        "The latency lab: central vs edge topologies on emulated WAN links, every term measured.",
    ),
}


@cache
def _commands_of(module: str) -> dict[str, Command]:
    """The click commands that ``module.register`` adds, built once per process."""
    holder = typer.Typer()
    importlib.import_module(module).register(holder)
    return dict(typer.main.get_group(holder).commands)


class LazyGroup(TyperGroup):
    """The root group: imports a command's module when the command is resolved.

    Listing the commands for ``--help`` uses the one-line texts in :data:`COMMANDS`
    (click's documented lazy group imports every module to read their help).
    """

    #: False makes ``--help`` import the modules and read their texts (the unit test's
    #: reference for the listed texts).
    help_without_import = True
    _listing = False

    def list_commands(self, ctx: Context) -> list[str]:
        return [*super().list_commands(ctx), *COMMANDS]

    def get_command(self, ctx: Context, cmd_name: str) -> Command | None:
        eager = super().get_command(ctx, cmd_name)
        lazy = COMMANDS.get(cmd_name)
        if eager is not None or lazy is None:
            return eager
        if self._listing and self.help_without_import:
            return TyperCommand(cmd_name, help=lazy.help)
        return _commands_of(lazy.module)[cmd_name]

    def invoke(self, ctx: Context) -> object:
        """Run the command; a secret it needs but cannot read ends it as ``fail`` does.

        Every component reads its secrets when it is built, wherever a command
        builds it (edgefeed_base.secrets): the message names the setting and the
        file or variable, exit 2, instead of a traceback.
        """
        try:
            return super().invoke(ctx)
        except EdgefeedError as exc:
            from edgefeed_base.secrets import SecretSourceError  # loaded: it was raised

            if not isinstance(exc, SecretSourceError):
                raise
            from edgefeed.cli._common import fail

            fail(exc)

    def format_help(self, ctx: Context, formatter: HelpFormatter) -> None:
        self._listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self._listing = False


app = typer.Typer(
    name="edgefeed",
    cls=LazyGroup,
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


def main() -> None:
    """Console-script entry point."""
    app()
