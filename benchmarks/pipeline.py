"""Benchmark of the pipeline (quoted in docs/benchmarks.md).

(a) Events per second one regional worker process sustains: edgefeed's region
    app (reading the router's packs of changes, continuous batches, one
    pipelined Redis round trip per batch) against a plain per-event Faust agent
    (one message per change, the same feature engine, each vector written as it
    comes: one Redis round trip per change), both consuming the same changes,
    pre-filled, in the same run.
(b) Freshness, PostgreSQL commit -> Redis write, p50 and p99, at a steady rate
    of changes per second (2,000 by default) written by the demo load
    generator, with Debezium, the router and one regional worker on this
    machine; beside it, in the same run, Debezium's own part: commit -> Kafka
    (the change record's timestamp minus its source commit time). Measured
    over ``--seconds`` after ``--warmup-s`` (10 s) of the same load: a stack
    started just before its load spends the first seconds warming up (the
    Connect JVM compiling Debezium's paths); the whole run's figures, warm-up
    included, are reported beside them (``cold_*``).
(c) With ``--renewals SCALE``, after (b): the same load again through a new
    connector, router and worker whose windows are all SCALE times shorter,
    then a quiet settle while rows leave them: how long after a schedule's end
    its renewal lands in Redis (the error bound of windows read as of the
    read time), beside the same run's freshness and worker CPU.

Everything runs on the real local stack (started here on free ports and
stopped at the end).

    .venv/bin/python benchmarks/pipeline.py            # full run, ~3.5 minutes
    .venv/bin/python benchmarks/pipeline.py --smoke    # a short run that checks it works
    .venv/bin/python benchmarks/pipeline.py --part b --renewals 360   # (b), then (c), ~2 min
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

# This file is named like the package it measures: drop its folder from the path.
_HERE = str(Path(__file__).resolve().parent)
sys.path[:] = [p for p in sys.path if p not in ("", _HERE)]

import orjson  # noqa: E402
import psycopg  # noqa: E402
import yaml  # noqa: E402
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer  # noqa: E402
from aiokafka.partitioner import DefaultPartitioner  # noqa: E402

from connectors import deploy  # noqa: E402
from connectors.client import ConnectClient  # noqa: E402
from edgefeed.devstack import DevStack  # noqa: E402
from edgefeed.devstack.ports import free_port  # noqa: E402
from edgefeed.devstack.process import read_pid  # noqa: E402
from edgefeed.pipeline_config import pipeline_config  # noqa: E402
from edgefeed.settings import EdgefeedSettings, load_settings, settings_from_mapping  # noqa: E402
from edgefeed.shopload import LoadProgress, ShopLoad, apply_schema  # noqa: E402
from pipeline.envelope import Change  # noqa: E402
from pipeline.messages import encode_packs  # noqa: E402
from pipeline.routing import Router  # noqa: E402
from pipeline.settings import parse_duration_ms  # noqa: E402
from pipeline.topics import ensure_topics  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EDGEFEED = str(Path(sys.executable).with_name("edgefeed"))


def make_settings(partitions: int, tag: str) -> dict[str, Any]:
    """The example settings with one region (eu-west), on free ports."""
    example = yaml.safe_load((ROOT / "examples" / "edgefeed.yaml").read_text())
    eu = next(r for r in example["regions"] if r["name"] == "eu-west")
    eu.update(redis_url=f"redis://127.0.0.1:{free_port()}/0", failover=[])
    return {
        "kafka": {
            "bootstrap_servers": f"127.0.0.1:{free_port()}",
            "session_timeout_ms": 6000,
            "fetch_max_wait_ms": 20,
        },
        "connect": {"url": f"http://127.0.0.1:{free_port()}", "timeout_s": 30},
        "database": {
            "host": "127.0.0.1",
            "port": free_port(),
            "dbname": "edgefeed",
            "user": "postgres",
            "password": "bench-secret",
        },
        "regions": [eu],
        "sources": [{**example["sources"][0], "name": f"bench_{tag}", "snapshot_mode": "no_data"}],
        "entities": example["entities"],
        "pipeline": {**example["pipeline"], "partitions": partitions, "app_prefix": f"bench-{tag}"},
    }


# -- the plain per-event baseline ------------------------------------------------------------


def plain_worker(settings_file: str, region: str) -> None:
    """A plain Faust agent: one event at a time, one Redis write per event."""
    import faust
    from prometheus_client import REGISTRY, start_http_server

    from edge_cache import AsyncFeatureWriter
    from pipeline.app import faust_app
    from pipeline.features import FeatureEngine
    from pipeline.metrics import PipelineMetrics

    applied = PipelineMetrics.create(REGISTRY).events.labels("plain", "applied")

    settings = load_settings(settings_file)
    config = pipeline_config(settings, check_database=False)
    app = faust_app(settings.pipeline.region_app_id(region) + "-plain", config)
    engine = FeatureEngine(config.entities)
    topic = app.topic(os.environ["BENCH_TOPIC"], key_serializer="raw", value_serializer="raw")
    table = app.Table("entities", partitions=settings.pipeline.partitions, key_type=str)
    writer: dict[str, AsyncFeatureWriter] = {}

    @app.agent(topic)
    async def per_event(stream: Any) -> None:
        async for event in stream.events():
            if "w" not in writer:
                writer["w"] = AsyncFeatureWriter.from_region(
                    settings.region(region), engine.schemas
                )
            message = json.loads(event.value)
            key = event.key.decode()
            entity = engine.engine(message["e"])
            state, changed = entity.apply(table.get(key), message)
            if changed and state is not None:
                table[key] = state
                await writer["w"].write([entity.write_op(message["id"], state)])
            applied.inc()

    start_http_server(int(os.environ["BENCH_METRICS_PORT"]), addr="127.0.0.1")
    faust.Worker(app, loglevel="warning", quiet=True).execute_from_commandline()


# -- (a) throughput ---------------------------------------------------------------------------


def scrape(port: int, name: str) -> dict[str, float]:
    """Prometheus samples of metric ``name`` (labels joined) from a worker."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name):
            key, _, value = line.rpartition(" ")
            samples[key] = float(value)
    return samples


