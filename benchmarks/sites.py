"""Benchmark of a region behind a WAN link (quoted in docs/benchmarks.md).

Freshness, PostgreSQL commit -> the region's Redis, p50 and p99, at a steady
rate of changes (2,000/s by default, the demo load generator), with Debezium,
the router and one regional worker, in three phases of one run on one stack:

    single   the region shares the central broker (no link): the baseline;
    link     the region has its own broker behind a 100 ms one-way link, fed by
             its forwarder with zstd-compressed batches;
    raw      the same link, the forwarder without compression;
    serial   (only when asked for) the link phase with the forwarder sending one
             batch per round trip, as before it was pipelined;
    partition (only when asked for, and alone) every region a site behind its link
             (eu-west 100 ms, us-east 50 ms, ap-southeast 60 ms one way), a router,
             a forwarder and a worker per region, a steady load (500 changes/s
             unless --rate says otherwise) and, after ``--warmup-s`` (60 s), in
             turns, a no-cut window and a window with central <-> eu-west cut
             (``--seconds`` each, ``--rounds`` pairs, then a closing no-cut
             window): us-east's and ap-southeast's freshness p50/p99 in each
             window and the p99 ratio of each cut window to the no-cut window
             before it and to the mean of the two around it, eu-west's seconds
             behind as the exporter and ``edgefeed lag`` show it, what
             eu-west's lookup client serves during the cut, the time from the
             heal to caught up, and the verify result once the load has
             stopped.

Each phase has its own connector, topics and consumer groups, so none inherits
another's backlog. For the linked phases, the bytes that crossed the link in
each direction while the load ran, per 1,000 source changes.

    .venv/bin/python benchmarks/sites.py             # ~4 minutes
    .venv/bin/python benchmarks/sites.py --smoke     # a short run that checks it works
    .venv/bin/python benchmarks/sites.py --phases partition            # ~7 minutes (--smoke: ~2)
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
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
from connectors.database import drop_slot  # noqa: E402
from edgefeed.cli.demo_sites import caught_up  # noqa: E402
from edgefeed.devstack import DevStack  # noqa: E402
from edgefeed.lookup import feature_client  # noqa: E402
from edgefeed.settings import settings_from_mapping  # noqa: E402
from edgefeed.shopload import ShopLoad, apply_schema  # noqa: E402
from edgefeed.verify import verify  # noqa: E402
from edgefeed.wan import WanControl  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_pipeline", Path(_HERE) / "pipeline.py")
assert _spec is not None and _spec.loader is not None
bench_pipeline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_pipeline)

EDGEFEED = str(Path(sys.executable).with_name("edgefeed"))
LINK = "central-eu-west"
# The partition phase's sites: the example's one-way delays (examples/edgefeed-sites.yaml).
SITE_DELAYS_MS = {"eu-west": 100.0, "us-east": 50.0, "ap-southeast": 60.0}


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


def partition_mapping(tag: str, delay_ms: float) -> dict[str, Any]:
    """Every region a site of its own behind its link, each with its own Redis."""
    mapping: dict[str, Any] = bench_pipeline.make_settings(partitions=2, tag=tag)
    free_port = bench_pipeline.free_port
    example = yaml.safe_load((Path(_HERE).parent / "examples" / "edgefeed.yaml").read_text())
    mapping["regions"] = [
        {**region, "redis_url": f"redis://127.0.0.1:{free_port()}/0", "failover": []}
        for region in example["regions"]
    ]
    delays = {**SITE_DELAYS_MS, "eu-west": delay_ms}
    mapping["sites"] = {
        "regions": {
            region["name"]: {
                "bootstrap_servers": f"127.0.0.1:{free_port()}",
                "link": {"listen_port": free_port(), "delay_ms": delays[region["name"]]},
            }
            for region in mapping["regions"]
        }
    }
    mapping["pipeline"] = {
        **mapping["pipeline"],
        "app_prefix": f"bench-{tag}-partition",
        "region_topic_prefix": f"bench.{tag}.partition",
        "dead_letter_topic": f"bench.{tag}.partition.deadletter",
    }
    mapping["sources"] = [{**mapping["sources"][0], "name": f"bench_{tag}_partition"}]
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
    phase: str,
    mapping: dict[str, Any],
    state: Path,
    stack: DevStack,
    rate: float,
    seconds: float,
    smoke: bool = False,
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
            apps = [
                (f"{phase}-router", [*base, "--role", "router"], "Worker]: Ready"),
                (
                    f"{phase}-eu-west",
                    [*base, "--region", "eu-west", "--metrics-port", str(port)],
                    "Worker]: Ready",
                ),
            ]
            if phase != "single":
                apps.insert(
                    1,
                    (
                        f"{phase}-forward",
                        [*base, "--role", "forwarder", "--region", "eu-west"],
                        "forwarder ready",
                    ),
                )
            bench_pipeline.start_apps(stack, apps)
            load = ShopLoad(settings.database.dsn(), settings.region_names)
            load.seed_rows()
            # The seed's vectors are written before the load starts, in every phase:
            # across the link they arrive as one forwarded burst, and a worker still
            # applying it when the load starts would count as the link's delay.
            settled(port)
            before_link = {link["name"]: link for link in wan.status()}[LINK]
            before = freshness_buckets(port)
            result = load.run(rate, seconds)
            if not smoke:  # (the waits for quiet below drain it too)
                time.sleep(3.0)  # drain
            if phase != "single":
                link_quiet(wan)  # every change has crossed: the bytes are all counted
            settled(port)
            after_link = {link["name"]: link for link in wan.status()}[LINK]
            timings = (
                # a smoke run takes the last logged line rather than wait for the next
                forwarder_timings(stack, f"{phase}-forward", wait=not smoke)
                if phase != "single"
                else {}
            )
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


# -- partition: central <-> eu-west cut under load, the other regions watched ----------------


class SteadyLoad:
    """The shop load at ``rate`` on a thread, in 2 s runs, until stopped."""

    def __init__(self, load: ShopLoad, rate: float) -> None:
        self.load, self.rate = load, rate
        self.changes, self.seconds = 0, 0.0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="bench-load")

    def _run(self) -> None:
        while not self.stop.is_set():
            progress = self.load.run(self.rate, 2.0)
            self.changes += progress.changes
            self.seconds += progress.elapsed_s

    def __enter__(self) -> SteadyLoad:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=60)


class ExporterWatch:
    """Samples the exporter once a second: eu-west's seconds behind and its link's state."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.samples: list[tuple[float, float | None, float | None]] = []  # (t, behind, up)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="bench-exporter")

    def _run(self) -> None:
        while not self.stop.wait(1.0):
            try:
                behind = bench_pipeline.scrape(self.port, "edgefeed_region_behind_seconds")
                up = bench_pipeline.scrape(self.port, "edgefeed_link_up")
            except OSError:
                continue
            self.samples.append(
                (
                    time.monotonic(),
                    next((v for k, v in behind.items() if 'region="eu-west"' in k), None),
                    next((v for k, v in up.items() if f'link="{LINK}"' in k), None),
                )
            )

    def between(self, start: float, end: float) -> list[tuple[float, float | None, float | None]]:
        return [s for s in self.samples if start <= s[0] <= end]

    def __enter__(self) -> ExporterWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=30)


