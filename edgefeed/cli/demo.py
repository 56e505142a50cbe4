"""``edgefeed demo``: the end-to-end demonstration on the local stack (``make demo``)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from edgefeed.cli._common import EXIT_ERROR, console, run_reported, settings_of
from edgefeed.cli._demostack import free_port, start_exporter
from edgefeed.cli.demo_sites import sites_demo
from edgefeed.cli.dev import print_status
from edgefeed.cli.workers import print_bench

if TYPE_CHECKING:
    from edgefeed.settings import EdgefeedSettings
    from edgefeed.shopload import LoadProgress, ShopLoad

__all__ = ["register"]

demo_app = typer.Typer(help="The end-to-end demo on the local stack.", no_args_is_help=True)
StateDir = Annotated[
    Path, typer.Option("--state-dir", envvar="EDGEFEED_STATE_DIR", help="Local stack state.")
]
SHOWN = {
    "user": ["segment", "views_30m", "clicks_30m", "distinct_items_1h", "top_categories_1h.1"],
    "item": ["price", "category_id", "views_1h", "purchases_1h"],
}


def _progress_printer() -> Any:
    """A live progress line on a terminal; a line every 5 s otherwise (CI logs)."""
    tty = sys.stderr.isatty()
    last = [-5.0]

    def show(progress: LoadProgress) -> None:
        line = (
            f"  load: {progress.elapsed_s:5.1f}s  {progress.changes:7d} changes  "
            f"{progress.rate:7.0f}/s  behind {progress.behind}"
        )
        if tty:
            sys.stderr.write("\r" + line)
        elif progress.elapsed_s - last[0] >= 5.0:
            last[0] = progress.elapsed_s
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    return show


def _load(
    settings: EdgefeedSettings, rate: float, duration: float, users: int, items: int
) -> LoadProgress:
    from edgefeed.shopload import ShopLoad

    load = ShopLoad(settings.database.dsn(), settings.region_names, users=users, items=items)
    load.seed_rows()
    result = load.run(rate, duration, on_progress=_progress_printer())
    if sys.stderr.isatty():
        sys.stderr.write("\n")
    return result


@demo_app.command("load")
def load_cmd(
    ctx: typer.Context,
    rate: Annotated[float, typer.Option(help="Changes per second.")] = 200.0,
    duration: Annotated[float, typer.Option(help="Seconds to run.")] = 30.0,
    users: Annotated[int, typer.Option(help="Number of users.")] = 300,
    items: Annotated[int, typer.Option(help="Number of items.")] = 100,
) -> None:
    """Write demo shop traffic (events, price and segment updates) into PostgreSQL."""
    from edgefeed.shopload import apply_schema

    settings = settings_of(ctx)
    run_reported(lambda: apply_schema(settings.database.dsn()))
    result = run_reported(lambda: _load(settings, rate, duration, users, items))
    console.print(
        f"wrote {result.changes} changes in {result.elapsed_s:.1f}s ({result.rate:.0f}/s)"
    )


def _sample_table(settings: EdgefeedSettings, load: ShopLoad) -> Table:
    from edgefeed.lookup import feature_client

    table = Table(title="feature vectors in each region's cache")
    table.add_column("entity")
    table.add_column("home")
    for region in settings.region_names:
        table.add_column(region)
    samples: list[tuple[str, int, str]] = [
        ("user", user, load.home_region(user)) for user in range(1, len(settings.regions) + 1)
    ]
    samples += [("item", 1, "shared"), ("item", 2, "shared")]
    clients = {r: feature_client(settings, r, timeout_s=2) for r in settings.region_names}
    try:
        for entity, entity_id, home in samples:
            cells = []
            for client in clients.values():
                result = client.get(entity, [entity_id], features=SHOWN[entity])
                if not result.found[0]:
                    cells.append("[dim]absent[/]")
                    continue
                values = result.to_dicts()[0]
                cells.append(", ".join(f"{k}={_fmt(v)}" for k, v in values.items()))
            table.add_row(f"{entity} {entity_id}", home, *cells)
    finally:
        for client in clients.values():
            client.close()
    return table


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def _freshness_table(settings: EdgefeedSettings, users: int, items: int) -> Table:
    import numpy as np

    from edgefeed.lookup import feature_client

    table = Table(title="freshness: source commit -> Redis write, per vector")
    for column in ("region", "vectors", "p50 ms", "p99 ms", "newest commit, s ago"):
        table.add_column(column)
    for region in settings.region_names:
        client = feature_client(settings, region, timeout_s=2)
        try:
            lags: list[np.ndarray[Any, Any]] = []
            newest = 0.0
            for entity, count in (("user", users), ("item", items)):
                result = client.get(entity, list(range(1, count + 1)))
                found = np.asarray(result.found, dtype=bool)
                # datetime64[us] -> seconds since the epoch
                commit = result.commit_time.view(np.int64)[found] / 1e6
                write = result.write_time.view(np.int64)[found] / 1e6
                lags.append((write - commit) * 1000.0)
                if commit.size:
                    newest = max(newest, float(commit.max()))
        finally:
            client.close()
        lag = np.concatenate(lags) if lags else np.array([])
        if lag.size == 0:
            table.add_row(region, "0", "-", "-", "-")
            continue
        table.add_row(
            region,
            str(lag.size),
            f"{np.percentile(lag, 50):.0f}",
            f"{np.percentile(lag, 99):.0f}",
            f"{time.time() - newest:.1f}",
        )
    return table


@demo_app.command("run")
def run(
    ctx: typer.Context,
    state_dir: StateDir = Path(".edgefeed"),
    rate: Annotated[float, typer.Option(help="Changes per second of the load.")] = 200.0,
    duration: Annotated[float, typer.Option(help="Seconds of load.")] = 20.0,
    users: Annotated[int, typer.Option(help="Demo users.")] = 300,
    items: Annotated[int, typer.Option(help="Demo items.")] = 100,
) -> None:
    """Run the data path end to end on the local stack and show what each region holds."""
    from connectors import deploy
    from connectors.client import ConnectClient
    from edgefeed.devstack import DevStack
    from edgefeed.shopload import ShopLoad, apply_schema

    settings = settings_of(ctx)
    settings_path = ctx.find_root().obj.get("settings_path")
    stack = run_reported(lambda: DevStack(settings, state_dir))
    console.rule("1. local stack: real services on loopback")
    statuses = run_reported(stack.up)
    print_status(statuses, as_json=False)
    if any(s.state != "running" for s in statuses):
        raise typer.Exit(EXIT_ERROR)

    console.rule("2. source tables and the Debezium connector")
    run_reported(lambda: apply_schema(settings.database.dsn()))
    with ConnectClient(
        settings.connect.url,
        timeout_s=settings.connect.timeout_s,
        secrets=settings.database.secrets(),
    ) as client:
        changes = run_reported(
            lambda: deploy.apply(client, settings.database, settings.sources, wait_s=120)
        )
    for change in changes:
        console.print(f"  {change.action:>9} {change.name}: RUNNING")

    console.rule("3. pipeline: the router and one feature worker per region")
    exe = str(Path(sys.executable).with_name("edgefeed"))
    # Absolute: the workers run in the stack's state folder (Faust writes there).
    settings_arg = str(Path(settings_path).resolve()) if settings_path else None
    base = [exe, "--settings", settings_arg] if settings_arg else [exe]
    workers = [("router", ["--role", "router"])]
    workers += [(region, ["--region", region]) for region in settings.region_names]
    for name, args in workers:
        metrics_port = free_port()
        stack.stop_app(f"pipeline-{name}")  # a previous demo's, on another metrics port
        run_reported(
            lambda name=name, args=args, port=metrics_port: stack.start_app(  # type: ignore[misc]
                f"pipeline-{name}",
                [*base, "pipeline", "run", *args, "--metrics-port", str(port)],
                ready="Worker]: Ready",
                timeout_s=120,
            )
        )
        stack.scrape("edgefeed-pipeline", f"pipeline-{name}", metrics_port)
        console.print(f"  pipeline {name}: ready (log: {stack.log_path('app-pipeline-' + name)})")

    start_exporter(stack, base, settings)

    console.rule(f"4. load: {rate:.0f} changes/s for {duration:.0f}s into PostgreSQL")
    load = ShopLoad(settings.database.dsn(), settings.region_names, users=users, items=items)
    result = run_reported(lambda: _load(settings, rate, duration, users, items))
    console.print(f"  wrote {result.changes} changes ({result.rate:.0f}/s)")
    time.sleep(2.0)  # let the last batches land before sampling

    console.rule("5. what each region's cache holds (personal data stays home)")
    console.print(_sample_table(settings, load))
    console.print(_freshness_table(settings, users, items))

    region = settings.region_names[0]
    console.rule(f"6. a model worker in {region} ranks items with the live features")
    from workers.models.loading import WEIGHTS_DIR

    worker_port = free_port()
    stack.stop_app(f"worker-{region}")  # a previous demo's, on another port
    run_reported(
        lambda: stack.start_app(
            f"worker-{region}",
            [
                *base,
                "workers",
                "serve",
                "--model",
                "ranker",
                "--weights",
                str(WEIGHTS_DIR / "shop_ranker.pt"),
                "--region",
                region,
                "--port",
                str(worker_port),
            ],
            ready="serving 'ranker'",
            timeout_s=180,
        )
    )
    stack.scrape("edgefeed-workers", f"worker-{region}", worker_port)
    summary = asyncio.run(_burst(f"http://127.0.0.1:{worker_port}", load, region, items))
    print_bench(
        summary,
        f"latency budget: ranker in {region} on live features "
        "(T_total = T_network + T_data + T_model + T_service)",
    )

    console.rule("7. edgefeed lag: consumer lag, freshness, replication slots, connectors")
    subprocess.run([*base, "lag"], check=False)

    console.rule("8. every region equals a recomputation from PostgreSQL (no loss, no double)")
    from edgefeed.cli.demo_sites import print_verified
    from edgefeed.verify import verify_until

    report = run_reported(lambda: verify_until(settings, settings.region_names, timeout_s=120))
    print_verified(report)
    if settings.monitoring.prometheus_port is not None:
        console.rule("9. alerts: the rules of deploy/prometheus on the local Prometheus")
        from edgefeed.localalerts import print_alert_state

        print_alert_state(console, settings.monitoring)
    console.print(
        "the stack, the pipeline, the exporter and the model worker keep running; stop "
        f"everything with: edgefeed "
        f"{'--settings ' + str(settings_path) + ' ' if settings_path else ''}dev down"
    )
    if not report.ok:
        raise typer.Exit(EXIT_ERROR)


async def _burst(url: str, load: ShopLoad, region: str, items: int) -> dict[str, Any]:
    """A short closed-loop burst of ranking requests for the region's own users."""
    from workers.bench import closed_loop
    from workers.client import InferenceAnswer, WorkerClient

    users = [u for u in range(1, load.users + 1) if load.home_region(u) == region]
    candidates = [str(i) for i in range(1, min(items, 20) + 1)]

    async def send(client: WorkerClient, n: int) -> InferenceAnswer:
        user = str(users[n % len(users)])
        return await client.rank("ranker", user, candidates, on_missing="drop")

    async with WorkerClient(url) as client:
        result = await closed_loop(client, send, concurrency=8, requests=300, warmup_requests=8)
    return result.summary()


demo_app.command("sites")(sites_demo)


def register(app: typer.Typer) -> None:
    """Add ``edgefeed demo`` to the root app."""
    app.add_typer(demo_app, name="demo")
