"""``edgefeed cache``: read feature vectors from a region's edge cache, as serving code does."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from edgefeed.cli._common import console, run_reported, settings_of

if TYPE_CHECKING:
    import numpy as np

__all__ = ["register"]

cache_app = typer.Typer(
    help="The per-region edge caches: read feature vectors like a serving process.",
    no_args_is_help=True,
)


def _time(value: np.datetime64) -> str | None:
    import numpy as np

    if np.isnat(value):
        return None
    return f"{np.datetime_as_string(value, unit='us')}Z"


def _rows(result: Any) -> list[dict[str, Any]]:
    rows = []
    for i, (entity_id, values) in enumerate(zip(result.ids, result.to_dicts(), strict=True)):
        rows.append(
            {
                "id": entity_id,
                "found": bool(result.found[i]),
                "stale": bool(result.stale[i]),
                "commit_time": _time(result.commit_time[i]),
                "write_time": _time(result.write_time[i]),
                "values": values,
            }
        )
    return rows


@cache_app.command("get")
def get(
    ctx: typer.Context,
    entity: Annotated[str, typer.Argument(help="Entity type (e.g. user, item).")],
    ids: Annotated[list[str], typer.Argument(help="One or more entity ids.")],
    region: Annotated[
        str | None,
        typer.Option("--region", "-r", help="Region to read from (default: the first declared)."),
    ] = None,
    features: Annotated[
        str | None, typer.Option("--features", "-f", help="Comma-separated feature names.")
    ] = None,
    max_staleness: Annotated[
        float | None,
        typer.Option(help="Withhold vectors whose source commit is older (seconds)."),
    ] = None,
    timeout_s: Annotated[
        float, typer.Option(help="Deadline of the whole read from one region, in seconds.")
    ] = 1.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for machines.")] = False,
) -> None:
    """Read ENTITY vectors for IDS with the same client, failover and residency rules
    as serving code; the output says which region served them and how fresh they are."""
    from edgefeed.lookup import feature_client

    settings = settings_of(ctx)
    name = region or settings.region_names[0]
    run_reported(lambda: settings.region(name))
    names = [f.strip() for f in features.split(",") if f.strip()] if features else None

    def read() -> Any:
        with feature_client(settings, name, timeout_s=timeout_s) as client:
            return client.get(entity, ids, names, max_staleness=max_staleness)

    result = run_reported(read)
    rows = _rows(result)
    if as_json:
        document = {
            "entity": result.entity,
            "region": name,
            "served_by": result.region,
            "features": list(result.features),
            "rows": rows,
        }
        typer.echo(json.dumps(document, default=str))
        return
    table = Table(
        title=f"{result.entity} from {result.region}"
        + (f" (failover from {name})" if result.region != name else ""),
    )
    table.add_column("feature")
    for entity_id in result.ids:
        table.add_column(str(entity_id), justify="right")
    table.add_row(
        "[dim]found[/]",
        *[("stale" if r["stale"] else "yes") if r["found"] or r["stale"] else "no" for r in rows],
    )
    table.add_row("[dim]source commit[/]", *[r["commit_time"] or "-" for r in rows])
    table.add_row("[dim]written[/]", *[r["write_time"] or "-" for r in rows])
    for feature in result.features:
        table.add_row(
            feature,
            *["-" if r["values"][feature] is None else str(r["values"][feature]) for r in rows],
        )
    console.print(table)


def register(app: typer.Typer) -> None:
    """Add the ``cache`` commands to the root app."""
    app.add_typer(cache_app, name="cache")
