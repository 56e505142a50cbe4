"""Idle cost at the edge (quoted in docs/benchmarks.md).

The demo stack (examples/edgefeed.yaml: Tansu, PostgreSQL, Kafka Connect with
the Debezium connector, a Redis per region, the router and one feature worker
per region) is started on free ports, seeded with the demo shop's rows, and left
without traffic. Each process's CPU time (user + system, from /proc) is read
before and after a quiet window (60 s by default): CPU seconds used, and the
share of one core. Target: an idle regional worker and the router each under 1%
of a core.

CPU time is what a process asked of the machine, so it barely moves with the
machine's other load, unlike latencies; the same run can be repeated with
another tree (``PYTHONPATH=<tree>``) for a before/after.

    .venv/bin/python benchmarks/idle.py               # ~3 minutes
    .venv/bin/python benchmarks/idle.py --seconds 10  # a quick look
    .venv/bin/python benchmarks/idle.py --rate 500 --load-s 60  # then a load: CPU, peak memory

The resident memory of each process tree is reported at idle, and with
``--rate`` its peak (VmHWM) and CPU share under the demo shop's load: the
figures docs/deploy.md sizes the containers' requests and limits from.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# This folder holds files named like the packages they measure: keep it off the path.
_HERE = str(Path(__file__).resolve().parent)
sys.path[:] = [p for p in sys.path if p not in ("", _HERE)]

import psycopg  # noqa: E402

from connectors import deploy  # noqa: E402
from connectors.client import ConnectClient  # noqa: E402
from edgefeed.devstack import DevStack  # noqa: E402
from edgefeed.devstack.ports import free_ports  # noqa: E402
from edgefeed.devstack.process import read_pid  # noqa: E402
from edgefeed.settings import load_settings  # noqa: E402
from edgefeed.shopload import ShopLoad, apply_schema  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EDGEFEED = str(Path(sys.executable).with_name("edgefeed"))
TARGET_SHARE = 0.01  # of one core, for the router and each regional worker
_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and of its children it waited for."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(value) for value in fields[11:15]) / _TICKS


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants (PostgreSQL forks a process per connection)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return found


def tree_cpu(pid: int) -> float:
    total = 0.0
    for member in tree(pid):
        try:
            total += cpu_seconds(member)
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return total


def tree_memory(pid: int) -> tuple[float, float]:
    """Resident MB of ``pid``'s tree now, and the sum of its members' peaks (VmHWM)."""
    rss = peak = 0.0
    for member in tree(pid):
        try:
            status = Path(f"/proc/{member}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        rss += int(fields.get("VmRSS", "0 kB").split()[0]) / 1024
        peak += int(fields.get("VmHWM", "0 kB").split()[0]) / 1024
    return round(rss, 1), round(peak, 1)


def load(settings: Any, rate: float, seconds: float) -> int:
    """The demo shop's changes at ``rate`` per second for ``seconds``; how many."""
    shop = ShopLoad(settings.database.dsn(), settings.region_names)
    written, tick = 0, 0.1
    with psycopg.connect(settings.database.dsn(), autocommit=True) as conn:
        ends = time.monotonic() + seconds
        while time.monotonic() < ends:
            started = time.monotonic()
            shop.write(conn, max(1, int(rate * tick)))
            written += max(1, int(rate * tick))
            time.sleep(max(0.0, tick - (time.monotonic() - started)))
    return written