class Timeline:
    """Where the time goes: each region's freshness histogram and the machine's load
    average, read every ``step_s``, so a window's slow vectors can be placed in time."""

    def __init__(self, ports: dict[str, int], run_dir: Path, step_s: float = 2.0) -> None:
        self.ports, self.run_dir, self.step_s = ports, run_dir, step_s
        self.points: list[tuple[float, float, dict[str, dict[float, float]]]] = []
        self.cpu: list[tuple[float, dict[str, float]]] = []  # (t, process -> CPU seconds)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="bench-timeline")

    def _run(self) -> None:
        while not self.stop.wait(self.step_s):
            try:
                found = {r: freshness_buckets(port, r) for r, port in self.ports.items()}
            except OSError:
                continue
            load1 = float(Path("/proc/loadavg").read_text().split()[0])
            self.points.append((time.monotonic(), load1, found))
            self.cpu.append((time.monotonic(), stack_cpu(self.run_dir)))

    def cpu_between(self, start: float, end: float) -> dict[str, float]:
        """CPU seconds each of the stack's processes (with its children) used in a window."""
        inside = [c for c in self.cpu if start <= c[0] <= end]
        if len(inside) < 2:
            return {}
        first, last = inside[0][1], inside[-1][1]
        used = {name: last[name] - first[name] for name in last if name in first}
        return {name: round(v, 1) for name, v in sorted(used.items(), key=lambda kv: -kv[1])}

    def window(self, start: float, end: float, region: str) -> dict[str, Any]:
        """The slowest step of a window (its p99, and when, from the window's start),
        and the load average's range over the window."""
        inside = [p for p in self.points if start <= p[0] <= end]
        worst, at = 0.0, 0.0
        for (_t0, _l0, before), (t1, _l1, after) in itertools.pairwise(inside):
            p99 = delta_quantiles(before[region], after[region], (0.99,))["p99_ms"]
            if p99 == p99 and p99 > worst:  # not NaN (no vector in the step)
                worst, at = p99, t1 - start
        loads = [p[1] for p in inside]
        return {
            "worst_step_p99_ms": round(worst),
            "worst_step_at_s": round(at, 1),
            "load1": [min(loads, default=0.0), max(loads, default=0.0)],
        }

    def __enter__(self) -> Timeline:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=30)


