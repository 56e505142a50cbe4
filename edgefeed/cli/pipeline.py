"""``edgefeed pipeline``: run the router or a region's feature worker (Faust workers)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from edgefeed.cli._common import (
    EXIT_USAGE,
    console,
    err_console,
    fail,
    run_reported,
    settings_of,
)

if TYPE_CHECKING:
    from edgefeed.settings import EdgefeedSettings
    from monitoring.endpoint import EndpointSecurity
    from pipeline.app import HistorySource

__all__ = ["register"]

pipeline_app = typer.Typer(
    help="The Faust pipeline: router and regional feature workers.", no_args_is_help=True
)


@pipeline_app.command("run")
def run(
    ctx: typer.Context,
    role: Annotated[
        str | None,
        typer.Option(help="'router', or 'forwarder' (with --region: its sites forwarder)."),
    ] = None,
    region: Annotated[str | None, typer.Option(help="Run this region's feature worker.")] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            help="Serve Prometheus metrics (/metrics) and the probes /healthz and /readyz "
            "on this port (0: any free one)."
        ),
    ] = None,
    metrics_host: Annotated[
        str | None,
        typer.Option(
            help="Address of --metrics-port (0.0.0.0 or the pod's IP for Prometheus and "
            "the kubelet in Kubernetes).",
            show_default="127.0.0.1",
        ),
    ] = None,
    metrics_token_file: Annotated[
        Path | None,
        typer.Option(
            help="File holding the bearer token /metrics requires (the probes need none)."
        ),
    ] = None,
    metrics_tls_cert: Annotated[
        Path | None,
        typer.Option(help="PEM certificate chain: serve --metrics-port over HTTPS only."),
    ] = None,
    metrics_tls_key: Annotated[
        Path | None, typer.Option(help="PEM private key of --metrics-tls-cert.")
    ] = None,
    loglevel: Annotated[str, typer.Option(help="Log level.")] = "info",
    from_beginning: Annotated[
        bool,
        typer.Option(
            "--from-beginning",
            help="Forwarder only: forward the region's whole central topic again "
            "(rebuilding a lost site).",
        ),
    ] = False,
) -> None:
    """Start a worker: `--role router`, `--region NAME`, or `--role forwarder --region NAME`.

    With `--metrics-port`: Prometheus metrics on /metrics (behind the token of
    `--metrics-token-file`), and, without a token, /healthz (200 while the
    process runs) and /readyz (200 when ready, else 503 with the reason).
    """
    endpoint = _endpoint_options(
        metrics_port, metrics_host, metrics_token_file, metrics_tls_cert, metrics_tls_key
    )
    if role == "forwarder":
        if region is None:
            err_console.print("error: --role forwarder needs --region NAME")
            raise typer.Exit(EXIT_USAGE)
        _run_forwarder(ctx, region, loglevel, from_beginning, endpoint)
        return
    if from_beginning:
        err_console.print("error: --from-beginning is for --role forwarder only")
        raise typer.Exit(EXIT_USAGE)
    if (role is None) == (region is None) or (role is not None and role != "router"):
        err_console.print(
            "error: give exactly one of --role router or --region NAME "
            "(or --role forwarder --region NAME)"
        )
        raise typer.Exit(EXIT_USAGE)
    from edgefeed.pipeline_config import pipeline_config  # imports the Faust app

    settings = settings_of(ctx)
    if region is not None:
        region_settings = run_reported(lambda: settings.region(region))
        # A regional worker writes its cache as the writer user: its password now, so a
        # missing secret is one line naming the setting, not a crash inside Faust after
        # joining the group. It never reads the database (a region's pod mounts no
        # database secret and may not reach it): the router checks the feature columns.
        run_reported(lambda: region_settings.redis_options("writer"))
    config = run_reported(
        lambda: pipeline_config(settings, check_database=region is None, region=region)
    )

    import faust  # heavy: only when a worker starts
    from prometheus_client import REGISTRY

    from pipeline.app import build_region_app, build_router_app
    from pipeline.metrics import PipelineMetrics
    from pipeline.probes import Readiness, RegionReadiness
    from pipeline.topics import ensure_topics_sync

    # The composition root owns the registry: the one its metrics endpoint serves.
    metrics = PipelineMetrics.create(REGISTRY)
    # Readiness is followed only when a probe can ask for it.
    router_ready: Readiness | None = None
    region_ready: RegionReadiness | None = None
    if endpoint is not None:
        if role == "router":
            router_ready = Readiness("starting: creating topics, then joining the group")
            probe = router_ready.check
        else:
            region_ready = RegionReadiness(settings.pipeline.ready_max_behind_s)
            probe = region_ready.check
        # Up before the topics are checked (that waits for the broker): the kubelet's
        # liveness probe gets its answer while the worker starts.
        _serve(endpoint, probe)

    names = settings.pipeline.names
    if role == "router":
        topics = {
            settings.pipeline.region_topic(r): settings.pipeline.partitions
            for r in settings.region_names
        }
        for dead_letters in names.dead_letter_topics(settings.region_names):
            topics[dead_letters] = 1
        for source in settings.sources:
            for table in source.tables:
                topics[source.topic_for(table.name)] = source.partitions
        topics[names.history_topic] = 1
    else:
        # On the region's own broker (the central one without sites): its change
        # topic (the forwarder fills it) and its dead letters.
        topics = {settings.pipeline.region_topic(region or ""): settings.pipeline.partitions}
        topics[names.region_dead_letter_topic(region or "")] = 1
        if settings.sites.bootstrap_of(region or "") is None:
            topics[names.dead_letter_topic] = 1
    # A broker that cannot be reached: one message naming it, not a traceback.
    run_reported(
        lambda: ensure_topics_sync(
            config.kafka.bootstrap_servers,
            topics,
            replication_factor=settings.pipeline.replication_factor,
            client_options=settings.kafka.security.aiokafka_options(),
        )
    )
    app = (
        build_router_app(config, metrics, _history_source(settings), router_ready)
        if role == "router"
        else build_region_app(config, region or "", metrics, region_ready)
    )
    worker = faust.Worker(app, loglevel=loglevel, quiet=True)
    worker.execute_from_commandline()


@dataclass(frozen=True, slots=True)
class _Endpoint:
    """Where and how ``--metrics-port`` serves (checked before anything starts)."""

    host: str
    port: int
    security: EndpointSecurity


def _endpoint_options(
    port: int | None,
    host: str | None,
    token_file: Path | None,
    certfile: Path | None,
    keyfile: Path | None,
) -> _Endpoint | None:
    """The ``--metrics-*`` options, checked at once: a bad one exits 2 naming it.

    A non-loopback address without a token is allowed with a warning, as for
    ``edgefeed exporter`` (a pod's metrics are often scraped over the pod network
    without one); the token file's content is never shown.
    """
    given = [
        name
        for name, value in (
            ("--metrics-host", host),
            ("--metrics-token-file", token_file),
            ("--metrics-tls-cert", certfile),
            ("--metrics-tls-key", keyfile),
        )
        if value is not None
    ]
    if port is None:
        if given:
            err_console.print(
                f"error: {', '.join(given)} configure the metrics endpoint: "
                "give --metrics-port PORT too"
            )
            raise typer.Exit(EXIT_USAGE)
        return None
    if not 0 <= port <= 65535:
        err_console.print(f"error: --metrics-port {port} is not a port: give 0..65535")
        raise typer.Exit(EXIT_USAGE)
    from monitoring.endpoint import EndpointSecurity, is_loopback

    security = run_reported(
        lambda: EndpointSecurity.load(
            token_file=token_file, certfile=certfile, keyfile=keyfile, flag_prefix="--metrics-"
        )
    )
    run_reported(security.ssl_context)  # a bad certificate fails now, not after the topics
    host = host or "127.0.0.1"
    if not is_loopback(host) and security.token is None:
        err_console.print(
            f"warning: the metrics endpoint listens on {host} without a bearer token: "
            "anyone who can reach it can read the metrics (give --metrics-token-file, "
            "or keep --metrics-host 127.0.0.1 behind a proxy)",
            highlight=False,
        )
    return _Endpoint(host, port, security)


def _alive() -> tuple[bool, str]:
    # Answered by the endpoint's own thread: the process is up, whatever its loop does.
    return True, "alive"


def _serve(endpoint: _Endpoint, ready: Callable[[], tuple[bool, str]]) -> None:
    """Start the metrics endpoint with the probes (a daemon thread, for the process's life)."""
    from prometheus_client import REGISTRY

    from monitoring.endpoint import start_endpoint

    server, _thread = run_reported(
        lambda: start_endpoint(
            REGISTRY,
            host=endpoint.host,
            port=endpoint.port,
            security=endpoint.security,
            probes={"/healthz": _alive, "/readyz": ready},
            flag_prefix="--metrics-",
        )
    )
    scheme = "https" if endpoint.security.tls else "http"
    auth = " (bearer token required)" if endpoint.security.token is not None else ""
    console.print(
        f"serving metrics on {scheme}://{endpoint.host}:{server.server_address[1]}/metrics"
        f"{auth}; probes /healthz, /readyz",
        highlight=False,
    )


def _history_source(settings: EdgefeedSettings) -> HistorySource:
    """The router's view of the source for its history check (pipeline.history)."""
    from connectors.client import ConnectClient
    from connectors.snapshot import snapshot_paced
    from pipeline.app import HistorySource
    from pipeline.history import HistoryNeed, SourceRows, source_rows

    def rows(need: HistoryNeed, cutoff_ms: int, homes: Sequence[str] | None) -> SourceRows:
        return source_rows(settings.database, need, cutoff_ms, homes)

    def snapshot(table: str, filter_sql: str | None) -> str:
        with ConnectClient(
            settings.connect.url,
            timeout_s=settings.connect.timeout_s,
            secrets=settings.database.secrets(),
        ) as client:
            _, reports = snapshot_paced(
                client,
                settings.database,
                settings.sources,
                [(table, filter_sql)],
                settings.kafka.bootstrap_servers,
                client_options=settings.kafka.security.aiokafka_options(),
            )
        return reports[0].state if reports else "ABORTED"

    return HistorySource(rows, snapshot)


FORWARDER_READY = "forwarder ready"


def _run_forwarder(
    ctx: typer.Context,
    region: str,
    loglevel: str,
    from_beginning: bool,
    endpoint: _Endpoint | None = None,
) -> None:
    import logging
    import signal

    from edgefeed.settings import SettingsError
    from pipeline.forward import Forwarder, ForwardSpec
    from pipeline.probes import Readiness
    from pipeline.topics import ensure_topics

    settings = settings_of(ctx)
    run_reported(lambda: settings.region(region))
    target = settings.sites.bootstrap_of(region)
    if target is None:
        fail(
            SettingsError(
                f"region {region!r} shares the central broker: a forwarder runs only for "
                "regions with a site of their own (name it under sites.regions)"
            )
        )
    logging.basicConfig(
        level=loglevel.upper(), format="[%(asctime)s] [%(process)d] %(levelname)s %(message)s"
    )
    compression = settings.sites.compression
    names, pipeline = settings.pipeline.names, settings.pipeline
    forwarder = Forwarder(
        ForwardSpec(
            region=region,
            topic=names.region_topic(region),
            partitions=pipeline.partitions,
            dead_letter_topic=names.region_dead_letter_topic(region),
            group=names.forward_group(region),
            source=settings.kafka.bootstrap_servers,
            target=target,
            address_map=settings.sites.remote_address_map(region),
            compression=None if compression == "none" else compression,
            batch_max=pipeline.batch_max,
            linger_ms=settings.kafka.linger_ms,
            fetch_max_wait_ms=settings.kafka.fetch_max_wait_ms,
            client_id=settings.kafka.client_id,
            request_timeout_ms=settings.sites.request_timeout_ms,
            max_in_flight=settings.sites.forward_max_in_flight,
            from_beginning=from_beginning,
            kafka_options=settings.kafka.security.aiokafka_options(),
        )
    )
    log = logging.getLogger("edgefeed.forward")
    readiness = Readiness("starting: creating topics, then connecting to both brokers")
    if endpoint is not None:
        _serve(endpoint, readiness.check)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, forwarder.stop)
        await ensure_topics(
            settings.kafka.bootstrap_servers,
            forwarder.topics,
            replication_factor=pipeline.replication_factor,
            client_options=settings.kafka.security.aiokafka_options(),
        )
        await forwarder.retrying(forwarder.ensure_target_topic, "create its topic there")
        ready = asyncio.Event()
        task = asyncio.create_task(forwarder.run(ready=ready))
        await ready.wait()
        log.info("%s: region %s, %s", FORWARDER_READY, region, ", ".join(target))
        readiness.set(True, f"ready: forwarding region {region}")
        while not task.done():
            await asyncio.wait([task], timeout=10)
            stats = forwarder.stats
            timings = ", ".join(f"{k} {v:.0f}" for k, v in stats.timings().items())
            log.info(
                "region %s: %d records in %d batches forwarded, %d retries; "
                "recent batches (ms, records): %s",
                region,
                stats.records,
                stats.batches,
                stats.retries,
                timings or "none",
            )
        readiness.set(False, "stopping")
        await task

    asyncio.run(main())


EXIT_MISMATCH = 3


def parse_read_time(text: str) -> float:
    """``--at``: ISO 8601 with a zone, or seconds since the epoch.

    Raises:
        ValueError: neither (the message names the value and the accepted forms).
    """
    from datetime import datetime

    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        moment = None
    if moment is None or moment.tzinfo is None:
        raise ValueError(
            f"--at {text!r} is not a time: give ISO 8601 with a zone "
            "(2026-12-03T10:00:00+00:00) or seconds since the epoch"
        )
    return moment.timestamp()


@pipeline_app.command("verify")
def verify_command(
    ctx: typer.Context,
    region: Annotated[
        list[str] | None, typer.Option(help="Only this region (repeatable); default all.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    show: Annotated[int, typer.Option(help="Differences listed at most.")] = 20,
    at: Annotated[
        str | None,
        typer.Option(
            help="Read windows as of this time (ISO 8601 with a zone, or seconds since the "
            "epoch; default: now). Within the schedules the caches hold."
        ),
    ] = None,
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
    try:
        read_at = None if at is None else parse_read_time(at)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--at") from None
    report = run_reported(lambda: verify(settings, region or None, read_at))
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
