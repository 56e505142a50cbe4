"""edgefeed's pipeline against a Quix Streams application doing the same work
(quoted in docs/benchmarks.md, "Pipeline vs Quix Streams").

Both compute the demo shop's user features (examples/edgefeed.yaml, the ``user``
entity) from the same Debezium topics and write the same vectors, in edgefeed's
key layout, to the same Redis: edgefeed under the namespace ``ef``, Quix Streams
(benchmarks/peers/quix_features.py, in its own venv) under ``qx``.

(a) Events per second, pre-filled topics: the load generator writes the changes,
    Debezium puts them in Kafka, then edgefeed (router and regional worker, two
    processes) and Quix Streams (one process) each consume all of them, one after
    the other. Reported: changes/s end to end, changes/s per process, changes per
    CPU-second of the consuming processes. Then both caches are checked against a
    recomputation from PostgreSQL (pipeline.recompute) and against each other.
(b) Freshness: each alone (one that falls behind would starve the other of CPU),
    Quix Streams first, from a fresh consumer group that first catches up on the
    records so far, while the load generator writes 2,000 changes/s for 30 s;
    commit -> Redis p50/p99 from each one's histogram (same metric, same buckets:
    per vector written, write time minus the newest source commit time in it).

Everything runs on a local stack started here on free ports and stopped at the end.

    make bench-peers-pipeline                         # creates the Quix venv if missing
    .venv/bin/python benchmarks/peers/quix_pipeline.py --smoke
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import redis
import yaml
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from connectors import deploy
from connectors.client import ConnectClient
from connectors.database import read_rows
from edge_cache import FeatureClient, KeyLayout
from edgefeed.devstack import DevStack
from edgefeed.devstack.process import read_pid
from edgefeed.lookup import feature_schemas
from edgefeed.settings import EdgefeedSettings, settings_from_mapping
from edgefeed.shopload import ShopLoad, apply_schema
from pipeline.recompute import RegionExpectation, compare, expected_vectors

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
QUIX_VENV = HERE / ".venv-quix"
QUIX_PYTHON = QUIX_VENV / "bin" / "python"
EDGEFEED = str(Path(sys.executable).with_name("edgefeed"))
REGION = "eu-west"


def _bench() -> Any:
    """benchmarks/pipeline.py (stack settings, metrics scraping, side latency), loaded by
    path: its name is the pipeline package's."""
    spec = importlib.util.spec_from_file_location(
        "pipeline_bench", ROOT / "benchmarks" / "pipeline.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _bench()


def quix_version() -> str:
    return subprocess.run(
        [str(QUIX_PYTHON), "-c", "import quixstreams; print(quixstreams.__version__)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def source_topics(settings: EdgefeedSettings) -> list[str]:
    source = settings.sources[0]
    return [source.topic_for(table.name) for table in source.tables]


async def create_source_topics(settings: EdgefeedSettings) -> None:
    """The Debezium topics, made before the connector with an explicit retention.

    Tansu answers DescribeConfigs with only the configs a topic was created with
    (none for the topics Kafka Connect creates); Quix Streams' group_by derives its
    repartition topic's config from the source topic's and raises KeyError
    'retention.ms' without it.
    """
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka.bootstrap_servers)
    await admin.start()
    try:
        await admin.create_topics(
            [
                NewTopic(
                    name,
                    num_partitions=1,
                    replication_factor=1,
                    topic_configs={"retention.ms": "-1", "retention.bytes": "-1"},
                )
                for name in source_topics(settings)
            ]
        )
    finally:
        await admin.close()


async def end_offsets(settings: EdgefeedSettings, topics: list[str]) -> int:
    """The brokers' end offsets of ``topics`` (one partition each), summed. On Tansu
    0.6 this undercounts (see count_records): use it only to see the topics grow."""
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka.bootstrap_servers)
    await consumer.start()
    try:
        offsets = await consumer.end_offsets([TopicPartition(topic, 0) for topic in topics])
        return sum(offsets.values())
    finally:
        await consumer.stop()


async def count_records(settings: EdgefeedSettings, topics: list[str]) -> int:
    """Records in ``topics``, counted by reading them (they are not being written).

    Tansu 0.6 answers ListOffsets (latest) with the base offset of the partition's
    last record batch plus one, not its last offset plus one: end offsets undercount
    by the size of the last batch less one.
    """
    consumer = AIOKafkaConsumer(
        bootstrap_servers=settings.kafka.bootstrap_servers, enable_auto_commit=False
    )
    await consumer.start()
    try:
        consumer.assign([TopicPartition(topic, 0) for topic in topics])
        await consumer.seek_to_beginning()
        count = 0
        while batch := await consumer.getmany(timeout_ms=2000, max_records=10000):
            count += sum(len(records) for records in batch.values())
        return count
    finally:
        await consumer.stop()


def wait_topics_settle(settings: EdgefeedSettings, topics: list[str], at_least: int) -> int:
    """Wait until Debezium has written ``at_least`` records and then stops adding;
    returns the number of records."""
    previous, stable_since = -1, time.monotonic()
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        total = asyncio.run(end_offsets(settings, topics))
        if total != previous:
            previous, stable_since = total, time.monotonic()
        elif time.monotonic() - stable_since > 3.0:
            counted = asyncio.run(count_records(settings, topics))
            if counted >= at_least:
                return counted
        time.sleep(1.0)
    raise SystemExit(f"Debezium wrote fewer than {at_least} records in 10 minutes")


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of the processes so far."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        total += (int(fields[11]) + int(fields[12])) / ticks
    return total


class Variant:
    """One contender: how to start its processes, and which port shows its progress."""

    def __init__(
        self, name: str, stack: DevStack, starts: list[tuple[str, list[str], str]]
    ) -> None:
        self.name, self.stack, self.starts = name, stack, starts

    def start(self) -> None:
        for app, argv, ready in self.starts:
            self.stack.start_app(app, argv, ready=ready, timeout_s=180)

    def pids(self) -> list[int]:
        records = [read_pid(self.stack.pid_path(f"app-{app}")) for app, _, _ in self.starts]
        return [r.pid for r in records if r is not None]

    def stop(self) -> None:
        for app, _, _ in reversed(self.starts):
            self.stack.stop_app(app)


def edgefeed_variant(stack: DevStack, settings_file: Path, port: int, tag: str) -> Variant:
    base = [EDGEFEED, "--settings", str(settings_file), "pipeline", "run", "--loglevel", "info"]
    return Variant(
        "edgefeed",
        stack,
        [
            (f"router-{tag}", [*base, "--role", "router"], "Worker]: Ready"),
            (
                f"{REGION}-{tag}",
                [*base, "--region", REGION, "--metrics-port", str(port)],
                "Worker]: Ready",
            ),
        ],
    )


def quix_variant(
    stack: DevStack, settings_file: Path, port: int, state: Path, commit_s: float, tag: str
) -> Variant:
    # PYTHONPATH: the app imports edge_cache (layout, writer) and the settings loader.
    argv = [
        "env",
        f"PYTHONPATH={ROOT}",
        str(QUIX_PYTHON),
        "-W",
        "ignore::DeprecationWarning",
        str(HERE / "quix_features.py"),
        "--settings",
        str(settings_file),
        "--region",
        REGION,
        "--namespace",
        "qx",
        "--state-dir",
        str(state / f"quix-state-{tag}"),
        "--group",
        f"quix-features-{tag}",
        "--commit-interval",
        str(commit_s),
        "--metrics-port",
        str(port),
    ]
    return Variant("quix", stack, [(f"quix-{tag}", argv, "now processing incoming messages")])


def consume_all(variant: Variant, port: int, total: int, poll_s: float) -> dict[str, float]:
    """Start ``variant``, time it through 10%..90% of ``total`` changes, wait for all."""
    variant.start()
    pids = variant.pids()
    low, high = 0.1 * total, 0.9 * total
    t_low = t_high = cpu_low = cpu_high = None
    n_low = n_high = 0.0
    deadline = time.monotonic() + 900
    done = 0.0
    while time.monotonic() < deadline:
        done = bench.processed(port)
        now = time.monotonic()
        if t_low is None and done >= low:
            t_low, n_low, cpu_low = now, done, cpu_seconds(pids)
        if t_high is None and done >= high:
            t_high, n_high, cpu_high = now, done, cpu_seconds(pids)
        if done >= total:
            break
        time.sleep(poll_s)
    if t_low is None or t_high is None or cpu_low is None or cpu_high is None:
        raise SystemExit(f"{variant.name} did not get through the topic ({done:.0f} of {total})")
    if t_high <= t_low:
        raise SystemExit(f"{variant.name}: too few changes to time; raise --events")
    rate = (n_high - n_low) / (t_high - t_low)
    return {
        "changes_per_s": rate,
        "processes": float(len(pids)),
        "changes_per_s_per_process": rate / len(pids),
        "changes_per_cpu_s": (n_high - n_low) / max(cpu_high - cpu_low, 1e-9),
        "processed": done,
    }


def cache_vectors(
    settings: EdgefeedSettings, namespace: str, ids: set[str]
) -> dict[str, dict[str, dict[str, Any] | None]]:
    """The user vectors under ``namespace`` (plus any other user key stored there)."""
    layout = KeyLayout(namespace)
    region = settings.region(REGION)
    raw = redis.Redis.from_url(region.redis_url)
    prefix = layout.prefix("user")
    try:
        stored = {k.decode()[len(prefix) : -1] for k in raw.scan_iter(match=f"{prefix}*")}
    finally:
        raw.close()
    client = FeatureClient(REGION, [region], feature_schemas(settings), timeout_s=10, layout=layout)
    found: dict[str, dict[str, Any] | None] = {}
    try:
        every = sorted(ids | stored)
        for start in range(0, len(every), 500):
            chunk = every[start : start + 500]
            vectors = client.get("user", chunk)
            for user, present, values in zip(chunk, vectors.found, vectors.to_dicts(), strict=True):
                found[user] = values if present else None
    finally:
        client.close()
    return {"user": found}


def check_values(settings: EdgefeedSettings) -> dict[str, Any]:
    """Both caches against a recomputation from PostgreSQL, and against each other."""
    tables = settings.tables()
    fed = sorted({t for entity in settings.entities for t in entity.tables})
    rows = read_rows(settings.database, [tables[name] for name in fed])
    expected = expected_vectors(settings.entities, tables, settings.region_names, rows)[REGION]
    ids = set(expected.vectors.get("user", {}))
    caches = {ns: cache_vectors(settings, ns, ids) for ns in ("ef", "qx")}
    out: dict[str, Any] = {"users": len(ids)}
    for ns, name in (("ef", "edgefeed"), ("qx", "quix")):
        mismatches = compare(REGION, expected, caches[ns])
        out[f"{name}_vs_recompute"] = len(mismatches)
        out[f"{name}_examples"] = [
            f"user {m.entity_id} {m.what}: expected {m.expected!r}, found {m.found!r}"
            for m in mismatches[:3]
        ]
    # Quix against edgefeed, feature by feature (edgefeed's vectors as the expectation).
    edgefeed_as_expected = RegionExpectation(
        vectors={"user": {u: v for u, v in caches["ef"]["user"].items() if v is not None}},
        unverifiable=expected.unverifiable,
    )
    out["quix_vs_edgefeed"] = len(compare(REGION, edgefeed_as_expected, caches["qx"]))
    return out


def make_mapping(tag: str) -> dict[str, Any]:
    """benchmarks/pipeline.py's settings with only the user entity (the work both do)."""
    mapping = bench.make_settings(partitions=2, tag=tag)
    mapping["entities"] = [e for e in mapping["entities"] if e["name"] == "user"]
    return mapping


def prefill(settings: EdgefeedSettings, events: int) -> int:
    """Write ``events`` changes (the load generator's mix) and wait for Debezium."""
    load = ShopLoad(settings.database.dsn(), settings.region_names)
    load.seed_rows()
    with psycopg.connect(settings.database.dsn(), autocommit=True) as conn:
        for start in range(0, events, 1000):
            load.write(conn, min(1000, events - start))
    topics = [settings.sources[0].topic_for(t) for t in ("public.events", "public.users")]
    return wait_topics_settle(settings, topics, at_least=int(events * 0.85))


def freshness_buckets(port: int) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of a worker's freshness histogram for REGION."""
    samples = bench.scrape(port, "edgefeed_pipeline_freshness_seconds_bucket")
    return sorted(
        (float(key.split('le="')[1].split('"')[0]), count)
        for key, count in samples.items()
        if f'region="{REGION}"' in key
    )


def quantile_between(
    before: list[tuple[float, float]], after: list[tuple[float, float]], q: float
) -> float:
    """Quantile ``q`` (ms) of the observations made between two scrapes of a histogram,
    interpolated inside the bucket as Prometheus' histogram_quantile does."""
    counts = dict(before)
    grown = [(le, count - counts.get(le, 0.0)) for le, count in after]
    target = q * grown[-1][1]
    lower, below = 0.0, 0.0
    for le, count in grown:
        if count >= target:
            if le == float("inf"):
                return lower * 1000
            return (lower + (le - lower) * (target - below) / max(count - below, 1e-9)) * 1000
        lower, below = le, count
    return float("nan")


def wait_caught_up(
    variants: list[tuple[Variant, int]], settings: EdgefeedSettings, limit_s: float
) -> dict[str, float]:
    """Wait (``limit_s`` at most) until every variant has processed every record in the
    topics (fresh consumer groups: from the start); returns the records each has left."""
    topics = [settings.sources[0].topic_for(t) for t in ("public.events", "public.users")]
    total = wait_topics_settle(settings, topics, at_least=0)
    deadline = time.monotonic() + limit_s
    left: dict[str, float] = {}
    for variant, port in variants:
        while (behind := total - bench.processed(port)) > 0 and time.monotonic() < deadline:
            time.sleep(0.5)
        left[variant.name] = max(0.0, behind)
    return left


def freshness(
    variants: list[tuple[Variant, int]], settings: EdgefeedSettings, rate: float, seconds: float
) -> dict[str, Any]:
    """Each variant alone (one that falls behind would starve the other of CPU), with a
    fresh consumer group: it first catches up on every record so far, then the clock
    runs over ``seconds`` of load at ``rate``."""
    load = ShopLoad(settings.database.dsn(), settings.region_names)
    events_topic = settings.sources[0].topic_for("public.events")
    out: dict[str, Any] = {}
    for variant, port in variants:
        variant.start()
        try:
            load.run(rate, 2.0)  # warm-up: joined its group and written vectors
            left = wait_caught_up([(variant, port)], settings, limit_s=900)
            if left[variant.name]:
                raise SystemExit(f"(b) {variant.name} did not catch up before the load: {left}")
            before = freshness_buckets(port)
            side = bench.KafkaLatency(settings.kafka.bootstrap_servers, events_topic)
            side.start()
            time.sleep(1.0)
            result = load.run(rate, seconds)
            # One that fell behind gets a bounded drain; its quantiles then cover the
            # vectors it wrote, and left_unprocessed says how many changes it had not reached.
            left = wait_caught_up([(variant, port)], settings, limit_s=120)
            time.sleep(1.0)  # the last checkpoint's write
            side.stop_event.set()
            side.join(timeout=10)
            after = freshness_buckets(port)
            out[variant.name] = {
                "rate_written": round(result.rate, 1),
                "seconds": round(result.elapsed_s, 1),
                "vectors": after[-1][1] - (before or [(0.0, 0.0)])[-1][1],
                "p50_ms": round(quantile_between(before, after, 0.5), 1),
                "p99_ms": round(quantile_between(before, after, 0.99), 1),
                "left_unprocessed": left[variant.name],
                "commit_to_kafka_p50_ms": bench.percentile(side.samples, 0.5),
                "commit_to_kafka_p99_ms": bench.percentile(side.samples, 0.99),
            }
        finally:
            variant.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a short run that checks it works")
    parser.add_argument("--events", type=int, default=30000, help="(a) changes pre-filled")
    parser.add_argument("--rate", type=float, default=2000.0, help="(b) changes per second")
    parser.add_argument("--seconds", type=float, default=30.0, help="(b) seconds of load")
    parser.add_argument(
        "--quix-commit-interval",
        type=float,
        default=5.0,
        help="(a) Quix Streams' commit_interval, seconds (its default)",
    )
    parser.add_argument(
        "--quix-commit-interval-fresh",
        type=float,
        default=0.1,
        help="(b) Quix Streams' commit_interval, seconds (its sink writes at each commit)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON only")
    parser.add_argument("--out", type=Path, help="also write the report (so far) here as JSON")
    args = parser.parse_args()
    if not QUIX_PYTHON.exists():
        subprocess.run(["bash", str(HERE / "quix_venv.sh")], check=True)
    if args.smoke:
        args.events, args.rate, args.seconds = 2000, 200.0, 3.0
    tag = f"{os.getpid()}"
    state = Path(tempfile.mkdtemp(prefix="edgefeed-bench-quix-"))
    state.chmod(0o755)
    mapping = make_mapping(tag)
    settings = settings_from_mapping(mapping)
    settings_file = state / "edgefeed.yaml"
    settings_file.write_text(yaml.safe_dump(mapping))
    stack = DevStack(settings, state / "stack")
    report: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}",
        "quixstreams": quix_version(),
        "quix_config": {
            "processing_guarantee": "at-least-once",
            "state_dir": "<run folder>/quix-state-a, quix-state-b (RocksDB, default options)",
            "commit_interval_s_a": args.quix_commit_interval,
            "commit_interval_s_b": args.quix_commit_interval_fresh,
            "fetch.wait.max.ms": settings.kafka.fetch_max_wait_ms,
        },
    }
    try:
        stack.up()
        apply_schema(settings.database.dsn())
        asyncio.run(create_source_topics(settings))
        with ConnectClient(settings.connect.url, timeout_s=30) as client:
            deploy.apply(client, settings.database, settings.sources, wait_s=120)
        total = prefill(settings, args.events)
        ports = {"edgefeed": bench.free_port(), "quix": bench.free_port()}
        contenders = [
            edgefeed_variant(stack, settings_file, ports["edgefeed"], "a"),
            quix_variant(
                stack, settings_file, ports["quix"], state, args.quix_commit_interval, "a"
            ),
        ]
        poll_s = 0.05 if args.smoke else 0.25
        throughput: dict[str, Any] = {"changes": total}
        for variant in contenders:
            try:
                throughput[variant.name] = consume_all(variant, ports[variant.name], total, poll_s)
                time.sleep(1.0)
            finally:
                variant.stop()  # Quix writes its last checkpoint's vectors on the way out
        e, q = throughput["edgefeed"], throughput["quix"]
        throughput["ratio_per_process"] = (
            e["changes_per_s_per_process"] / q["changes_per_s_per_process"]
        )
        throughput["ratio_per_cpu_s"] = e["changes_per_cpu_s"] / q["changes_per_cpu_s"]
        report["throughput"] = throughput
        report["values_after_a"] = check_values(settings)
        if args.out:
            args.out.write_text(json.dumps(report, indent=2))
        # (b): fresh consumer groups and state for both. Quix Streams cannot restart on
        # its state here: Tansu's undercounted end offsets make its changelog look
        # shorter than the offsets its RocksDB store recorded (InvalidStoreChangelogOffset).
        fresh_mapping = {
            **mapping,
            "pipeline": {
                **mapping["pipeline"],
                "app_prefix": f"bench-{tag}-b",
                "region_topic_prefix": f"bench.{tag}.b",
            },
        }
        fresh_file = state / "edgefeed-b.yaml"
        fresh_file.write_text(yaml.safe_dump(fresh_mapping))
        ports = {"edgefeed": bench.free_port(), "quix": bench.free_port()}
        live = [
            (
                quix_variant(
                    stack, settings_file, ports["quix"], state, args.quix_commit_interval_fresh, "b"
                ),
                ports["quix"],
            ),
            (edgefeed_variant(stack, fresh_file, ports["edgefeed"], "b"), ports["edgefeed"]),
        ]
        report["freshness"] = freshness(live, settings, args.rate, args.seconds)
        report["values_after_b"] = check_values(settings)
        if args.out:
            args.out.write_text(json.dumps(report, indent=2))
    finally:
        stack.down()
        if not os.environ.get("EDGEFEED_BENCH_KEEP"):
            shutil.rmtree(state, ignore_errors=True)
    print(json.dumps(report, indent=2) if args.json else render(report))


