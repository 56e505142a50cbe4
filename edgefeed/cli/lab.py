"""``edgefeed lab``: the latency lab, central vs edge, every term measured."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from edgefeed.cli._common import console, run_reported, settings_of

if TYPE_CHECKING:
    from edgefeed.lab.run import LabResult

__all__ = ["register"]

lab_app = typer.Typer(
    help="The latency lab: central vs edge topologies on emulated WAN links, every term measured.",
    no_args_is_help=True,
)
StateDir = Annotated[
    Path, typer.Option("--state-dir", envvar="EDGEFEED_STATE_DIR", help="Local stack state.")
]


def print_result(result: LabResult) -> None:
    """The tables of a run, the models' accuracy and the ratio against the target."""
    from edgefeed.lab.report import topology_table

    console.rule("ranking: T_total = T_network + T_data + T_model + T_service")
    for summary in result.ranking:
        console.print(topology_table(summary))
    accuracy = ", ".join(
        f"{model.replace('_', ' ')} AUC {m.get('auc', float('nan')):.2f} / accuracy "
        f"{m.get('accuracy', float('nan')):.2f}"
        for model, m in result.accuracy.items()
    )
    console.print(f"models on held-out synthetic clicks (%): {accuracy}")
    ratio = result.ratio
    if ratio is not None:
        verdict = "[green]meets[/]" if ratio <= 1 / 3 else "[red]misses[/]"
        console.print(
            f"Edge with edgefeed / Central, T_total p50: [bold]{ratio:.3f}[/] "
            f"(target <= 0.333, case study 110/350 = 0.31): {verdict} the target"
        )
    if result.images:
        console.rule(f"images: a 1920x1080 photo, JPEG {result.photo_bytes / 1e3:.0f} kB")
        for summary in result.images:
            console.print(topology_table(summary))


@lab_app.command("run")
def run(
    ctx: typer.Context,
    requests: Annotated[int, typer.Option(help="Measured ranking requests per topology.")] = 150,
    image_requests: Annotated[
        int, typer.Option(help="Measured requests per image topology (0: skip images).")
    ] = 12,
    warmup: Annotated[int, typer.Option(help="Unmeasured requests per topology first.")] = 3,
    region: Annotated[str, typer.Option(help="The edge region (its Redis is the cache).")] = (
        "eu-west"
    ),
    report: Annotated[Path, typer.Option(help="Where to write the HTML report.")] = Path(
        "latency-lab.html"
    ),
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    start_stack: Annotated[
        bool,
        typer.Option(
            "--start-stack/--no-start-stack",
            help="Start PostgreSQL and the region's Redis of the local stack if they are down.",
        ),
    ] = True,
    state_dir: StateDir = Path(".edgefeed"),
) -> None:
    """Deploy Central, Edge without cache and Edge with edgefeed (and the image path) on
    the local stack behind emulated WAN links; print p50/p95/p99 of every term."""
    from edgefeed.lab.report import render_html
    from edgefeed.lab.run import run_lab
    from edgefeed.lab.topologies import LabOptions

    settings = settings_of(ctx)
    options = run_reported(
        lambda: LabOptions(
            requests=requests, image_requests=image_requests, warmup=warmup, region=region
        )
    )
    run_reported(lambda: settings.region(region))
    if start_stack:
        from edgefeed.devstack import DevStack

        stack = run_reported(
            lambda: DevStack(
                settings, state_dir, with_connect=False, only=["postgres", f"redis-{region}"]
            )
        )
        run_reported(stack.up)
    total = 3 * requests + 3 * image_requests
    with Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=as_json,
        transient=True,
    ) as progress:
        task = progress.add_task("starting", total=total)

        def on_progress(phase: str) -> None:
            if phase:
                progress.update(task, description=phase)
            else:
                progress.advance(task)

        result = run_reported(lambda: asyncio.run(run_lab(settings, options, on_progress)))
    report.write_text(
        render_html(
            result.ranking,
            result.images,
            ratio=result.ratio,
            notes=[
                "Links emulated by edgefeed.wan (delay per chunk, token-bucket bandwidth); "
                "PostgreSQL and Redis are the local stack's; one 2-core machine runs it all.",
            ],
        ),
        encoding="utf-8",
    )
    if as_json:
        typer.echo(json.dumps({**result.as_dict(), "report": str(report)}, indent=2))
        return
    print_result(result)
    console.print(f"report: {report}")


def register(app: typer.Typer) -> None:
    """Add ``edgefeed lab`` to the root app."""
    app.add_typer(lab_app, name="lab")
