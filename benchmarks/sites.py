"""Benchmark of a region behind a WAN link (quoted in docs/benchmarks.md).

Freshness, PostgreSQL commit -> the region's Redis, p50 and p99, at a steady
rate of changes (2,000/s by default, the demo load generator), with Debezium,
the router and one regional worker, in three phases of one run on one stack:

    single   the region shares the central broker (no link): the baseline;
    link     the region has its own broker behind a 100 ms one-way link, fed by
             its forwarder with zstd-compressed batches;
    raw      the same link, the forwarder without compression;
    serial   (only when asked for) the link phase with the forwarder sending one
             batch per round trip, as before it was pipelined.

Each phase has its own connector, topics and consumer groups, so none inherits
another's backlog. For the linked phases, the bytes that crossed the link in
each direction while the load ran, per 1,000 source changes.

    .venv/bin/python benchmarks/sites.py             # ~4 minutes
    .venv/bin/python benchmarks/sites.py --smoke     # a short run that checks it works
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# This folder holds pipeline.py, named like the package it measures: drop it from the path.
_HERE = str(Path(__file__).resolve().parent)
sys.path[:] = [p for p in sys.path if p not in ("", _HERE)]

import psycopg  # noqa: E402
import yaml  # noqa: E402

from connectors import deploy  # noqa: E402
from connectors.client import ConnectClient  # noqa: E402
from edgefeed.devstack import DevStack  # noqa: E402
from edgefeed.settings import settings_from_mapping  # noqa: E402
from edgefeed.shopload import ShopLoad, apply_schema  # noqa: E402
from edgefeed.wan import WanControl  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_pipeline", Path(_HERE) / "pipeline.py")
assert _spec is not None and _spec.loader is not None
bench_pipeline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_pipeline)

EDGEFEED = str(Path(sys.executable).with_name("edgefeed"))
LINK = "central-eu-west"


def base_mapping(tag: str, delay_ms: float) -> dict[str, Any]:
    mapping: dict[str, Any] = bench_pipeline.make_settings(partitions=2, tag=tag)
    free_port = bench_pipeline.free_port
    mapping["sites"] = {
        "regions": {
            "eu-west": {
                "bootstrap_servers": f"127.0.0.1:{free_port()}",
                "link": {"listen_port": free_port(), "delay_ms": delay_ms},
            }
        }
    }
    return mapping


def phase_mapping(base: dict[str, Any], phase: str, tag: str) -> dict[str, Any]:
    mapping = {
        **base,
        "sources": [{**base["sources"][0], "name": f"bench_{tag}_{phase}"}],
        "pipeline": {
            **base["pipeline"],
            "app_prefix": f"bench-{tag}-{phase}",
            "region_topic_prefix": f"bench.{tag}.{phase}",
            "dead_letter_topic": f"bench.{tag}.{phase}.deadletter",
        },
    }
    if phase == "single":
        mapping.pop("sites")
    else:
        mapping["sites"] = {
            **base["sites"],
            "compression": "none" if phase == "raw" else "zstd",
            # serial: the forwarder before pipelining, one batch per round trip
            "forward_max_in_flight": 1 if phase == "serial" else 8,
        }
    return mapping


def run_phase(
    phase: str, mapping: dict[str, Any], state: Path, stack: DevStack, rate: float, seconds: float
) -> dict[str, Any]:
    settings = settings_from_mapping(mapping)
    settings_file = state / f"edgefeed-{phase}.yaml"
    settings_file.write_text(yaml.safe_dump(mapping))
    source = settings.sources[0]
    port = bench_pipeline.free_port()
    base = [EDGEFEED, "--settings", str(settings_file), "pipeline", "run", "--loglevel", "info"]
    wan = WanControl(stack.wan_control_path)
    with ConnectClient(settings.connect.url, timeout_s=30) as client:
        deploy.apply(client, settings.database, settings.sources, wait_s=120)
        try:
            stack.start_app(
                f"{phase}-router",
                [*base, "--role", "router"],
                ready="Worker]: Ready",
                timeout_s=180,
            )
            if phase != "single":
                stack.start_app(
                    f"{phase}-forward",
                    [*base, "--role", "forwarder", "--region", "eu-west"],
                    ready="forwarder ready",
                    timeout_s=180,
                )
            stack.start_app(
                f"{phase}-eu-west",
                [*base, "--region", "eu-west", "--metrics-port", str(port)],
                ready="Worker]: Ready",
                timeout_s=180,
            )
            load = ShopLoad(settings.database.dsn(), settings.region_names)
            load.seed_rows()
            # The seed's vectors are written before the load starts, in every phase:
            # across the link they arrive as one forwarded burst, and a worker still
            # applying it when the load starts would count as the link's delay.
            settled(port)
            before_link = {link["name"]: link for link in wan.status()}[LINK]
            before = freshness_buckets(port)
            result = load.run(rate, seconds)
            time.sleep(3.0)  # drain
            if phase != "single":
                link_quiet(wan)  # every change has crossed: the bytes are all counted
            settled(port)
            after_link = {link["name"]: link for link in wan.status()}[LINK]
            timings = forwarder_timings(stack, f"{phase}-forward") if phase != "single" else {}
            # The load's vectors only (the histogram since the load began).
            quantiles = delta_quantiles(before, freshness_buckets(port), (0.5, 0.99))
        finally:
            for app in ("eu-west", "forward", "router"):
                stack.stop_app(f"{phase}-{app}")
            client.delete(source.connector_name)
    with psycopg.connect(settings.database.dsn(), autocommit=True) as conn:
        drop_slot(conn, source.effective_slot_name)
    up = after_link["bytes_up"] - before_link["bytes_up"]
    down = after_link["bytes_down"] - before_link["bytes_down"]
    per_1000 = 1000.0 / max(result.changes, 1)
    return {
        "phase": phase,
        "rate_written": round(result.rate, 1),
        "changes": result.changes,
        "vectors_written": quantiles["count"],
        "commit_to_redis_p50_ms": round(quantiles["p50_ms"], 1),
        "commit_to_redis_p99_ms": round(quantiles["p99_ms"], 1),
        "link_bytes_up_per_1000_changes": round(up * per_1000),
        "link_bytes_down_per_1000_changes": round(down * per_1000),
        "link_observed_delay_ms": after_link["observed_delay_ms"],
        # Per forwarded batch: router write -> fetched (waited), fetched -> acknowledged
        # by the region's broker (crossed), and records (router packs) per batch.
        "forwarder_batch_ms": timings,
    }


def forwarder_timings(stack: DevStack, app: str) -> dict[str, float]:
    """The forwarder's last logged batch timings (p50/p99 of its recent batches)."""
    time.sleep(10.5)  # it logs them every 10 s
    path = stack.log_path(f"{stack._APP_PREFIX}{app}")
    lines = [line for line in path.read_text().splitlines() if "recent batches" in line]
    if not lines:
        return {}
    found = {}
    for part in lines[-1].split(": ")[-1].split(", "):
        name, _, value = part.partition(" ")
        if value:
            found[name] = float(value)
    return found


