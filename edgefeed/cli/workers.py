"""`edgefeed workers`: serve models next to a region's edge cache, and benchmark them."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from edgefeed.cli._common import (
    console,
    err_console,
    fail,
    run_reported,
    settings_at,
    settings_of,
    settings_path_of,
)

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from edgefeed.settings import EdgefeedSettings
    from workers.features import FeatureSource
    from workers.models import RankerConfig, ServedModel
    from workers.server import InferenceServer
    from workers.supervisor import ChildSlot

__all__ = ["register"]

workers_app = typer.Typer(
    name="workers",
    help="Model workers: dynamic batching on GPU or CPU, per-request latency budget.",
    no_args_is_help=True,
)

ModelOpt = Annotated[
    str,
    typer.Option("--model", "-m", help="image-classifier, ranker, or any name with --model-file."),
]
RegionOpt = Annotated[
    str,
    typer.Option(
        "--region", "-r", help="Region whose edge cache the worker reads (from the settings file)."
    ),
]


def _feature_factory(
    load_settings: Callable[[], EdgefeedSettings],
    region: str,
    registry: CollectorRegistry | None = None,
    concurrency: int = 256,
    coalesce_turns: int | None = 4,
) -> Callable[[RankerConfig], FeatureSource]:
    """Builds the ranker's feature source: the edge cache lookup client of ``region``,
    its metrics in ``registry`` (the worker's), its pool sized for ``concurrency``
    requests in flight, its lookups coalesced over ``coalesce_turns`` loop turns
    (None: not coalesced).

    The client knows the pipeline's entity schemas (from the settings file) plus
    the model's own entities when the pipeline does not declare them (the demo's).
    """

    def build(config: RankerConfig) -> FeatureSource:
        from edge_cache import AsyncFeatureClient
        from edgefeed.lookup import feature_schemas
        from workers.features import EdgeCacheFeatureSource, pool_size

        settings = load_settings()
        run_reported(lambda: settings.region(region))
        schemas = feature_schemas(settings)
        declared = {schema.entity for schema in schemas}
        schemas += [schema for schema in config.schemas() if schema.entity not in declared]
        client = run_reported(
            lambda: AsyncFeatureClient.from_settings(
                settings,
                region,
                schemas,
                registry=registry,
                max_connections=pool_size(concurrency),
            )
        )
        if coalesce_turns is None:
            return EdgeCacheFeatureSource(client, coalesce=False)
        return EdgeCacheFeatureSource(client, coalesce_turns=coalesce_turns)

    return build


def _load_model(
    load_settings: Callable[[], EdgefeedSettings],
    name: str,
    region: str,
    weights: Path | None,
    model_file: Path | None,
    kind: str,
    input_shape: str | None,
    input_dtype: str,
    labels: str | None,
    *,
    registry: CollectorRegistry | None = None,
    concurrency: int = 256,
    coalesce_turns: int | None = 4,
) -> ServedModel:
    from workers.models import load_served_model

    shape = tuple(int(part) for part in input_shape.split(",")) if input_shape else ()
    features = (
        _feature_factory(load_settings, region, registry, concurrency, coalesce_turns)
        if name == "ranker" and model_file is None
        else None
    )
    return run_reported(
        lambda: load_served_model(
            name,
            weights=weights,
            features=features,
            model_file=model_file,
            kind="classifier" if kind == "classifier" else "tensor",
            input_shape=shape,
            input_dtype=input_dtype,
            labels=labels.split(",") if labels else (),
        )
    )


def _worker_settings(**overrides: Any) -> Any:
    from pydantic import ValidationError

    from workers.exceptions import WorkerConfigError
    from workers.settings import WorkerSettings

    given = {key: value for key, value in overrides.items() if value is not None}
    try:
        return WorkerSettings(**given)
    except ValidationError as exc:
        # Echo a bad value only for a named field that holds no secret.
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
            + (
                f" (got {e.get('input')!r})"
                if e["loc"] and not any("token" in str(part) for part in e["loc"])
                else ""
            )
            for e in exc.errors()
        )
        fail(WorkerConfigError(f"invalid worker option: {problems}"))


@workers_app.command("serve")
def serve(
    ctx: typer.Context,
    model: ModelOpt,
    region: RegionOpt,
    host: Annotated[str | None, typer.Option(help="Interface to bind.")] = None,
    port: Annotated[int | None, typer.Option(help="TCP port (0: any free one).")] = None,
    device: Annotated[str | None, typer.Option(help="auto, cpu, cuda, cuda:N.")] = None,
    precision: Annotated[
        str | None,
        typer.Option(help="auto (fp16 on CUDA, fp32 on CPU), fp32, fp16, bf16, int8 (CPU)."),
    ] = None,
    max_batch_size: Annotated[int | None, typer.Option(help="Rows per forward pass.")] = None,
    preferred_batch_size: Annotated[
        list[int] | None, typer.Option(help="Batch size sent as soon as available (repeatable).")
    ] = None,
    max_queue_delay_ms: Annotated[
        float | None, typer.Option(help="Longest wait for a batch to fill.")
    ] = None,
    max_queue_size: Annotated[int | None, typer.Option(help="Queued requests before 429.")] = None,
    deadline_ms: Annotated[
        float | None,
        typer.Option(help="Default per-request budget (requests may send X-Edgefeed-Deadline-Ms)."),
    ] = None,
    weights: Annotated[
        Path | None, typer.Option(help="Checkpoint or state_dict replacing the demo weights.")
    ] = None,
    model_file: Annotated[
        Path | None, typer.Option(help="Your own torch.export (.pt2) or TorchScript module.")
    ] = None,
    kind: Annotated[str, typer.Option(help="For --model-file: classifier or tensor.")] = "tensor",
    input_shape: Annotated[
        str | None, typer.Option(help="For --model-file: per-row input shape, e.g. 32,32,3.")
    ] = None,
    input_dtype: Annotated[str, typer.Option(help="For --model-file: input dtype.")] = "float32",
    labels: Annotated[str | None, typer.Option(help="Classifier labels, comma-separated.")] = None,
    auth_token_file: Annotated[
        Path | None,
        typer.Option(
            help="File holding the bearer token every request but /healthz and /readyz must "
            "send (or set EDGEFEED_WORKERS_AUTH_TOKEN; never on the command line)."
        ),
    ] = None,
    tls_cert: Annotated[
        Path | None, typer.Option(help="PEM certificate chain: serve HTTPS (with --tls-key).")
    ] = None,
    tls_key: Annotated[Path | None, typer.Option(help="PEM private key of --tls-cert.")] = None,
    event_loop: Annotated[
        str | None, typer.Option(help="auto (uvloop when installed), uvloop or asyncio.")
    ] = None,
    coalesce_turns: Annotated[
        int | None,
        typer.Option(
            min=0,
            max=64,
            help="Event loop turns the ranker's feature lookups wait to share one lookup "
            "(default 4; EDGEFEED_WORKERS_COALESCE_LOOKUPS=false turns it off).",
        ),
    ] = None,
    processes: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Worker processes on the port, each with its own model and batcher, under "
            "one supervisor (default: one per core available; 1: one process, no supervisor).",
        ),
    ] = None,
    sched_slice_us: Annotated[
        float | None,
        typer.Option(
            help="Scheduler time slice the worker's threads ask for, so the event loop runs "
            "soon after each wait on a busy node (default 100; Linux 6.12+; 0: the kernel's).",
        ),
    ] = None,
) -> None:
    """Serve one model over HTTP until SIGINT/SIGTERM, then drain."""
    from prometheus_client import CollectorRegistry

    from workers.server import InferenceServer, event_loop_name, run_on_loop, run_server

    settings = _worker_settings(
        host=host,
        port=port,
        device=device,
        precision=precision,
        max_batch_size=max_batch_size,
        preferred_batch_sizes=tuple(preferred_batch_size) if preferred_batch_size else None,
        max_queue_delay_ms=max_queue_delay_ms,
        max_queue_size=max_queue_size,
        default_deadline_ms=deadline_ms,
        auth_token_file=auth_token_file,
        tls_cert_file=tls_cert,
        tls_key_file=tls_key,
        event_loop=event_loop,
        coalesce_turns=coalesce_turns,
        processes=processes,
        sched_slice_us=sched_slice_us,
    )
    count = run_reported(settings.process_count)
    # Before the model loads and children start: their threads inherit it.
    scheduling = settings.apply_sched_slice()
    # the composition root: one registry for the worker's and its lookup client's metrics
    registry = CollectorRegistry()
    served = _load_model(
        lambda: settings_of(ctx),
        model,
        region,
        weights,
        model_file,
        kind,
        input_shape,
        input_dtype,
        labels,
        registry=registry,
        concurrency=settings.max_queue_size,
        coalesce_turns=settings.coalesce_turns if settings.coalesce_lookups else None,
    )
    rows = served.default_max_batch_size
    feature_log = _feature_log(settings_path_of(ctx), served)
    server = run_reported(
        lambda: InferenceServer(
            [served],
            runtime=settings.runtime(rows),
            batching=settings.batching(rows),
            config=settings.server(region),
            registry=registry,
            feature_log=feature_log,
        )
    )
    security = ", ".join(
        what
        for what, on in (
            ("bearer token", server.config.auth_token is not None),
            ("TLS", server.config.tls_cert_file is not None),
        )
        if on
    )
    if feature_log is not None:  # said at start: where the served values go
        logged = f"feature log {feature_log.dir / region} at {feature_log.sample_rate:.0%}"
        security = f"{security}, {logged}" if security else logged

    loop_name = run_reported(lambda: event_loop_name(settings.event_loop))
    if count > 1:
        # Everything a child would refuse is refused here first (model, settings, token,
        # TLS files, device and precision), with the one-process path's messages.
        _check_device(settings)
        spec = _ChildSpec(
            settings_path_of(ctx),
            settings,
            (model, region, weights, model_file, kind, input_shape, input_dtype, labels),
        )
        del server, served
        threads = settings.for_child(count).cpu_threads or 1
        described = (
            f"{count} processes, {threads} torch thread{'s' * (threads > 1)} each; "
            f"{rows} rows per batch; event loop {loop_name}; {scheduling}"
        )
        _serve_supervised(spec, count, model, region, described, security)
        return

    def announce(running: InferenceServer) -> None:
        err_console.print(
            f"serving {model!r} for region {region!r} at {running.url} "
            f"(warm-up ms per batch size: {running.warmup_ms[model]}; "
            f"{running.batching.max_batch_size} rows per batch; event loop {loop_name}; "
            f"{scheduling}{'; ' + security if security else ''})",
            soft_wrap=True,
        )

    run_reported(lambda: run_on_loop(run_server(server, announce), settings.event_loop))


def _feature_log(path: Path | None, served: ServedModel) -> Any:
    """``workers.feature_log`` of the settings file for ``served`` (None: a model that
    reads no features, no file, or no log)."""
    from edgefeed.settings import resolve_settings_path

    if served.log_layout() is None:  # nothing to log: the file is not needed
        return None
    if not resolve_settings_path(path).exists():
        return None
    return settings_at(path).workers.feature_log


def _check_device(settings: Any) -> None:
    from workers.runtime import resolve_device, resolve_precision

    run_reported(lambda: resolve_precision(settings.precision, resolve_device(settings.device)))


@dataclass(frozen=True, slots=True)
class _ChildSpec:
    """What a worker process of a supervisor needs to build its server (picklable)."""

    settings_path: Path | None
    settings: Any  # WorkerSettings
    model_args: tuple[Any, ...]  # _load_model's positional arguments after the settings


def _serve_child(spec: _ChildSpec, slot: ChildSlot) -> int:
    """One child of ``edgefeed workers serve --processes N``: serve until SIGTERM."""
    import dataclasses

    from prometheus_client import CollectorRegistry

    from edgefeed.errors import EdgefeedError
    from workers.server import InferenceServer, run_on_loop, run_server
    from workers.supervisor import Cluster

    settings = spec.settings.for_child(slot.processes)
    registry = CollectorRegistry()
    try:
        served = _load_model(
            lambda: settings_at(spec.settings_path),
            *spec.model_args,
            registry=registry,
            concurrency=settings.max_queue_size,
            coalesce_turns=settings.coalesce_turns if settings.coalesce_lookups else None,
        )
        rows = served.default_max_batch_size
        config = dataclasses.replace(
            settings.server(spec.model_args[1]), port=slot.port, reuse_port=True
        )
        server = InferenceServer(
            [served],
            runtime=settings.runtime(rows),
            batching=settings.batching(rows),
            config=config,
            registry=registry,
            cluster=Cluster(slot),
            feature_log=_feature_log(spec.settings_path, served),
        )
        run_on_loop(run_server(server), settings.event_loop)
    except typer.Exit as exc:  # run_reported printed the error
        slot.report(RuntimeError(f"exit status {exc.exit_code}; its error is printed above"))
        return exc.exit_code
    except EdgefeedError as exc:
        slot.report(exc)
        fail(exc)
    return 0


def _serve_supervised(
    spec: _ChildSpec, count: int, model: str, region: str, described: str, security: str
) -> None:
    from functools import partial

    from workers.supervisor import Supervisor

    settings = spec.settings
    scheme = "http" if settings.tls_cert_file is None else "https"
    supervisor = Supervisor(
        partial(_serve_child, spec),
        processes=count,
        host=settings.host,
        port=settings.port,
        drain_timeout_s=settings.drain_timeout_s,
    )

    def announce(running: Supervisor) -> None:
        err_console.print(
            f"serving {model!r} for region {region!r} at {scheme}://{settings.host}:"
            f"{running.port} ({described}; pids {', '.join(map(str, running.pids()))}"
            f"{'; ' + security if security else ''})",
            soft_wrap=True,
        )

    run_reported(lambda: supervisor.run(announce))


def print_bench(summary: dict[str, Any], title: str) -> None:
    table = Table(title=title)
    table.add_column("term")
    for q in ("p50", "p95", "p99"):
        table.add_column(f"{q} ms", justify="right")
    names = {
        "network": "T_network",
        "data": "T_data",
        "model": "T_model",
        "service": "T_service",
        "total": "T_total",
    }
    for term, name in names.items():
        row = summary["latency_ms"][term]
        table.add_row(name, *(f"{row[q]:.2f}" for q in ("p50", "p95", "p99")))
    console.print(table)
    console.print(
        f"throughput {summary['throughput_rps']:.1f} req/s, "
        f"{summary['requests']} requests, concurrency {summary['concurrency']}, "
        f"mean batch {summary['mean_batch_rows']} rows, errors {summary['errors']}"
    )


async def _bench(
    url: str,
    model: str,
    concurrency: int,
    requests: int,
    deadline_ms: float | None,
    items: int,
    token: Any = None,
    ca_file: Path | None = None,
) -> dict[str, Any]:
    from workers.bench import closed_loop
    from workers.client import InferenceAnswer, WorkerClient
    from workers.synthetic import click_world, shape_images

    async with WorkerClient(url, token=token, ca_file=ca_file) as client:
        info = await client.models()
        described = {entry["name"]: entry for entry in info["models"]}
        if model not in described:
            from workers.exceptions import UnknownModelError

            raise UnknownModelError(
                f"model {model!r} is not served at {url}; served: {', '.join(described)}"
            )
        entry = described[model]
        if "features" in entry:
            world = click_world()

            async def send(c: WorkerClient, n: int) -> InferenceAnswer:
                user = world.user_ids[n % len(world.user_ids)]
                start = (n * 7) % (len(world.item_ids) - items)
                return await c.rank(
                    model, user, world.item_ids[start : start + items], deadline_ms=deadline_ms
                )
        else:
            shape = entry["input"]["shape"][1:]
            if entry["input"]["dtype"] == "uint8" and len(shape) == 3:
                pool, _ = shape_images(64, int(shape[0]), seed=7)
            else:
                import numpy as np

                pool = (
                    np.random.default_rng(7)
                    .normal(size=(64, *shape))
                    .astype(entry["input"]["dtype"])
                )

            async def send(c: WorkerClient, n: int) -> InferenceAnswer:
                return await c.classify(model, pool[n % len(pool)], deadline_ms=deadline_ms)

        result = await closed_loop(
            client, send, concurrency=concurrency, requests=requests, warmup_requests=concurrency
        )
    return result.summary()


async def _bench_local(
    served: ServedModel, settings: Any, region: str, **kwargs: Any
) -> dict[str, Any]:
    from workers.server import InferenceServer

    rows = served.default_max_batch_size
    async with InferenceServer(
        [served],
        runtime=settings.runtime(rows),
        batching=settings.batching(rows),
        config=settings.server(region),
    ) as server:
        return await _bench(server.url, served.name, **kwargs)


@workers_app.command("bench")
def bench(
    ctx: typer.Context,
    model: ModelOpt = "image-classifier",
    region: Annotated[
        str, typer.Option("--region", "-r", help="Region (label; the ranker reads its edge cache).")
    ] = "local",
    url: Annotated[
        str | None,
        typer.Option(help="Benchmark a running worker; without it one is started in this process."),
    ] = None,
    concurrency: Annotated[int, typer.Option(min=1, help="Closed-loop clients.")] = 16,
    requests: Annotated[int, typer.Option(min=1, help="Measured requests.")] = 400,
    deadline_ms: Annotated[float | None, typer.Option(help="Budget sent per request.")] = None,
    items: Annotated[int, typer.Option(min=1, help="Candidates per ranking request.")] = 20,
    max_batch_size: Annotated[int | None, typer.Option(help="For the local worker.")] = None,
    precision: Annotated[str | None, typer.Option(help="For the local worker.")] = None,
    auth_token_file: Annotated[
        Path | None,
        typer.Option(
            help="With --url: file holding the worker's bearer token "
            "(or set EDGEFEED_WORKERS_AUTH_TOKEN)."
        ),
    ] = None,
    ca_file: Annotated[
        Path | None,
        typer.Option(help="With an https --url: PEM certificate or CA to trust (self-signed)."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Closed-loop load; print T_network, T_data, T_model, T_service and T_total (p50/p95/p99)."""
    kwargs: dict[str, Any] = {
        "concurrency": concurrency,
        "requests": requests,
        "deadline_ms": deadline_ms,
        "items": items,
    }
    if url is not None:
        import aiohttp

        client_settings = _worker_settings(auth_token_file=auth_token_file)
        token = run_reported(client_settings.token)
        try:
            summary = run_reported(
                lambda: asyncio.run(_bench(url, model, token=token, ca_file=ca_file, **kwargs))
            )
        except aiohttp.ClientError as exc:
            err_console.print(f"[bold red]error:[/] worker at {url} unreachable: {exc}")
            raise typer.Exit(1) from None
    else:
        settings = _worker_settings(port=0, max_batch_size=max_batch_size, precision=precision)
        served = _load_model(
            lambda: settings_of(ctx), model, region, None, None, "tensor", None, "float32", None
        )
        summary = run_reported(
            lambda: asyncio.run(_bench_local(served, settings, region, **kwargs))
        )
    if as_json:
        typer.echo(json.dumps(summary))
    else:
        print_bench(summary, f"{model} latency budget ({url or 'in-process worker'})")


