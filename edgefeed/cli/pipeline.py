"""``edgefeed pipeline``: run the router or a region's feature worker (Faust workers)."""

from __future__ import annotations

import asyncio
from typing import Annotated

import typer

from edgefeed.cli._common import EXIT_USAGE, console, err_console, run_reported, settings_of

__all__ = ["register"]

pipeline_app = typer.Typer(
    help="The Faust pipeline: router and regional feature workers.", no_args_is_help=True
)


@pipeline_app.command("run")
def run(
    ctx: typer.Context,
    role: Annotated[str | None, typer.Option(help="'router' to run the router.")] = None,
    region: Annotated[str | None, typer.Option(help="Run this region's feature worker.")] = None,
    metrics_port: Annotated[
        int | None, typer.Option(help="Serve Prometheus metrics on this port.")
    ] = None,
    loglevel: Annotated[str, typer.Option(help="Log level.")] = "info",
) -> None:
    """Start a Faust worker: `--role router`, or `--region NAME`."""
    if (role is None) == (region is None) or (role is not None and role != "router"):
        err_console.print("error: give exactly one of --role router or --region NAME")
        raise typer.Exit(EXIT_USAGE)
    from edgefeed.pipeline_config import pipeline_config  # imports the Faust app

    settings = settings_of(ctx)
    config = run_reported(lambda: pipeline_config(settings))
    if region is not None:
        run_reported(lambda: settings.region(region))

    import faust  # heavy: only when a worker starts

    from pipeline.app import build_region_app, build_router_app
    from pipeline.topics import ensure_topics

    topics = {
        settings.pipeline.region_topic(r): settings.pipeline.partitions
        for r in settings.region_names
    }
    for dead_letters in settings.pipeline.names.dead_letter_topics(settings.region_names):
        topics[dead_letters] = 1
    if role == "router":
        for source in settings.sources:
            for table in source.tables:
                topics[source.topic_for(table.name)] = source.partitions
    asyncio.run(
        ensure_topics(
            settings.kafka.bootstrap_servers,
            topics,
            replication_factor=settings.pipeline.replication_factor,
            client_options=settings.kafka.security.aiokafka_options(),
        )
    )
    from prometheus_client import REGISTRY, start_http_server

    from pipeline.metrics import PipelineMetrics

    # The composition root owns the registry: the one its metrics endpoint serves.
    metrics = PipelineMetrics.create(REGISTRY)
    if metrics_port is not None:
        start_http_server(metrics_port, addr="127.0.0.1", registry=REGISTRY)
    app = (
        build_router_app(config, metrics)
        if role == "router"
        else build_region_app(config, region or "", metrics)
    )
    worker = faust.Worker(app, loglevel=loglevel, quiet=True)
    worker.execute_from_commandline()


EXIT_MISMATCH = 3


@pipeline_app.command("verify")
def verify_command(
    ctx: typer.Context,
    region: Annotated[
        list[str] | None, typer.Option(help="Only this region (repeatable); default all.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    show: Annotated[int, typer.Option(help="Differences listed at most.")] = 20,
) -> None:
    """Compare every region's cache with a recomputation from the source tables.

    Exit 0: every vector equals the recomputation; 3: differences (listed).
    """
    import json

    from edgefeed.verify import verify

    settings = settings_of(ctx)
    if region:
        for name in region:
            run_reported(lambda name=name: settings.region(name))  # type: ignore[misc]
    report = run_reported(lambda: verify(settings, region or None))
    if as_json:
        print(json.dumps(report.to_dict(), default=str))
    else:
        for name, count in report.checked.items():
            wrong = sum(1 for m in report.mismatches if m.region == name)
            console.print(f"{name}: {count} vectors checked, {wrong} differ")
        for m in report.mismatches[:show]:
            console.print(
                f"  {m.region} {m.entity}:{m.entity_id} {m.what}"
                + (f" expected {m.expected!r} found {m.found!r}" if m.expected or m.found else "")
            )
        if report.unverifiable:
            console.print(
                "not verifiable (aggregates over tables without time_columns): "
                + ", ".join(report.unverifiable)
            )
    if not report.ok:
        raise typer.Exit(EXIT_MISMATCH)


def register(app: typer.Typer) -> None:
    """Add ``edgefeed pipeline`` to the root app."""
    app.add_typer(pipeline_app, name="pipeline")