def freshness_buckets(port: int) -> dict[float, float]:
    """The region's commit -> Redis histogram: upper bound (s) -> cumulative count."""
    samples = bench_pipeline.scrape(port, "edgefeed_pipeline_freshness_seconds_bucket")
    return {
        (float("inf") if 'le="+Inf"' in key else float(key.split('le="')[1].split('"')[0])): value
        for key, value in samples.items()
        if 'region="eu-west"' in key
    }


def delta_quantiles(
    before: dict[float, float], after: dict[float, float], quantiles: tuple[float, ...]
) -> dict[str, float]:
    """Quantiles of what the histogram gained between two readings (interpolated inside
    a bucket, as Prometheus' histogram_quantile does)."""
    buckets = sorted((le, count - before.get(le, 0.0)) for le, count in after.items())
    total = buckets[-1][1] if buckets else 0.0
    out = {"count": total}
    for q in quantiles:
        target, previous_le, previous_count, value = q * total, 0.0, 0.0, float("nan")
        for le, count in buckets:
            if count >= target:
                share = (target - previous_count) / max(count - previous_count, 1e-9)
                value = (
                    previous_le if le == float("inf") else previous_le + (le - previous_le) * share
                )
                break
            previous_le, previous_count = le, count
        out[f"p{int(q * 100)}_ms"] = value * 1000
    return out