def stack_cpu(run_dir: Path) -> dict[str, float]:
    """CPU seconds (user + system) so far of each process with a pid file in the stack's
    run folder, its descendants included (a service may be a wrapper of its server)."""
    tick = os.sysconf("SC_CLK_TCK")
    parent, used = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        pid = int(stat.parent.name)
        parent[pid] = int(fields[1])
        used[pid] = (int(fields[11]) + int(fields[12])) / tick
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    found = {}
    for path in run_dir.glob("*.pid"):
        try:
            root = int(json.loads(path.read_text())["pid"])
        except (OSError, ValueError, KeyError):
            continue
        total, todo = 0.0, [root]
        while todo:
            pid = todo.pop()
            total += used.get(pid, 0.0)
            todo += children.get(pid, [])
        found[path.stem] = total
    return found


def region_freshness(settings: Any) -> dict[str, float | None]:
    """Each region's freshness now: now minus the newest vector's commit (as the demo)."""
    import asyncio

    from edgefeed.cli.demo_sites import _freshness

    return asyncio.run(_freshness(settings))


def lag_json(settings_file: Path, state_dir: Path) -> dict[str, Any]:
    """``edgefeed lag --json`` as an operator would run it (exit code: the severity's)."""
    result = subprocess.run(
        [EDGEFEED, "--settings", str(settings_file), "lag", "--json", "--samples", "1",
         "--state-dir", str(state_dir)],
        capture_output=True, timeout=120, check=False, text=True,
    )  # fmt: skip
    try:
        report: dict[str, Any] = json.loads(result.stdout)
    except json.JSONDecodeError:
        return {"error": result.stderr[-500:]}
    return report


def window_quantiles(
    before: dict[str, dict[float, float]], after: dict[str, dict[float, float]]
) -> dict[str, dict[str, float]]:
    return {
        region: {
            key: round(value, 1)
            for key, value in delta_quantiles(before[region], after[region], (0.5, 0.99)).items()
        }
        for region in after
    }