@workers_app.command("seed-demo")
def seed_demo(ctx: typer.Context, region: RegionOpt) -> None:
    """Write the demo ranker's users and items into the region's edge cache (edge_cache writer)."""
    from redis.exceptions import RedisError

    from edge_cache import AsyncFeatureWriter, EdgeCacheError, Position, Upsert
    from workers.models import RankerConfig
    from workers.synthetic import click_world

    settings = settings_of(ctx)
    region_settings = run_reported(lambda: settings.region(region))
    world, config = click_world(), RankerConfig()

    async def write() -> None:
        writer = AsyncFeatureWriter.from_region(region_settings, config.schemas())
        try:
            await writer.publish_schemas()
            now = time.time()
            ops = [
                Upsert(
                    entity,
                    entity_id,
                    dict(zip(names, map(float, vector), strict=True)),
                    Position(1),
                    now,
                )
                for entity, names, ids, vectors in (
                    (config.user_entity, config.user_features, world.user_ids, world.user_features),
                    (config.item_entity, config.item_features, world.item_ids, world.item_features),
                )
                for entity_id, vector in zip(ids, vectors, strict=True)
            ]
            await writer.write(ops)
        finally:
            await writer.client.aclose()

    try:
        asyncio.run(write())
    except EdgeCacheError as exc:
        fail(exc)
    except (OSError, RedisError) as exc:
        err_console.print(f"[bold red]error:[/] region {region!r} edge cache unreachable: {exc}")
        raise typer.Exit(1) from None
    console.print(
        f"wrote {len(world.user_ids)} {config.user_entity} and {len(world.item_ids)} "
        f"{config.item_entity} vectors to region {region!r}"
    )


def register(app: typer.Typer) -> None:
    """Add the workers commands to the root app."""
    app.add_typer(workers_app)