def settled(port: int, quiet_s: float = 3.0, limit_s: float = 180.0) -> None:
    """Wait until the worker has written no vector for ``quiet_s`` (it applied all it had)."""
    deadline = time.monotonic() + limit_s
    last, since = -1.0, time.monotonic()
    while time.monotonic() < deadline:
        count = max(freshness_buckets(port).values(), default=0.0)
        if count != last:
            last, since = count, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.5)


def link_quiet(wan: WanControl, quiet_s: float = 3.0, limit_s: float = 180.0) -> None:
    """Wait until nothing has crossed the link for ``quiet_s`` (the forwarder caught up)."""
    deadline = time.monotonic() + limit_s
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        now = {link["name"]: link for link in wan.status()}[LINK]["bytes_up"]
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.5)


def drop_slot(conn: psycopg.Connection[tuple[object, ...]], slot: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
            return
        except psycopg.errors.ObjectInUse:
            time.sleep(0.2)
        except psycopg.errors.UndefinedObject:
            return


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a short run that checks it works")
    parser.add_argument("--rate", type=float, default=2000.0, help="changes per second")
    parser.add_argument("--seconds", type=float, default=30.0, help="seconds of load per phase")
    parser.add_argument("--delay-ms", type=float, default=100.0, help="one-way link delay")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    parser.add_argument(
        "--phases", default="single,link,raw", help="which phases, comma-separated, in order"
    )
    args = parser.parse_args()
    if args.smoke:
        args.rate, args.seconds = 200.0, 3.0
    tag = f"{os.getpid()}"
    state = Path(tempfile.mkdtemp(prefix="edgefeed-bench-sites-"))
    state.chmod(0o755)
    base = base_mapping(tag, args.delay_ms)
    stack = DevStack(settings_from_mapping(base), state / "stack")
    report: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}",
        "rate": args.rate,
        "seconds": args.seconds,
        "delay_ms": args.delay_ms,
        "phases": [],
    }
    try:
        stack.up()
        apply_schema(stack.settings.database.dsn())
        for phase in args.phases.split(","):
            mapping = phase_mapping(base, phase, tag)
            report["phases"].append(
                run_phase(phase, mapping, state, stack, args.rate, args.seconds)
            )
    finally:
        stack.down()
        if not os.environ.get("EDGEFEED_BENCH_KEEP"):
            shutil.rmtree(state, ignore_errors=True)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(
        f"machine: {report['machine']}; {args.rate:.0f} changes/s for {args.seconds:.0f} s a phase"
    )
    for p in report["phases"]:
        line = (
            f"{p['phase']:>6}: {p['rate_written']:.0f} changes/s, commit -> Redis "
            f"p50 {p['commit_to_redis_p50_ms']:.0f} ms, p99 {p['commit_to_redis_p99_ms']:.0f} ms"
        )
        if p["phase"] != "single":
            line += (
                f"; link bytes per 1,000 changes: up {p['link_bytes_up_per_1000_changes']:,}, "
                f"down {p['link_bytes_down_per_1000_changes']:,} "
                f"(observed delay {p['link_observed_delay_ms']:.0f} ms)"
            )
        if p["forwarder_batch_ms"]:
            line += "; forwarder batches: " + ", ".join(
                f"{k} {v:.0f}" for k, v in p["forwarder_batch_ms"].items()
            )
        print(line)
    by_name = {p["phase"]: p for p in report["phases"]}
    if set(by_name) != {"single", "link", "raw"}:
        return
    single, link, raw = by_name["single"], by_name["link"], by_name["raw"]
    print(
        f"link p99 - single p99 = "
        f"{link['commit_to_redis_p99_ms'] - single['commit_to_redis_p99_ms']:.0f} ms "
        f"(target p99 < 1000 ms; stretch: within {args.delay_ms:.0f} + 150 ms of single)"
    )
    ratio = raw["link_bytes_up_per_1000_changes"] / max(link["link_bytes_up_per_1000_changes"], 1)
    print(f"zstd: {ratio:.1f}x fewer bytes up the link than none (target >= 3x)")


if __name__ == "__main__":
    main()