def processed(port: int) -> float:
    try:
        samples = scrape(port, "edgefeed_pipeline_events_total")
    except OSError:
        return 0.0
    return sum(v for k, v in samples.items() if "applied" in k or "duplicate" in k)


ROUTER_BATCH = 100  # source events per router batch: 50 ms at 2,000 events/s


def regional_messages(
    settings: EdgefeedSettings, count: int
) -> tuple[list[tuple[bytes, bytes]], list[tuple[int, bytes]]]:
    """What the router sends eu-west for ``count`` view/click/purchase events.

    Returns:
        One message per change (keyed ``entity:id``, what a plain per-event design
        sends), and the router's packs (partition, JSON array of changes) for
        router batches of ROUTER_BATCH events.
    """
    router = Router(settings.entities, settings.tables(), settings.region_names)
    partitioner = DefaultPartitioner()
    partitions = list(range(settings.pipeline.partitions))
    rng = random.Random(3)
    singles: list[tuple[bytes, bytes]] = []
    packs: list[tuple[int, bytes]] = []
    pending: dict[int, list[bytes]] = {}
    base_us = int(time.time() * 1e6)
    lsn = 1000
    for i in range(count):
        lsn += 1
        user, item = rng.randrange(1, 301), rng.randrange(1, 101)
        row = {
            "event_id": i + 1,
            "user_id": user,
            "item_id": item,
            "category_id": item % 12,
            "price": "12.50",
            "home_region": "eu-west",
            "kind": rng.choice(("view", "view", "click", "purchase")),
            "occurred_at": base_us + i * 1000,
        }
        change = Change("public.events", "c", None, row, lsn, 0, base_us // 1000)
        for routed in router.route(change):
            if routed.key is not None:
                key, body = routed.key.encode(), routed.change.encode()
                singles.append((key, body))
                pending.setdefault(partitioner(key, partitions, partitions), []).append(body)
        if (i + 1) % ROUTER_BATCH == 0 or i + 1 == count:
            for partition, bodies in pending.items():
                packs.extend((partition, pack) for pack in encode_packs(bodies))
            pending = {}
    return singles, packs


def throughput(
    settings: EdgefeedSettings,
    settings_file: Path,
    events: int,
    state: Path,
    poll_s: float = 0.5,
) -> dict[str, float]:
    singles, packs = regional_messages(settings, events)
    topic = settings.pipeline.region_topic("eu-west")
    plain_topic = f"{topic}.plain"

    async def fill() -> None:
        await ensure_topics(
            settings.kafka.bootstrap_servers,
            {
                topic: settings.pipeline.partitions,
                plain_topic: settings.pipeline.partitions,
                **dict.fromkeys(settings.pipeline.names.dead_letter_topics(["eu-west"]), 1),
            },
        )
        producer = AIOKafkaProducer(
            bootstrap_servers=settings.kafka.bootstrap_servers, linger_ms=5, max_batch_size=1 << 20
        )
        await producer.start()
        try:
            for key, value in singles:
                await producer.send(plain_topic, value, key=key)
            for partition, value in packs:
                await producer.send(topic, value, partition=partition)
            await producer.flush()
        finally:
            await producer.stop()

    asyncio.run(fill())
    results: dict[str, float] = {}
    for variant in ("plain", "edgefeed"):
        port = free_port()
        env = {**os.environ, "BENCH_METRICS_PORT": str(port), "BENCH_TOPIC": plain_topic}
        if variant == "plain":
            argv = [sys.executable, __file__, "--plain-worker", str(settings_file)]
        else:
            argv = [
                EDGEFEED,
                "--settings",
                str(settings_file),
                "pipeline",
                "run",
                "--region",
                "eu-west",
                "--metrics-port",
                str(port),
                "--loglevel",
                "warning",
            ]
        log = open(state / f"{variant}.log", "wb")  # noqa: SIM115
        # cwd: Faust creates its data folder in the working directory; keep it in
        # the benchmark's state folder, which is removed at the end.
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=state)
        try:
            total = len(singles)  # changes, in either form
            deadline = time.monotonic() + 600
            low, high = 0.1 * total, 0.9 * total
            t_low = t_high = None
            # The last observation before this one: when a worker gets from under 10%
            # to over 90% between two polls (a short run, packs of many events), the
            # rate is timed from that observation, a lower bound, not refused.
            t_prev, n_prev = time.monotonic(), 0.0
            while time.monotonic() < deadline and proc.poll() is None:
                done = processed(port)
                now = time.monotonic()
                if t_low is None and done >= low:
                    t_low, n_low = now, done
                if done >= high:
                    t_high, n_high = now, done
                    if t_high <= t_low:
                        t_low, n_low = t_prev, n_prev
                    break
                t_prev, n_prev = now, done
                # Scraping costs the worker CPU: poll gently on long runs.
                time.sleep(poll_s)
            if t_low is None or t_high is None:
                raise SystemExit(
                    f"{variant} worker did not get through the topic; see "
                    f"{state / (variant + '.log')}"
                )
            results[variant] = (n_high - n_low) / (t_high - t_low)
            if variant == "edgefeed":
                sizes = scrape(port, "edgefeed_pipeline_batch_size")
                spent = scrape(port, "edgefeed_pipeline_batch_seconds")
                count = next(
                    (
                        v
                        for k, v in sizes.items()
                        if k.startswith("edgefeed_pipeline_batch_size_count")
                    ),
                    0.0,
                )
                total_events = next(
                    (
                        v
                        for k, v in sizes.items()
                        if k.startswith("edgefeed_pipeline_batch_size_sum")
                    ),
                    0.0,
                )
                busy = next(
                    (
                        v
                        for k, v in spent.items()
                        if k.startswith("edgefeed_pipeline_batch_seconds_sum")
                    ),
                    0.0,
                )
                results["mean_batch"] = total_events / count if count else 0.0
                results["busy_share"] = busy * results[variant] / max(total_events, 1.0)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            log.close()
    results["speedup"] = results["edgefeed"] / results["plain"]
    results["messages"] = float(len(singles))
    results["packs"] = float(len(packs))
    return results


