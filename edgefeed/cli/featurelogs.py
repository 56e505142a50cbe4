"""``edgefeed features logs``: what the models saw (workers.feature_log), summarised and
joined with labels into a training set.

Exit codes: 0 success, 1 error, 2 bad input (a corrupt file, a missing column).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from edgefeed.cli._common import console, fail, run_reported

__all__ = ["logs_app"]

logs_app = typer.Typer(
    help="Logs of what the models saw (workers.feature_log): summary, join with labels.",
    no_args_is_help=True,
)
JsonFlag = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
DirArg = Annotated[Path, typer.Argument(help="The log folder (workers.feature_log.dir).")]


@logs_app.command("summary")
def summary_cmd(folder: DirArg, as_json: JsonFlag = False) -> None:
    """Rows, time span, feature-set versions, entity types and files of a log folder.

    Exits 2 when a file is corrupt (it is named); temporary files are listed.
    """
    from workers.logfiles import summarize

    found = run_reported(lambda: summarize(folder))
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "rows": found.rows,
                    "start": None if found.start is None else str(found.start),
                    "end": None if found.end is None else str(found.end),
                    "feature_set_versions": dict(found.versions),
                    "models": dict(found.models),
                    "regions": dict(found.regions),
                    "entity_types": sorted(found.entities),
                    "files": [{"path": str(f.path), "rows": f.rows} for f in found.files],
                    "corrupt": [{"path": str(p), "error": why} for p, why in found.corrupt],
                    "temporary": [str(p) for p in found.temporary],
                },
                indent=2,
            )
        )
    else:
        console.print(
            f"{found.rows} rows in {len(found.files)} files, read from {found.start} "
            f"to {found.end}",
            highlight=False,
        )
        table = Table("what", "value", "rows")
        for what, counter in (
            ("feature-set version", found.versions),
            ("model", found.models),
            ("region", found.regions),
        ):
            for value, rows in sorted(counter.items()):
                table.add_row(what, value, str(rows))
        table.add_row("entity types", ", ".join(sorted(found.entities)) or "-", "")
        console.print(table)
        for path in found.temporary:
            console.print(
                f"temporary: {path} (a writer is running, or was killed: a worker started "
                "on this folder turns it into Parquet)",
                highlight=False,
                markup=False,
                soft_wrap=True,
            )
        for path, why in found.corrupt:
            console.print(f"corrupt: {path}: {why}", highlight=False, markup=False, soft_wrap=True)
    if found.corrupt:
        raise typer.Exit(2)


@logs_app.command("join")
def join_cmd(
    folder: DirArg,
    labels: Annotated[
        Path, typer.Option(help="Parquet labels: request_id (or entity ids and a time).")
    ],
    out: Annotated[Path, typer.Option(help="Parquet file to write the training set to.")],
    on: Annotated[
        str,
        typer.Option(
            help="'request': on request_id (and item_id ...); 'asof': on the entity ids, "
            "the latest row read at or before each label's time."
        ),
    ] = "request",
    time_column: Annotated[
        str, typer.Option(help="With --on asof: the labels' time column (with a zone).")
    ] = "timestamp",
    tolerance_s: Annotated[
        float, typer.Option(min=0, help="With --on asof: how far back a logged row may be.")
    ] = 3600.0,
    as_json: JsonFlag = False,
) -> None:
    """Join a log folder with labels into a Parquet training set (typed Arrow columns)."""
    from workers.exceptions import FeatureLogError
    from workers.logfiles import join_labels

    if on not in ("request", "asof"):
        fail(FeatureLogError(f"--on {on!r} is not a join: use request or asof"))
    report = run_reported(
        lambda: join_labels(
            folder,
            labels,
            out,
            on="asof" if on == "asof" else "request",
            time_column=time_column,
            tolerance_s=tolerance_s,
        )
    )
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "out": str(report.out),
                    "rows": report.rows,
                    "labels": report.labels,
                    "unmatched_labels": report.unmatched,
                    "keys": list(report.keys),
                },
                indent=2,
            )
        )
        return
    console.print(
        f"wrote {report.rows} rows to {report.out} (joined on {', '.join(report.keys)}; "
        f"{report.unmatched} of {report.labels} labels had no logged row)",
        highlight=False,
    )