def measure(
    settings_path: Path,
    state: Path,
    seconds: float,
    settle_s: float,
    rate: float = 0.0,
    load_s: float = 0.0,
) -> dict[str, Any]:
    ports = free_ports(6)
    env = {
        "EDGEFEED_BROKER_PORT": str(ports[0]),
        "EDGEFEED_CONNECT_PORT": str(ports[1]),
        "EDGEFEED_PG_PORT": str(ports[2]),
        "EDGEFEED_REDIS_EU_PORT": str(ports[3]),
        "EDGEFEED_REDIS_US_PORT": str(ports[4]),
        "EDGEFEED_REDIS_AP_PORT": str(ports[5]),
        "EDGEFEED_PG_PASSWORD": "bench-idle",
    }
    os.environ.update(env)  # the apps read the same settings file
    settings = load_settings(settings_path, env=env)
    stack = DevStack(settings, state / "stack")
    try:
        stack.up()
        apply_schema(settings.database.dsn())
        with ConnectClient(settings.connect.url, timeout_s=30) as client:
            deploy.apply(client, settings.database, settings.sources, wait_s=180)
        ShopLoad(settings.database.dsn(), settings.region_names).seed_rows()
        base = [
            EDGEFEED,
            "--settings",
            str(settings_path),
            "pipeline",
            "run",
            "--loglevel",
            "info",  # "Ready" is an info line
        ]
        apps = ["router", *settings.region_names]
        for app in apps:
            role = ["--role", "router"] if app == "router" else ["--region", app]
            stack.start_app(app, [*base, *role], ready="Worker]: Ready", timeout_s=240)
        # Start-up work (recovery, the seeded rows, the first checkpoint) is over
        # well within the settle time; what follows is the steady idle cost.
        time.sleep(settle_s)
        pids: dict[str, int] = {}
        for app in apps:
            record = read_pid(stack.pid_path(f"app-{app}"))
            if record is not None:
                pids[app] = record.pid
        for service in stack.services:
            record = read_pid(stack.pid_path(service.name))
            if record is not None:
                pids[service.name] = record.pid
        before = {name: tree_cpu(pid) for name, pid in pids.items()}
        started = time.monotonic()
        time.sleep(seconds)
        elapsed = time.monotonic() - started
        after = {name: tree_cpu(pid) for name, pid in pids.items()}
        idle_memory = {name: tree_memory(pid)[0] for name, pid in pids.items()}
        loaded: dict[str, dict[str, float]] = {}
        written = 0
        if rate > 0 and load_s > 0:
            # Then a load, for the sizing of containers (docs/deploy.md): CPU share
            # and peak resident memory of each process under it.
            cpu_before = {name: tree_cpu(pid) for name, pid in pids.items()}
            started = time.monotonic()
            written = load(settings, rate, load_s)
            time.sleep(settle_s / 4)  # the pipeline drains what the load wrote
            span = time.monotonic() - started
            for name, pid in pids.items():
                loaded[name] = {
                    "core_share": round((tree_cpu(pid) - cpu_before[name]) / span, 4),
                    "peak_mb": tree_memory(pid)[1],
                }
    finally:
        stack.down()
    rows: dict[str, dict[str, Any]] = {}
    for name in pids:
        used = after[name] - before[name]
        rows[name] = {
            "cpu_s": round(used, 3),
            "core_share": round(used / elapsed, 4),
            "rss_mb": idle_memory[name],
            **({"load": loaded[name]} if name in loaded else {}),
        }
    return {
        "seconds": round(elapsed, 1),
        "processes": rows,
        "apps": apps,
        "load": {"rate": rate, "seconds": load_s, "changes": written} if loaded else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="the quiet window")
    parser.add_argument("--settle", type=float, default=20.0, help="seconds after start-up")
    parser.add_argument(
        "--settings", type=Path, default=ROOT / "examples" / "edgefeed.yaml", help="settings"
    )
    parser.add_argument(
        "--rate", type=float, default=0.0, help="then a load of this many changes/s (0: none)"
    )
    parser.add_argument("--load-s", type=float, default=60.0, help="seconds of that load")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args()
    state = Path(tempfile.mkdtemp(prefix="edgefeed-bench-idle-"))
    state.chmod(0o755)
    try:
        report = measure(
            args.settings.resolve(), state, args.seconds, args.settle, args.rate, args.load_s
        )
    finally:
        shutil.rmtree(state, ignore_errors=True)
    report["machine"] = (
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    )
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"machine: {report['machine']}")
    print(f"CPU over {report['seconds']} s without traffic (share of one core):")
    for name, row in report["processes"].items():
        target = name in report["apps"]
        verdict = ""
        if target:
            verdict = "  ok" if row["core_share"] < TARGET_SHARE else "  OVER the 1% target"
        print(
            f"  {name:22s} {row['cpu_s']:7.2f} s  {100 * row['core_share']:5.2f}%"
            f"  {row['rss_mb']:7.1f} MB{verdict}"
        )
    if report["load"]:
        load = report["load"]
        print(
            f"under {load['changes']} changes at {load['rate']:.0f}/s for {load['seconds']:.0f} s"
            " (share of one core, peak resident MB of the process tree):"
        )
        for name, row in report["processes"].items():
            print(
                f"  {name:22s} {100 * row['load']['core_share']:6.1f}%"
                f"  {row['load']['peak_mb']:7.1f} MB"
            )


if __name__ == "__main__":
    main()