# -- (b) freshness ----------------------------------------------------------------------------


def histogram_buckets(
    port: int, label: str, metric: str = "edgefeed_pipeline_freshness_seconds"
) -> list[tuple[float, float]]:
    """The cumulative buckets (upper bound, count) of a worker's histogram, for the
    series whose labels contain ``label``."""
    samples = scrape(port, f"{metric}_bucket")
    return sorted(
        (float("inf") if 'le="+Inf"' in k else float(k.split('le="')[1].split('"')[0]), v)
        for k, v in samples.items()
        if label in k
    )


def bucket_quantiles(
    buckets: list[tuple[float, float]],
    quantiles: tuple[float, ...],
    since: list[tuple[float, float]] | None = None,
) -> dict[str, Any]:
    """Quantiles of cumulative buckets (of what was observed after ``since``, an
    earlier reading of the same buckets, when given)."""
    if since:
        earlier = dict(since)
        buckets = [(le, count - earlier.get(le, 0.0)) for le, count in buckets]
    total = buckets[-1][1] if buckets else 0.0
    out: dict[str, Any] = {"count": total}
    for q in quantiles:
        target = q * total
        previous_le, previous_count = 0.0, 0.0
        value = float("nan")
        for le, count in buckets:
            if count >= target:
                if le == float("inf"):
                    value = previous_le
                else:  # linear interpolation inside the bucket, as histogram_quantile does
                    share = (target - previous_count) / max(count - previous_count, 1e-9)
                    value = previous_le + (le - previous_le) * share
                break
            previous_le, previous_count = le, count
        out[f"p{int(q * 100)}_ms"] = value * 1000
    return out