def run_partition(
    mapping: dict[str, Any],
    state: Path,
    stack: DevStack,
    rate: float,
    window_s: float,
    rounds: int,
    warmup_s: float,
    smoke: bool = False,
) -> dict[str, Any]:
    """No-cut and cut windows in turns under one steady load; see the module docstring."""
    settings = settings_from_mapping(mapping)
    settings_file = state / "edgefeed-partition.yaml"
    settings_file.write_text(yaml.safe_dump(mapping))
    source = settings.sources[0]
    regions = settings.region_names
    others = [r for r in regions if r != "eu-west"]
    ports = {region: bench_pipeline.free_port() for region in regions}
    exporter_port = bench_pipeline.free_port()
    base = [EDGEFEED, "--settings", str(settings_file), "pipeline", "run", "--loglevel", "info"]
    wan = WanControl(stack.wan_control_path)
    apps = ["exporter", "router", *(f"forward-{r}" for r in regions), *regions]
    report: dict[str, Any] = {"phase": "partition", "windows": [], "cuts": []}

    def buckets() -> dict[str, dict[float, float]]:
        return {region: freshness_buckets(ports[region], region) for region in regions}

    with ConnectClient(settings.connect.url, timeout_s=30) as client:
        deploy.apply(client, settings.database, settings.sources, wait_s=120)
        try:
            bench_pipeline.start_apps(
                stack,
                [
                    ("partition-router", [*base, "--role", "router"], "Worker]: Ready"),
                    *(
                        (
                            f"partition-forward-{region}",
                            [*base, "--role", "forwarder", "--region", region],
                            "forwarder ready",
                        )
                        for region in regions
                    ),
                    *(
                        (
                            f"partition-{region}",
                            [*base, "--region", region, "--metrics-port", str(ports[region])],
                            "Worker]: Ready",
                        )
                        for region in regions
                    ),
                ],
            )
            # The exporter once the pipeline runs, as an operator would start it.
            bench_pipeline.start_apps(
                stack,
                [
                    (
                        "partition-exporter",
                        [EDGEFEED, "--settings", str(settings_file), "exporter", "--port",
                         str(exporter_port), "--interval", "1", "--state-dir",
                         str(stack.state_dir)],
                        "serving metrics",
                    ),
                ],
            )  # fmt: skip
            load = ShopLoad(settings.database.dsn(), regions)
            load.seed_rows()
            settled(ports)  # every region, watched together
            with (
                SteadyLoad(load, rate) as steady,
                ExporterWatch(exporter_port) as watch,
                Timeline({r: ports[r] for r in others}, stack.state_dir / "run") as timeline,
            ):
                # The first minute of load is the slowest (every region, cut or not, in
                # the first runs): the windows start once the load is steady.
                time.sleep(warmup_s)
                for _ in range(rounds):
                    start, calm_at = buckets(), time.monotonic()
                    time.sleep(window_s)
                    middle, calm_end = buckets(), time.monotonic()
                    calm_lookups = lookups(settings, load)  # the same bound, link up
                    wan.cut(LINK)
                    cut_at = time.monotonic()
                    time.sleep(window_s)
                    end = buckets()
                    cut_end = time.monotonic()
                    # What an operator and a client see at the end of the cut (the
                    # cut window's quantiles are already taken).
                    lag = lag_json(settings_file, stack.state_dir)
                    stale = lookups(settings, load)
                    wan.heal(LINK)
                    healed_at = time.monotonic()
                    took = None
                    while time.monotonic() - healed_at < 300:
                        if caught_up(region_freshness(settings), "eu-west", 2.0):
                            took = time.monotonic() - healed_at
                            break
                        time.sleep(0.5)
                    during = [b for _t, b, _up in watch.between(cut_at, healed_at) if b is not None]
                    lag_eu: dict[str, Any] = next(
                        (r for r in lag.get("regions", []) if r["region"] == "eu-west"), {}
                    )
                    lag_link: dict[str, Any] = next(
                        (x for x in lag.get("links", []) if x["name"] == LINK), {}
                    )
                    for is_cut, first, last, began, ended in (
                        (False, start, middle, calm_at, calm_end),
                        (True, middle, end, cut_at, cut_end),
                    ):
                        report["windows"].append(
                            {
                                "cut": is_cut,
                                "regions": window_quantiles(first, last),
                                "where": {r: timeline.window(began, ended, r) for r in others},
                                "cpu_s": timeline.cpu_between(began, ended),
                            }
                        )
                    report["cuts"].append(
                        {
                            "cut_s": round(cut_end - cut_at, 1),
                            "exporter_behind_s_max": round(max(during, default=0.0), 1),
                            "exporter_link_up_during_cut": sorted(
                                {
                                    up
                                    for _t, _b, up in watch.between(cut_at + 2, cut_end)
                                    if up is not None
                                }
                            ),
                            "lag_link_state": lag_link.get("state"),
                            "lag_link_cut_for_s": lag_link.get("cut_for_s"),
                            "lag_eu_west_behind_s": lag_eu.get("behind_seconds"),
                            "lag_problems": lag.get("problems", lag.get("error")),
                            "lookups_before_cut": calm_lookups,
                            "lookups_at_cut_end": stale,
                            "heal_to_caught_up_s": None if took is None else round(took, 1),
                        }
                    )
                    # eu-west's catch-up burst is not the next no-cut window's (a smoke
                    # run asserts no timing)
                    time.sleep(1.0 if smoke else 5.0)
                # A closing no-cut window, so that every cut window has a no-cut window on
                # each side: on Tansu every window is slower than the one before it (the
                # broker pays for a partition's whole length on each fetch), and a cut
                # compared only with the window before it carries that drift.
                first, began = buckets(), time.monotonic()
                time.sleep(window_s)
                last, ended = buckets(), time.monotonic()
                report["windows"].append(
                    {
                        "cut": False,
                        "regions": window_quantiles(first, last),
                        "where": {r: timeline.window(began, ended, r) for r in others},
                        "cpu_s": timeline.cpu_between(began, ended),
                    }
                )
            report["rate_written"] = round(steady.changes / max(steady.seconds, 1e-9), 1)
            report["changes"] = steady.changes
            settled(ports)  # every region, watched together
            started = time.monotonic()
            result = verify(settings, regions)
            while not result.ok and time.monotonic() - started < 180:
                time.sleep(2.0)
                result = verify(settings, regions)
            report["verify"] = {
                "ok": result.ok,
                "checked": result.checked,
                "mismatches": len(result.mismatches),
                "after_load_s": round(time.monotonic() - started, 1),
            }
            report["forwarder_batch_ms"] = {
                region: forwarder_timings(stack, f"partition-forward-{region}", wait=False)
                for region in regions
            }
        finally:
            for app in reversed(apps):
                stack.stop_app(f"partition-{app}")
            client.delete(source.connector_name)
    with psycopg.connect(settings.database.dsn(), autocommit=True) as conn:
        drop_slot(conn, source.effective_slot_name)
    cut = [w for w in report["windows"] if w["cut"]]
    calm = [w for w in report["windows"] if not w["cut"]]
    report["ratios_p99"] = {
        region: [
            round(c["regions"][region]["p99_ms"] / max(n["regions"][region]["p99_ms"], 1e-9), 2)
            for n, c in zip(calm, cut, strict=False)
        ]
        for region in others
    }
    # Each cut window against the mean of the no-cut windows on either side of it.
    report["ratios_p99_bracketed"] = {
        region: [
            round(
                c["regions"][region]["p99_ms"]
                / max((b["regions"][region]["p99_ms"] + a["regions"][region]["p99_ms"]) / 2, 1e-9),
                2,
            )
            for b, c, a in zip(calm, cut, calm[1:], strict=False)
        ]
        for region in others
    }
    return report


