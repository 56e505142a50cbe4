"""A running pipeline on the session's stack: its own schema, connector, topics and workers.

The workers are real processes started with ``edgefeed pipeline run`` (the same
command operators use), so a test can kill -9 one and start it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml
from stackhelpers import drop_slot, unique_name

from connectors import deploy
from connectors.client import ConnectClient
from connectors.config import signal_table
from edgefeed.devstack import DevStack
from edgefeed.lookup import feature_client
from edgefeed.settings import EdgefeedSettings, settings_from_mapping
from monitoring.snapshots import read_notifications

ROOT = Path(__file__).resolve().parents[3]
EDGEFEED = str(Path(sys.executable).with_name("edgefeed"))
READY_S = 180  # a worker starting on a busy machine (Faust import, recovery): a deadline


@dataclass
class PipelineRun:
    """The pipeline under test and its worker processes."""

    settings: EdgefeedSettings
    settings_file: Path
    schema: str
    logs: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def table(self, name: str) -> str:
        return f"{self.schema}.{name}"

    def start(self, name: str, region: str | None = None, extra: Sequence[str] = ()) -> None:
        """Start ``router`` or a region's worker (``name``, or another worker of
        ``region`` called ``name``); returns once it reports ready."""
        self.wait_started(name, self.spawn(name, region, extra))

    def spawn(self, name: str, region: str | None = None, extra: Sequence[str] = ()) -> int:
        """Start the process as :meth:`start` does (with ``extra`` options of
        ``pipeline run``) without waiting; returns where its run begins in its log
        (for :meth:`wait_started`)."""
        args = ["--role", "router"] if name == "router" else ["--region", region or name]
        log = self.logs / f"{name}.log"
        offset = log.stat().st_size if log.exists() else 0
        with open(log, "ab") as out:
            self.procs[name] = subprocess.Popen(
                [
                    EDGEFEED,
                    "--settings",
                    str(self.settings_file),
                    "pipeline",
                    "run",
                    *args,
                    "--loglevel",
                    "info",
                    *extra,
                ],
                cwd=self.logs,  # Faust's data folder goes here, not into the checkout
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return offset

    def log_tail(self, name: str, chars: int = 3000) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")[-chars:]

    def wait_started(self, name: str, offset: int) -> None:
        """Wait until ``name``'s run, from ``offset`` of its log, reports ready."""
        log = self.logs / f"{name}.log"
        deadline = time.monotonic() + READY_S
        while time.monotonic() < deadline:
            text = log.read_bytes()[offset:].decode(errors="replace")
            if "Worker]: Ready" in text:
                return
            if self.procs[name].poll() is not None:
                raise AssertionError(f"{name} exited during start-up:\n{text[-3000:]}")
            time.sleep(0.2)
        raise AssertionError(f"{name} not ready in {READY_S} s:\n{log.read_text()[-3000:]}")

    def kill9(self, name: str) -> None:
        proc = self.procs.pop(name)
        _signal_group(proc, signal.SIGKILL)
        proc.wait()

    def stop_all(self) -> None:
        """Stop every process, however busy the machine: SIGTERM, then SIGKILL, and
        always reap (an unreaped child is a leak and a ResourceWarning)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                _signal_group(proc, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()  # SIGKILL cannot be ignored
        self.procs.clear()


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # already gone
        os.killpg(proc.pid, sig)


def shop_settings(stack_mapping: dict[str, Any], schema: str, tag: str) -> dict[str, Any]:
    """The example settings on the test stack, in schema ``schema`` with unique names."""
    text = (ROOT / "examples" / "edgefeed.yaml").read_text()
    example = yaml.safe_load(re.sub(r"\bpublic\.(users|items|events)\b", rf"{schema}.\1", text))
    mapping = dict(stack_mapping)
    source = example["sources"][0]
    source.update(name=tag, snapshot_mode="no_data")
    mapping["sources"] = [source]
    mapping["entities"] = example["entities"]
    mapping["pipeline"] = {
        **example["pipeline"],
        "partitions": 2,
        "app_prefix": f"ef-{tag}",
        "region_topic_prefix": f"ef.{tag}.region",
        "dead_letter_topic": f"ef.{tag}.deadletter",
    }
    return mapping


@contextlib.contextmanager
def shop_pipeline(
    mapping: dict[str, Any],
    schema: str,
    folder: Path,
    workers: list[str],
    *,
    seed: Callable[[psycopg.Connection[Any]], None] | None = None,
    wait_s: float = 240,
) -> Iterator[PipelineRun]:
    """The shop's tables in ``schema``, its connector, and ``workers`` running (started
    side by side); everything is stopped and dropped afterwards, even on failure.

    Args:
        seed: Writes rows before the connector exists (history it never streams).
    """
    settings = settings_from_mapping(mapping)
    settings_file = folder / "edgefeed.yaml"
    settings_file.write_text(yaml.safe_dump(mapping))
    ddl = (ROOT / "edgefeed" / "data" / "shop_schema.sql").read_text()
    source = settings.sources[0]
    with psycopg.connect(settings.database.dsn(), autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
        conn.execute(ddl.replace("public.", f"{schema}."))
        if seed is not None:
            seed(conn)
    client = ConnectClient(settings.connect.url, timeout_s=30)
    run = PipelineRun(settings, settings_file, schema, folder)
    try:
        deploy.apply(client, settings.database, settings.sources, wait_s=wait_s)
        # Side by side (as the sites' run starts them): their start-up waits overlap.
        offsets = {name: run.spawn(name) for name in workers}
        for name, offset in offsets.items():
            run.wait_started(name, offset)
        yield run
    finally:
        run.stop_all()
        client.delete(source.connector_name)
        with psycopg.connect(settings.database.dsn(), autocommit=True) as conn:
            drop_slot(conn, source.effective_slot_name, source.effective_publication)
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
            conn.execute(f"DROP TABLE IF EXISTS {signal_table(source)}")
        client.close()


@pytest.fixture(scope="module")
def pipeline_run(
    devstack: DevStack, stack_mapping: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PipelineRun]:
    tag = unique_name("e2e").lower()
    schema = f"s_{tag}"
    mapping = shop_settings(stack_mapping, schema, tag)
    regions = settings_from_mapping(mapping).region_names
    folder = tmp_path_factory.mktemp("pipeline")
    with shop_pipeline(mapping, schema, folder, ["router", *regions], wait_s=90) as run:
        yield run


SAMPLERS = range(9001, 9021)  # users whose views stream in (the freshness sampler's)
SAMPLE_EVERY_S = 0.05  # one streamed view per 50 ms, round robin over the samplers


class FreshnessSampler(threading.Thread):
    """Streams one view every ``SAMPLE_EVERY_S`` (round robin over ``SAMPLERS``) and
    times each from just before its insert to its count in the cache, read every 5 ms
    (a coarse poll would round the figures up to its period). Samples are
    ``(sent_wall_s, seconds)``, kept by the wall time of their insert so they can be
    placed against the snapshot's own notifications afterwards."""

    def __init__(self, settings: EdgefeedSettings, schema: str, region: str = "eu-west") -> None:
        super().__init__(name="freshness-sampler", daemon=True)
        self.settings = settings
        self.schema = schema
        self.region = region
        self.samples: list[tuple[float, float]] = []
        self.error: BaseException | None = None
        self._halt = threading.Event()
        self._lock = threading.Lock()
        self._pending: dict[int, list[tuple[int, float, float]]] = {u: [] for u in SAMPLERS}
        self._sent = dict.fromkeys(SAMPLERS, 0)

    @property
    def total_sent(self) -> int:
        with self._lock:
            return sum(self._sent.values())

    def wait_seen(self, until_wall: float, timeout_s: float) -> None:
        """Wait until every view inserted before ``until_wall`` was seen in the cache."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                late = [p for queue in self._pending.values() for p in queue if p[2] < until_wall]
            if not late:
                return
            if self.error is not None or time.monotonic() > deadline:
                raise AssertionError(f"{len(late)} streamed views not in the cache: {self.error}")
            time.sleep(0.05)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=60)
        if self.error is not None:
            raise self.error

    def run(self) -> None:
        poller = threading.Thread(target=self._poll, name="freshness-poller", daemon=True)
        poller.start()
        try:
            with psycopg.connect(self.settings.database.dsn(), autocommit=True) as conn:
                users = list(SAMPLERS)
                # Their users' rows first: a personal entity is served only while
                # its own row exists (docs/pipeline.md, "Deletes").
                for user in users:
                    conn.execute(
                        f"INSERT INTO {self.schema}.users (user_id, home_region, country, "
                        "segment, email) VALUES (%s, %s, 'XX', 1, 'sampler@example.org') "
                        "ON CONFLICT (user_id) DO NOTHING",
                        (user, self.region),
                    )
                turn = 0
                while not self._halt.wait(SAMPLE_EVERY_S):
                    user = users[turn % len(users)]
                    turn += 1
                    with self._lock:
                        self._sent[user] += 1
                        self._pending[user].append(
                            (self._sent[user], time.monotonic(), time.time())
                        )
                    conn.execute(
                        f"INSERT INTO {self.schema}.events (user_id, item_id, category_id, "
                        "price, home_region, kind, occurred_at) "
                        "VALUES (%s, 100, 1, 2.00, %s, 'view', clock_timestamp())",
                        (user, self.region),
                    )
        except BaseException as exc:  # reported by stop()
            self.error = exc
            self._halt.set()
        poller.join(timeout=30)

    def _poll(self) -> None:
        reader = feature_client(self.settings, self.region, timeout_s=2)
        try:
            while not self._halt.is_set():
                got = reader.get("user", list(SAMPLERS)).to_dicts()
                seen = time.monotonic()
                with self._lock:
                    for user, vector in zip(SAMPLERS, got, strict=True):
                        count = vector.get("views_30m") or 0
                        pending = self._pending[user]
                        while pending and pending[0][0] <= count:
                            _, sent, wall = pending.pop(0)
                            self.samples.append((wall, seen - sent))
                time.sleep(0.005)
        except BaseException as exc:
            self.error = exc
            self._halt.set()
        finally:
            reader.close()


def freshness_line(name: str, seconds: list[float]) -> str:
    if not seconds:
        return f"freshness {name}: no sample"
    ms = sorted(t * 1000 for t in seconds)

    def pct(q: float) -> float:
        return ms[min(len(ms) - 1, int(q * len(ms)))]

    return (
        f"freshness {name}: {len(ms)} views, p50 {pct(0.5):.0f} ms, p90 {pct(0.9):.0f} ms, "
        f"p99 {pct(0.99):.0f} ms, max {ms[-1]:.0f} ms"
    )


def snapshot_span_s(bootstrap: Any, topic: str, since: float | None = None) -> tuple[float, float]:
    """Wall times (s) of the newest incremental snapshot's STARTED and COMPLETED
    notifications, as Debezium stamped them. With ``since`` (a wall time, s): from
    the first snapshot STARTED at or after it to the newest COMPLETED, so that a
    rebuild made of several snapshots (one per table) is one span."""
    notes = asyncio.run(read_notifications(bootstrap, [topic], timeout_s=30))[topic]
    ours = [n for n in notes if n.get("aggregate_type") == "Incremental Snapshot"]
    started = [n for n in ours if n.get("type") == "STARTED"]
    completed = [n for n in ours if n.get("type") == "COMPLETED"]
    assert started and completed, notes
    first = started[-1]
    if since is not None:
        first = next(n for n in started if int(n["timestamp"]) / 1000 >= since - 1)
    return int(first["timestamp"]) / 1000, int(completed[-1]["timestamp"]) / 1000