def render(report: dict[str, Any]) -> str:
    t, f = report["throughput"], report["freshness"]
    line: Callable[[str], str] = lambda name: (  # noqa: E731
        f"    {name:9} {t[name]['changes_per_s']:8.0f} changes/s, {t[name]['processes']:.0f} "
        f"process(es): {t[name]['changes_per_s_per_process']:8.0f} /s per process, "
        f"{t[name]['changes_per_cpu_s']:8.0f} per CPU-second"
    )
    lines = [
        f"machine: {report['machine']}; quixstreams {report['quixstreams']}",
        f"(a) {t['changes']} pre-filled Debezium records (events + users):",
        line("edgefeed"),
        line("quix"),
        f"    edgefeed / Quix: {t['ratio_per_process']:.1f}x per process (target >= 1.5x), "
        f"{t['ratio_per_cpu_s']:.1f}x per CPU-second",
        f"    values: {json.dumps(report['values_after_a'])}",
        "(b) each alone (Quix Streams first), fresh consumer group, after catching up:",
    ]
    for name in ("edgefeed", "quix"):
        r = f[name]
        lines.append(
            f"    {name:9} {r['rate_written']:.0f} changes/s for {r['seconds']} s: commit -> Redis "
            f"p50 {r['p50_ms']:.0f} ms, p99 {r['p99_ms']:.0f} ms ({r['vectors']:.0f} vectors"
            + (
                f"; {r['left_unprocessed']:.0f} changes not reached after a 120 s drain)"
                if r["left_unprocessed"]
                else ")"
            )
            + f"; Debezium alone p50 {r['commit_to_kafka_p50_ms']:.0f} ms, "
            f"p99 {r['commit_to_kafka_p99_ms']:.0f} ms"
        )
    lines.append(f"    values: {json.dumps(report['values_after_b'])}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