def lookups(settings: Any, load: ShopLoad, max_staleness_s: float = 5.0) -> dict[str, int]:
    """eu-west's own users through eu-west's lookup client: served without a bound,
    withheld as stale with ``max_staleness_s``."""
    users = [u for u in range(1, load.users + 1) if load.home_region(u) == "eu-west"]
    with feature_client(settings, "eu-west", timeout_s=5) as client:
        plain = client.get("user", users)
        bounded = client.get("user", users, max_staleness=max_staleness_s)
    return {
        "users": len(users),
        "found": int(plain.found.sum()),
        "found_within_bound": int(bounded.found.sum()),
        "stale_withheld": int(bounded.stale.sum()),
        "max_staleness_s": int(max_staleness_s),
    }


def forwarder_timings(stack: DevStack, app: str, wait: bool = True) -> dict[str, float]:
    """The forwarder's last logged batch timings (p50/p99 of its recent batches)."""
    if wait:
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


def freshness_buckets(port: int, region: str = "eu-west") -> dict[float, float]:
    """The region's commit -> Redis histogram: upper bound (s) -> cumulative count."""
    samples = bench_pipeline.scrape(port, "edgefeed_pipeline_freshness_seconds_bucket")
    return {
        (float("inf") if 'le="+Inf"' in key else float(key.split('le="')[1].split('"')[0])): value
        for key, value in samples.items()
        if f'region="{region}"' in key
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


def settled(
    port: int | dict[str, int],
    quiet_s: float = 3.0,
    limit_s: float = 180.0,
    region: str = "eu-west",
) -> None:
    """Wait until the worker has written no vector for ``quiet_s`` (it applied all it had);
    given ``{region: port}``, until every region's worker has (watched together)."""
    ports = port if isinstance(port, dict) else {region: port}
    deadline = time.monotonic() + limit_s
    last = dict.fromkeys(ports, -1.0)
    since = dict.fromkeys(ports, time.monotonic())
    while time.monotonic() < deadline:
        for name, metrics_port in ports.items():
            count = max(freshness_buckets(metrics_port, name).values(), default=0.0)
            if count != last[name]:
                last[name], since[name] = count, time.monotonic()
        if all(time.monotonic() - at >= quiet_s for at in since.values()):
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a short run that checks it works")
    parser.add_argument(
        "--rate", type=float, default=None, help="changes per second (2,000; partition: 500)"
    )
    parser.add_argument(
        "--seconds", type=float, default=30.0, help="seconds of load per phase (partition: window)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="partition: no-cut/cut window pairs")
    parser.add_argument(
        "--warmup-s", type=float, default=60.0, help="partition: load before the first window"
    )
    parser.add_argument("--delay-ms", type=float, default=100.0, help="one-way link delay")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    parser.add_argument(
        "--phases", default="single,link,raw", help="which phases, comma-separated, in order"
    )
    args = parser.parse_args()
    phases = args.phases.split(",")
    partition = "partition" in phases
    if partition and phases != ["partition"]:
        # Its regions' caches are verified against every row of the source: no other
        # phase may have written to them.
        parser.error("the partition phase runs alone: --phases partition")
    if args.rate is None:
        args.rate = 500.0 if partition else 2000.0
    if args.smoke:
        args.rate, args.seconds, args.rounds = 200.0, (8.0 if partition else 3.0), 1
        args.warmup_s = 5.0
    tag = f"{os.getpid()}"
    state = Path(tempfile.mkdtemp(prefix="edgefeed-bench-sites-"))
    state.chmod(0o755)
    base = partition_mapping(tag, args.delay_ms) if partition else base_mapping(tag, args.delay_ms)
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
        if partition:
            report["phases"].append(
                run_partition(
                    base,
                    state,
                    stack,
                    args.rate,
                    args.seconds,
                    args.rounds,
                    args.warmup_s,
                    smoke=args.smoke,
                )
            )
        for phase in [] if partition else phases:
            mapping = phase_mapping(base, phase, tag)
            report["phases"].append(
                run_phase(phase, mapping, state, stack, args.rate, args.seconds, args.smoke)
            )
    finally:
        stack.down()
        if not os.environ.get("EDGEFEED_BENCH_KEEP"):
            shutil.rmtree(state, ignore_errors=True)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    if partition:
        print_partition(report, args.seconds)
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


def print_partition(report: dict[str, Any], window_s: float) -> None:
    (p,) = report["phases"]
    print(
        f"machine: {report['machine']}; partition: {p['rate_written']:.0f} changes/s written, "
        f"{window_s:.0f} s windows, central <-> eu-west cut in every second window"
    )
    for i, window in enumerate(p["windows"]):
        parts = [
            f"{region} p50 {q['p50_ms']:.0f} / p99 {q['p99_ms']:.0f} ms ({q['count']:.0f} vectors)"
            for region, q in window["regions"].items()
        ]
        print(f"  window {i + 1} ({'cut' if window['cut'] else 'no cut'}): " + "; ".join(parts))
        top = list(window["cpu_s"].items())[:8]
        print("    CPU seconds: " + ", ".join(f"{name} {v:.1f}" for name, v in top))
        for region, where in window["where"].items():
            print(
                f"    {region}: slowest 2 s step p99 "
                f"{where['worst_step_p99_ms']} ms at +{where['worst_step_at_s']} s; "
                f"load average {where['load1'][0]:.1f}-{where['load1'][1]:.1f}"
            )
    for region, ratios in p["ratios_p99"].items():
        shown = ", ".join(f"{r:.2f}x" for r in ratios)
        print(f"  {region}: p99 cut / no cut = {shown} (target <= 1.20x)")
    for region, ratios in p.get("ratios_p99_bracketed", {}).items():
        shown = ", ".join(f"{r:.2f}x" for r in ratios)
        print(f"  {region}: p99 cut / mean of the no-cut windows before and after = {shown}")
    for i, cut in enumerate(p["cuts"]):
        print(
            f"  cut {i + 1} ({cut['cut_s']:.0f} s): exporter eu-west behind max "
            f"{cut['exporter_behind_s_max']:.1f} s, link up values "
            f"{cut['exporter_link_up_during_cut']}; "
            f"lag: link {cut['lag_link_state']} for {cut['lag_link_cut_for_s']} s, eu-west "
            f"{cut['lag_eu_west_behind_s'] or 0:.1f} s behind; lookups before the cut "
            f"{cut['lookups_before_cut']}, at its end {cut['lookups_at_cut_end']}; "
            f"heal -> caught up {cut['heal_to_caught_up_s']} s"
        )
    v = p["verify"]
    print(
        f"  verify after the load: {'equal' if v['ok'] else 'NOT equal'} "
        f"({sum(v['checked'].values())} vectors, {v['mismatches']} mismatches, "
        f"{v['after_load_s']:.0f} s after the load stopped)"
    )
    print(f"  forwarder batches (last logged, ms): {p['forwarder_batch_ms']}")


if __name__ == "__main__":
    main()