def histogram_quantiles(
    port: int,
    label: str,
    quantiles: tuple[float, ...],
    metric: str = "edgefeed_pipeline_freshness_seconds",
) -> dict[str, Any]:
    """Quantiles of a worker's histogram, for the series whose labels contain ``label``."""
    return bucket_quantiles(histogram_buckets(port, label, metric), quantiles)


def max_bucket(port: int, label: str, metric: str) -> float | None:
    """The upper bound of the highest bucket of a histogram that holds an observation
    (None: no observation): what the histogram can say of its maximum."""
    previous = 0.0
    highest = None
    for le, count in histogram_buckets(port, label, metric):
        if count > previous:
            highest = le
        previous = count
    return highest


class KafkaLatency(threading.Thread):
    """Commit -> Kafka of the records of a topic, measured on the side: Debezium's
    change events (Debezium's part), or the router's packs (Debezium's and the router's)."""

    def __init__(self, bootstrap: list[str], topic: str) -> None:
        super().__init__(daemon=True)
        self.bootstrap, self.topic = bootstrap, topic
        self.samples: list[float] = []
        self.commits: list[float] = []  # each sample's source commit time (ms)
        self.stop_event = threading.Event()
        self.ready = threading.Event()  # positioned at the topic's end: the load may start

    def run(self) -> None:
        asyncio.run(self._consume())

    async def _consume(self) -> None:
        consumer = AIOKafkaConsumer(
            self.topic,
            bootstrap_servers=self.bootstrap,
            auto_offset_reset="latest",
            fetch_max_wait_ms=20,
        )
        await consumer.start()
        try:
            # Resolve "latest" now, not at the first fetch: a consumer that got there
            # after a short load's records would measure nothing.
            deadline = time.monotonic() + 60
            while not consumer.assignment() and time.monotonic() < deadline:
                await consumer.getmany(timeout_ms=100)
            for partition in consumer.assignment():
                await consumer.position(partition)
            self.ready.set()
            while not self.stop_event.is_set():
                batch = await consumer.getmany(timeout_ms=200, max_records=5000)
                for records in batch.values():
                    for record in records:
                        if not record.value:
                            continue
                        body = orjson.loads(record.value)
                        if isinstance(body, list):  # a router pack: each change's commit time
                            commits = [c["ts"] for c in body]
                        else:  # a Debezium change event
                            commits = [body["source"]["ts_ms"]]
                        self.commits.extend(commits)
                        self.samples.extend(record.timestamp - c for c in commits)
        finally:
            await consumer.stop()

    def since(self, commit_ms: float) -> list[float]:
        """The samples of changes committed at or after ``commit_ms``."""
        return [v for c, v in zip(self.commits, self.samples, strict=True) if c >= commit_ms]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def cpu_seconds(stack: DevStack, app: str) -> float:
    """User + system CPU seconds an app of ``stack`` has used so far (Linux /proc)."""
    record = read_pid(stack.pid_path(f"app-{app}"))
    if record is None:
        return float("nan")
    fields = Path(f"/proc/{record.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def scaled_windows(entities: list[dict[str, Any]], scale: float) -> list[dict[str, Any]]:
    """The example's entities with every window ``scale`` times shorter (whole
    milliseconds): with ``scale=360`` 30 minutes become 5 s, an hour 10 s, a day 240 s,
    so rows leave their windows during the run and schedules run out all the time."""
    out = []
    for entity in entities:
        aggregates = []
        for feature in entity.get("aggregates", []):
            window = feature.get("window")
            if window is not None:
                size_ms = max(1, round(parse_duration_ms(window["size"]) / scale))
                feature = {**feature, "window": {**window, "size": f"{size_ms}ms"}}
            aggregates.append(feature)
        out.append({**entity, "aggregates": aggregates})
    return out


def retire_source(settings: EdgefeedSettings) -> None:
    """Delete the connector of ``settings``' source and its replication slot (the slot
    would otherwise hold WAL, and the connector stream a second copy of the load)."""
    source = settings.sources[0]
    with ConnectClient(settings.connect.url, timeout_s=30) as client:
        client.delete(source.connector_name)
    with psycopg.connect(settings.database.dsn(), autocommit=True) as conn:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the slot is busy until the task stops
            try:
                conn.execute("SELECT pg_drop_replication_slot(%s)", (source.effective_slot_name,))
                return
            except psycopg.errors.ObjectInUse:
                time.sleep(0.2)
            except psycopg.errors.UndefinedObject:
                return


def start_apps(
    stack: DevStack, apps: list[tuple[str, list[str], str]], timeout_s: float = 180.0
) -> None:
    """Start ``apps`` (name, argv, the line its log prints once ready) side by side and
    wait until each is ready: their start-up waits (imports, group joins) overlap."""
    for name, argv, _ready in apps:
        stack.start_app(name, argv)  # no ``ready``: it does not wait
    waiting = {name: ready for name, _argv, ready in apps}
    deadline = time.monotonic() + timeout_s
    while waiting:
        for name, ready in list(waiting.items()):
            log = stack.log_path(f"{stack._APP_PREFIX}{name}")
            if log.exists() and ready.encode() in log.read_bytes():
                del waiting[name]
                continue
            record = read_pid(stack.pid_path(f"{stack._APP_PREFIX}{name}"))
            if record is None or not record.alive() or time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
                raise RuntimeError(f"{name} did not become ready; the end of {log}:\n{tail}")
        time.sleep(0.2)


def freshness(
    settings: EdgefeedSettings,
    settings_file: Path,
    stack: DevStack,
    rate: float,
    seconds: float,
    tag: str = "",
    settle_s: float = 3.0,
    warmup_s: float = 0.0,
) -> dict[str, Any]:
    """(b) at ``rate`` for ``warmup_s`` then ``seconds`` more, without a pause; then
    ``settle_s`` without load (the drain, and with short windows the rows leaving
    them: renewals alone).

    The figures are those of the ``seconds`` after the warm-up: latencies of the
    changes committed from then on (the worker's histogram: of the vectors written
    from then on), CPU over that time. The ``cold_*`` figures are the whole run's,
    warm-up included: what a stack started just before the load shows (a fresh
    Connect JVM compiles Debezium's paths under the load's first seconds)."""
    apply_schema(settings.database.dsn())
    with ConnectClient(settings.connect.url, timeout_s=30) as client:
        deploy.apply(client, settings.database, settings.sources, wait_s=120)
    port = free_port()
    base = [EDGEFEED, "--settings", str(settings_file), "pipeline", "run", "--loglevel", "info"]
    router, worker = f"router{tag}", f"eu-west{tag}"
    start_apps(
        stack,
        [
            (router, [*base, "--role", "router"], "Worker]: Ready"),
            (worker, [*base, "--region", "eu-west", "--metrics-port", str(port)], "Worker]: Ready"),
        ],
    )
    load = ShopLoad(settings.database.dsn(), settings.region_names)
    load.seed_rows()
    side = KafkaLatency(
        settings.kafka.bootstrap_servers, settings.sources[0].topic_for("public.events")
    )
    side.start()
    routed = KafkaLatency(
        settings.kafka.bootstrap_servers, settings.pipeline.region_topic("eu-west")
    )
    routed.start()
    for thread in (side, routed):
        if not thread.ready.wait(timeout=90):
            raise RuntimeError(f"the side consumer of {thread.topic} did not start in 90 s")
    label = 'region="eu-west"'
    # The readings at the start and at the warm-up's end (the first progress
    # report after it; the start itself without a warm-up).
    mark: dict[str, Any] = {}

    def reading(changes: int, commit_ms: float) -> dict[str, Any]:
        return {
            "buckets": histogram_buckets(port, label),
            "cpu": {app: cpu_seconds(stack, app) for app in (router, worker)},
            "changes": changes,
            "commit_ms": commit_ms,
        }

    def at_progress(progress: LoadProgress) -> None:
        if not mark and progress.elapsed_s >= warmup_s:
            mark.update(reading(progress.changes, time.time() * 1000))

    start = reading(0, 0.0)
    if warmup_s <= 0:
        mark.update(start)
    result = load.run(rate, warmup_s + seconds, on_progress=at_progress)
    time.sleep(settle_s)  # drain (and, with short windows, the windows emptying)
    cpu = {app: cpu_seconds(stack, app) - mark["cpu"][app] for app in mark["cpu"]}
    measured_changes = max(result.changes - mark["changes"], 1)
    for thread in (side, routed):
        thread.stop_event.set()
        thread.join(timeout=10)
    final_buckets = histogram_buckets(port, label)
    quantiles = bucket_quantiles(final_buckets, (0.5, 0.99), since=mark["buckets"])
    cold = bucket_quantiles(final_buckets, (0.5, 0.99), since=start["buckets"])
    debezium, region_topic = side.since(mark["commit_ms"]), routed.since(mark["commit_ms"])
    flushes = histogram_quantiles(
        port, "region-eu-west", (0.5, 0.99), metric="edgefeed_pipeline_batch_seconds"
    )
    renewal_lag = histogram_quantiles(
        port, 'region="eu-west"', (0.5, 0.99), metric="edgefeed_pipeline_renewal_lag_seconds"
    )
    renewals = sum(
        v
        for k, v in scrape(port, "edgefeed_pipeline_renewals_total").items()
        if 'region="eu-west"' in k
    )
    sizes = scrape(port, "edgefeed_pipeline_batch_size")
    batches = sum(v for k, v in sizes.items() if k.startswith("edgefeed_pipeline_batch_size_count"))
    changes = sum(v for k, v in sizes.items() if k.startswith("edgefeed_pipeline_batch_size_sum"))
    return {
        "rate_asked": rate,
        "rate_written": round(result.rate, 1),
        "warmup_s": warmup_s,
        "seconds": round(result.elapsed_s - warmup_s, 1),
        "vectors_written": quantiles["count"],
        "commit_to_redis_p50_ms": round(quantiles["p50_ms"], 1),
        "commit_to_redis_p99_ms": round(quantiles["p99_ms"], 1),
        "commit_to_kafka_p50_ms": percentile(debezium, 0.5),
        "commit_to_kafka_p99_ms": percentile(debezium, 0.99),
        "kafka_samples": len(debezium),
        # the whole run, warm-up included
        "cold_vectors_written": cold["count"],
        "cold_kafka_samples": len(side.samples),
        "cold_commit_to_redis_p50_ms": round(cold["p50_ms"], 1),
        "cold_commit_to_redis_p99_ms": round(cold["p99_ms"], 1),
        "cold_commit_to_kafka_p99_ms": percentile(side.samples, 0.99),
        "cold_commit_to_region_topic_p99_ms": percentile(routed.samples, 0.99),
        "worker_flush_p50_ms": round(flushes["p50_ms"], 1),
        "worker_flush_p99_ms": round(flushes["p99_ms"], 1),
        "worker_mean_batch": round(changes / batches, 1) if batches else 0.0,
        # CPU per 1,000 changes written: a cost the machine's noise barely moves,
        # unlike the latencies above.
        "router_cpu_ms_per_1000": round(1e6 * cpu[router] / measured_changes, 1),
        "worker_cpu_ms_per_1000": round(1e6 * cpu[worker] / measured_changes, 1),
        # windows read as of the read time: vectors written again because their
        # schedule ran out, and how long after its end each landed in the cache
        "renewals": renewals,
        "renewal_lag_p50_ms": round(renewal_lag["p50_ms"], 1) if renewals else None,
        "renewal_lag_p99_ms": round(renewal_lag["p99_ms"], 1) if renewals else None,
        "renewal_lag_max_bucket_s": max_bucket(
            port, 'region="eu-west"', "edgefeed_pipeline_renewal_lag_seconds"
        ),
        "commit_to_region_topic_p50_ms": percentile(region_topic, 0.5),
        "commit_to_region_topic_p99_ms": percentile(region_topic, 0.99),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a short run that checks it works")
    parser.add_argument("--events", type=int, default=30000, help="(a) source events")
    parser.add_argument("--rate", type=float, default=2000.0, help="(b) changes per second")
    parser.add_argument("--seconds", type=float, default=30.0, help="(b) seconds of load")
    parser.add_argument(
        "--warmup-s",
        type=float,
        default=10.0,
        help="(b) seconds of the same load before the measured seconds (the figures of the "
        "whole run, warm-up included, are reported too, as cold_*)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON only")
    parser.add_argument(
        "--batch-max",
        type=int,
        default=None,
        help="pipeline.batch_max (default: the example settings')",
    )
    parser.add_argument(
        "--batch-within-ms",
        type=int,
        default=None,
        help="pipeline.batch_within_ms (default: the example settings')",
    )
    parser.add_argument(
        "--batch-catch-up",
        type=float,
        default=None,
        help="pipeline.batch_catch_up (default: the example settings')",
    )
    parser.add_argument(
        "--checkpoint-interval-s",
        type=float,
        default=None,
        help="pipeline.checkpoint_interval_s (default: the example settings')",
    )
    parser.add_argument(
        "--part",
        choices=("a", "b", "both"),
        default="both",
        help="run only (a) throughput or (b) freshness",
    )
    parser.add_argument(
        "--renewals",
        type=float,
        default=None,
        metavar="SCALE",
        help="(c) after (b), the same load again with every window SCALE times shorter "
        "(360: 30m -> 5s, 1h -> 10s), then a quiet settle while rows leave the windows: "
        "renewal lag and freshness beside (b)'s",
    )
    parser.add_argument("--plain-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plain_worker:
        plain_worker(args.plain_worker, "eu-west")
        return
    if args.smoke:
        args.events, args.rate, args.seconds, args.warmup_s = 2000, 200.0, 3.0, 1.0
    if args.warmup_s < 0:
        parser.error(f"--warmup-s {args.warmup_s}: must be 0 or more")
    tag = f"{os.getpid()}"
    state = Path(tempfile.mkdtemp(prefix="edgefeed-bench-"))
    state.chmod(0o755)
    mapping = make_settings(partitions=2, tag=tag)
    if args.batch_max is not None:
        mapping["pipeline"]["batch_max"] = args.batch_max
    if args.batch_within_ms is not None:
        mapping["pipeline"]["batch_within_ms"] = args.batch_within_ms
    if args.batch_catch_up is not None:
        mapping["pipeline"]["batch_catch_up"] = args.batch_catch_up
    if args.checkpoint_interval_s is not None:
        mapping["pipeline"]["checkpoint_interval_s"] = args.checkpoint_interval_s
    settings = settings_from_mapping(mapping)
    settings_file = state / "edgefeed.yaml"
    settings_file.write_text(yaml.safe_dump(mapping))
    # (b) gets topics and consumer groups of its own: nothing left over from (a).
    fresh_mapping = {
        **mapping,
        "pipeline": {
            **mapping["pipeline"],
            "app_prefix": f"bench-{tag}-fresh",
            "region_topic_prefix": f"bench.{tag}.fresh",
        },
    }
    fresh_settings = settings_from_mapping(fresh_mapping)
    fresh_file = state / "edgefeed-fresh.yaml"
    fresh_file.write_text(yaml.safe_dump(fresh_mapping))
    short_settings = short_file = None
    if args.renewals is not None:
        if args.renewals <= 1:
            parser.error(f"--renewals {args.renewals}: the scale must be above 1 (e.g. 360)")
        short_mapping = {
            **fresh_mapping,
            "entities": scaled_windows(fresh_mapping["entities"], args.renewals),
            "pipeline": {
                **fresh_mapping["pipeline"],
                "app_prefix": f"bench-{tag}-short",
                "region_topic_prefix": f"bench.{tag}.short",
            },
            "sources": [{**fresh_mapping["sources"][0], "name": f"bench_{tag}_short"}],
        }
        short_settings = settings_from_mapping(short_mapping)
        short_file = state / "edgefeed-short.yaml"
        short_file.write_text(yaml.safe_dump(short_mapping))
    stack = DevStack(settings, state / "stack")
    report: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}",
    }
    try:
        stack.up()
        apply_schema(settings.database.dsn())
        if args.part in ("a", "both"):
            report["throughput"] = throughput(
                settings, settings_file, args.events, state, poll_s=0.02 if args.smoke else 0.5
            )
        if args.part in ("b", "both"):
            report["freshness"] = freshness(
                fresh_settings, fresh_file, stack, args.rate, args.seconds, warmup_s=args.warmup_s
            )
        if short_settings is not None and short_file is not None:
            # (b)'s apps, connector and slot: (c) runs alone beside the same stack
            for app in ("router", "eu-west"):
                stack.stop_app(app)
            retire_source(fresh_settings)
            # the settle lets the rows leave the windows of up to 15 s (the longer ones
            # would make the run long); schedules run out all along the way
            longest_s = (
                max(
                    (
                        a.window.size_ms
                        for e in short_settings.entities
                        for a in e.aggregates
                        if a.window is not None and a.window.size_ms <= 15_000
                    ),
                    default=0,
                )
                / 1000
            )
            report["renewals"] = {
                "scale": args.renewals,
                **freshness(
                    short_settings,
                    short_file,
                    stack,
                    args.rate,
                    args.seconds,
                    tag="-short",
                    settle_s=longest_s + 5.0,
                    warmup_s=args.warmup_s,
                ),
            }
    finally:
        stack.down()
        if not os.environ.get("EDGEFEED_BENCH_KEEP"):
            shutil.rmtree(state, ignore_errors=True)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"machine: {report['machine']}")
    if "throughput" in report:
        t = report["throughput"]
        print(
            f"(a) one regional worker, {t['messages']:.0f} regional changes "
            f"({t['packs']:.0f} router packs for edgefeed, one message each for the plain agent):"
        )
        print(f"    plain per-event Faust agent: {t['plain']:9.0f} events/s")
        print(
            f"    edgefeed region app:         {t['edgefeed']:9.0f} events/s   "
            f"= {t['speedup']:.1f}x (target >= 5x)"
        )
        print(
            f"    (mean batch {t.get('mean_batch', 0):.0f} events; share of time in the "
            f"agent's own work {t.get('busy_share', 0):.0%})"
        )
    if "renewals" in report:
        print_renewals(report)
    if "freshness" not in report:
        return
    f = report["freshness"]
    print(
        f"(b) freshness at {f['rate_written']:.0f} changes/s for {f['seconds']}s after "
        f"{f['warmup_s']:g}s of warm-up ({f['vectors_written']:.0f} vectors written):"
    )
    print(
        f"    commit -> Redis: p50 {f['commit_to_redis_p50_ms']:.0f} ms, "
        f"p99 {f['commit_to_redis_p99_ms']:.0f} ms (target p99 < 500 ms)"
    )
    print(
        f"    the whole run, warm-up included: commit -> Redis p50 "
        f"{f['cold_commit_to_redis_p50_ms']:.0f} ms, p99 {f['cold_commit_to_redis_p99_ms']:.0f} ms;"
        f" Debezium alone p99 {f['cold_commit_to_kafka_p99_ms']:.0f} ms"
    )
    print(
        f"    commit -> Kafka (Debezium alone): p50 {f['commit_to_kafka_p50_ms']:.0f} ms, "
        f"p99 {f['commit_to_kafka_p99_ms']:.0f} ms"
    )
    print(
        f"    worker flushes (vectors + Redis write): p50 {f['worker_flush_p50_ms']:.0f} ms, "
        f"p99 {f['worker_flush_p99_ms']:.0f} ms, mean batch {f['worker_mean_batch']:.0f} changes"
    )
    print(
        f"    CPU per 1,000 changes: router {f['router_cpu_ms_per_1000']:.0f} ms, "
        f"worker {f['worker_cpu_ms_per_1000']:.0f} ms"
    )
    print(
        f"    commit -> regional topic (Debezium and the router): "
        f"p50 {f['commit_to_region_topic_p50_ms']:.0f} ms, "
        f"p99 {f['commit_to_region_topic_p99_ms']:.0f} ms"
    )


