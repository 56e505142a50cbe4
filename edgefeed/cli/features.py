"""``edgefeed features``: feature-set changes per region, backfilled by incremental snapshots.

Exit codes: 0 success (``plan``: nothing to change), 1 error, 2 refused (bad
input: nothing registered), 3 ``plan``: changes pending.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from edgefeed.cli._common import console, run_reported, settings_of

if TYPE_CHECKING:
    from pipeline.featureplan import EntityPlan
    from pipeline.settings import FeatureReader

__all__ = ["register"]

EXIT_PENDING = 3

features_app = typer.Typer(
    help="Feature-set changes per region: plan, then apply with backfill.",
    no_args_is_help=True,
)
JsonFlag = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
ModelOption = Annotated[
    list[Path] | None,
    typer.Option(
        "--model",
        help="A deployed ranker checkpoint: the features it reads are kept (repeatable).",
    ),
]
RegionOption = Annotated[
    list[str] | None,
    typer.Option("--region", help="Only this region (repeatable; default: every region)."),
]
BreakOption = Annotated[
    bool,
    typer.Option(
        "--break-readers",
        help="Accept a version readers of the older one cannot read (not append-only).",
    ),
]


def _readers(paths: list[Path] | None) -> list[FeatureReader]:
    """The feature lists of ranker checkpoints (``RankerConfig``)."""
    if not paths:
        return []
    from pipeline.settings import FeatureReader
    from workers.models.loading import load_checkpoint

    readers = []
    for path in paths:
        checkpoint = run_reported(lambda path=path: load_checkpoint(path))  # type: ignore[misc]
        config = checkpoint["config"]
        reads = {
            str(config[f"{side}_entity"]): list(config[f"{side}_features"])
            for side in ("user", "item")
            if f"{side}_entity" in config
        }
        readers.append(
            FeatureReader(name=path.stem, version=str(checkpoint.get("version", "1")), reads=reads)
        )
    return readers


def _show(plans: list[EntityPlan]) -> None:
    table = Table(title="features", title_justify="left")
    for column in ("region", "entity", "version", "change", "detail"):
        table.add_column(column, overflow="fold")
    colours = {"added": "green", "changed": "yellow", "removed": "red"}
    for plan in plans:
        old = "-" if plan.deployed_version is None else str(plan.deployed_version)
        version = f"{old} -> {plan.desired_version}"
        table.add_row(plan.region, plan.entity, version, plan.action, "")
        for change in plan.changes:
            colour = colours[change.kind]
            table.add_row("", "", "", f"[{colour}]{change.kind}[/]", change.name)
        for name, why in plan.history.items():
            table.add_row("", "", "", "[magenta]needs history[/]", f"{name}: {why}")
        if plan.snapshot:
            table.add_row("", "", "", "snapshot", ", ".join(plan.snapshot))
        if not plan.known:
            table.add_row("", "", "", "[dim]unknown[/]", "deployed declaration not registered")
        for problem in plan.problems:
            table.add_row("", "", "", "[bold red]refused[/]", problem)
    console.print(table)


@features_app.command("plan")
def plan_cmd(
    ctx: typer.Context,
    model: ModelOption = None,
    region: RegionOption = None,
    break_readers: BreakOption = False,
    as_json: JsonFlag = False,
) -> None:
    """Diff the settings' features against each region's; exits 3 when changes are pending."""
    from edgefeed.features import plan_features

    settings = settings_of(ctx)
    readers = _readers(model)
    plans = run_reported(lambda: plan_features(settings, readers, allow_breaking=break_readers))
    if as_json:
        typer.echo(json.dumps([p.as_dict() for p in plans], indent=2))
    else:
        _show(plans)
    if any(p.problems for p in plans):
        raise typer.Exit(2)
    if any(p.action != "unchanged" for p in plans):
        raise typer.Exit(EXIT_PENDING)


@features_app.command("apply")
def apply_cmd(
    ctx: typer.Context,
    model: ModelOption = None,
    region: RegionOption = None,
    break_readers: BreakOption = False,
    wait: Annotated[
        float, typer.Option(help="Seconds to wait for the workers to write the new version.")
    ] = 600.0,
    pace: Annotated[
        bool,
        typer.Option(
            help="Follow the snapshots to their end, paced to sources[].snapshot_rows_per_s "
            "so streaming keeps its freshness (--no-pace: signal them and return)."
        ),
    ] = True,
    as_json: JsonFlag = False,
) -> None:
    """Register the new versions, wait for the workers, snapshot what needs history."""
    from connectors.client import ConnectClient
    from edgefeed.features import apply_features

    settings = settings_of(ctx)
    readers = _readers(model)

    def registered() -> None:
        if not as_json:
            console.print(
                "registered; restart the regional workers with these settings now "
                f"(waiting up to {wait:g} s for them)",
                highlight=False,
            )

    with ConnectClient(
        settings.connect.url,
        timeout_s=settings.connect.timeout_s,
        retries=settings.connect.retries,
        secrets=settings.database.secrets(),
    ) as client:
        done = run_reported(
            lambda: apply_features(
                settings,
                client,
                readers,
                regions=region,
                wait_s=wait,
                allow_breaking=break_readers,
                on_registered=registered,
                pace=pace,
            )
        )
    if as_json:
        typer.echo(json.dumps(done.as_dict(), indent=2))
        return
    for where, entity, version in done.registered:
        console.print(f"registered {entity} v{version} in {where}", highlight=False)
    for request in done.snapshots:
        console.print(
            f"snapshot {request.id}: {request.table} (progress: `edgefeed lag`)", highlight=False
        )
    for report in done.paced:
        console.print(report.summary(), highlight=False, markup=False)
    if not done.registered:
        console.print("nothing to change")


@features_app.command("history")
def history_cmd(
    ctx: typer.Context,
    entity: Annotated[str, typer.Option(help="Entity type (e.g. user).")],
    spine: Annotated[
        Path, typer.Option(help="Parquet file: entity id, read time (with a zone), labels.")
    ],
    out: Annotated[Path, typer.Option(help="Parquet file to write the training set to.")],
    entity_column: Annotated[
        str | None,
        typer.Option(help="The spine's entity id column (default: the entity's id column)."),
    ] = None,
    time_column: Annotated[
        str, typer.Option(help="The spine's read-time column (timestamp with a time zone).")
    ] = "timestamp",
    region: Annotated[
        str | None,
        typer.Option(help="The region whose vectors to give (needed for a shared entity)."),
    ] = None,
    version: Annotated[
        int | None,
        typer.Option(help="The feature-set version expected (refused if no longer defined)."),
    ] = None,
    source: Annotated[
        str,
        typer.Option(
            help="Where the history comes from: 'tables' (current rows and their commit "
            "times) or 'topics' (every change in the CDC topics: updates and deletes too)."
        ),
    ] = "tables",
    batch_rows: Annotated[int, typer.Option(min=1, help="Spine rows per batch.")] = 65_536,
    as_json: JsonFlag = False,
) -> None:
    """The features as of each spine row's read time (a point-in-time training set)."""
    from edgefeed.training import build_training_set

    settings = settings_of(ctx)
    report = run_reported(
        lambda: build_training_set(
            settings,
            entity,
            spine,
            out,
            entity_column=entity_column,
            time_column=time_column,
            region=region,
            version=version,
            source=source,
            batch_rows=batch_rows,
        )
    )
    if as_json:
        summary = {
            "out": str(report.out),
            "rows": report.rows,
            "entity": report.entity,
            "version": report.version,
            "notes": report.notes,
        }
        typer.echo(json.dumps(summary, indent=2))
        return
    console.print(
        f"wrote {report.rows} rows of {report.entity} v{report.version} to {report.out}",
        highlight=False,
    )
    for note in report.notes:
        console.print(f"not exact: {note}", highlight=False, markup=False)


def register(app: typer.Typer) -> None:
    """Add ``edgefeed features`` to the root app."""
    from edgefeed.cli.featurelogs import logs_app

    if not any(group.name == "logs" for group in features_app.registered_groups):
        features_app.add_typer(logs_app, name="logs")
    app.add_typer(features_app, name="features")
