"""The latency lab as a benchmark (quoted in docs/benchmarks.md and docs/latency-lab.md).

Starts PostgreSQL and eu-west's Redis of a local stack on free ports in a
temporary folder, runs ``edgefeed lab run`` against them (Central, Edge without
cache, Edge with edgefeed, interleaved; then the image path), prints the tables
and the target: Edge with edgefeed's T_total p50 at most 1/3 of Central's (the
case study: 110/350 = 0.31). Stops the stack and removes the folder.

    .venv/bin/python benchmarks/lab.py                  # ~3 minutes
    .venv/bin/python benchmarks/lab.py --requests 20 --image-requests 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

# This folder holds pipeline.py, named like the package: drop it from the path.
_HERE = str(Path(__file__).resolve().parent)
sys.path[:] = [p for p in sys.path if p not in ("", _HERE)]

import yaml  # noqa: E402

from edgefeed.devstack import DevStack  # noqa: E402
from edgefeed.devstack.ports import free_ports  # noqa: E402
from edgefeed.settings import settings_from_mapping  # noqa: E402

EDGEFEED = str(Path(sys.executable).with_name("edgefeed"))
REGIONS = (("eu-west", "eu"), ("us-east", "us"), ("ap-southeast", "apac"))


def settings_mapping() -> dict[str, Any]:
    broker, connect, pg, *redis = free_ports(3 + len(REGIONS))
    return {
        "kafka": {"bootstrap_servers": f"127.0.0.1:{broker}"},
        "connect": {"url": f"http://127.0.0.1:{connect}"},
        "database": {
            "host": "127.0.0.1",
            "port": pg,
            "dbname": "edgefeed",
            "user": "postgres",
            "password": "edgefeed-bench",
        },
        "regions": [
            {
                "name": name,
                "redis_url": f"redis://127.0.0.1:{port}/0",
                "residency_zone": zone,
                "failover": [other for other, _ in REGIONS if other != name],
            }
            for (name, zone), port in zip(REGIONS, redis, strict=True)
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=150, help="per ranking topology")
    parser.add_argument("--image-requests", type=int, default=12, help="per image topology")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args()
    state = Path(tempfile.mkdtemp(prefix="edgefeed-bench-lab-"))
    state.chmod(0o755)  # PostgreSQL runs as 'postgres' when this runs as root
    mapping = settings_mapping()
    settings_file = state / "edgefeed.yaml"
    settings_file.write_text(yaml.safe_dump(mapping))
    stack = DevStack(
        settings_from_mapping(mapping),
        state / "stack",
        with_connect=False,
        only=["postgres", "redis-eu-west"],
    )
    try:
        stack.up()
        completed = subprocess.run(
            [
                EDGEFEED,
                "--settings",
                str(settings_file),
                "lab",
                "run",
                "--no-start-stack",
                "--requests",
                str(args.requests),
                "--image-requests",
                str(args.image_requests),
                "--report",
                str(state / "latency-lab.html"),
                "--json",
            ],
            check=True,
            capture_output=True,
            text=True,
        )
    finally:
        stack.down()
        keep = os.environ.get("EDGEFEED_BENCH_KEEP")
        if not keep:
            shutil.rmtree(state, ignore_errors=True)
    report = json.loads(completed.stdout)
    report["machine"] = (
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    )
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"machine: {report['machine']}")
    for summary in report["ranking"] + report["images"]:
        terms = summary["terms_ms"]
        print(
            f"{summary['key']:>15}: T_total p50 {terms['total']['p50']:7.1f} ms "
            f"(network {terms['network']['p50']:.1f}, data {terms['data']['p50']:.1f}, "
            f"model {terms['model']['p50']:.2f}, service {terms['service']['p50']:.2f}); "
            f"p99 {terms['total']['p99']:.1f} ms; {summary['wire_bytes_per_request']:,.0f} B/req"
        )
    ratio = report["edge_over_central_p50"]
    verdict = "met" if ratio <= 1 / 3 else "NOT met"
    print(f"Edge with edgefeed / Central, T_total p50: {ratio:.3f} (target <= 0.333: {verdict})")
    print(f"models (held-out %): {report['accuracy']}")


if __name__ == "__main__":
    main()