def print_renewals(report: dict[str, Any]) -> None:
    r, b = report["renewals"], report.get("freshness")
    print(
        f"(c) windows {r['scale']:g}x shorter, {r['rate_written']:.0f} changes/s for "
        f"{r['seconds']}s, then quiet: {r['renewals']:.0f} renewals"
    )
    if r["renewals"]:
        print(
            f"    renewal lag (schedule end -> renewal in Redis): p50 {r['renewal_lag_p50_ms']:.0f}"
            f" ms, p99 {r['renewal_lag_p99_ms']:.0f} ms, highest bucket <= "
            f"{r['renewal_lag_max_bucket_s']} s"
        )
    line = (
        f"    commit -> Redis: p50 {r['commit_to_redis_p50_ms']:.0f} ms, "
        f"p99 {r['commit_to_redis_p99_ms']:.0f} ms"
    )
    if b:
        line += (
            f" (x{r['commit_to_redis_p99_ms'] / b['commit_to_redis_p99_ms']:.2f} of (b)'s p99);"
            f" worker CPU per 1,000 changes {r['worker_cpu_ms_per_1000']:.0f} ms"
            f" (x{r['worker_cpu_ms_per_1000'] / b['worker_cpu_ms_per_1000']:.2f})"
        )
    print(line)


if __name__ == "__main__":
    main()
