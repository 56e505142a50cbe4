"""The fault suite: the whole pipeline on the real local stack, under load, through
the faults an operator's worst day brings, each followed by a check of every vector
in every region against a recomputation from PostgreSQL (``edgefeed pipeline verify``).

    .venv/bin/python scripts/fault_suite.py            # every fault (make faults), ~9 min
    .venv/bin/python scripts/fault_suite.py --short    # four faults, ~3 min (a CI test runs it)

For each fault: load runs (``--rate`` changes/s through the demo shop), the fault
is injected in the middle of it, the load stops, and the suite waits until a probe
change written after the fault is in every region's cache ("recovered in s", from
the fault) and until the caches equal the recomputation. Then it reports, from
the differences it still finds: lost (a count or sum below the recomputation, or a
vector missing), double-counted (above it), leaked (a vector where residency says it
must not be), the dead letters the fault produced, and, for the faults that restart
no pipeline process, any that crashed. Exit 0 when no fault lost, double-counted,
leaked anything, left a feature wrong or crashed a process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

_HERE = str(Path(__file__).resolve().parent)
sys.path[:] = [p for p in sys.path if p not in ("", _HERE)]

import psycopg  # noqa: E402
import redis  # noqa: E402
import yaml  # noqa: E402
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition  # noqa: E402
from aiokafka.admin import AIOKafkaAdminClient  # noqa: E402

from connectors import deploy  # noqa: E402
from connectors.client import ConnectClient  # noqa: E402
from connectors.database import drop_slot  # noqa: E402
from edge_cache import KeyLayout  # noqa: E402
from edgefeed.devstack import DevStack  # noqa: E402
from edgefeed.devstack.ports import free_port  # noqa: E402
from edgefeed.devstack.process import (  # noqa: E402
    port_in_use,
    read_pid,
    stop_pid,
    wait_until,
)
from edgefeed.settings import EdgefeedSettings, settings_from_mapping  # noqa: E402
from edgefeed.shopload import ShopLoad, apply_schema  # noqa: E402
from edgefeed.verify import verify  # noqa: E402
from pipeline.recompute import Mismatch  # noqa: E402
from pipeline.topics import ensure_topics  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EDGEFEED = str(Path(sys.executable).with_name("edgefeed"))
REGIONS = (("eu-west", "eu"), ("us-east", "us"), ("ap-southeast", "apac"))
# Faults that restart no pipeline process: any that died or was replaced crashed.
STEADY = {
    "pause Redis eu-west 6 s",
    "hostile Debezium events",
    "oversize changes (2 MB, shared and personal)",
    "dead-letter topics unavailable 6 s",
}
COUNTS = ("views_30m", "clicks_30m", "carts_1h", "purchases_today", "views_1h", "purchases_1h")


def make_settings() -> dict[str, Any]:
    """The example settings (three regions) on free loopback ports."""
    example = yaml.safe_load((ROOT / "examples" / "edgefeed.yaml").read_text())
    regions = []
    for region in example["regions"]:
        regions.append({**region, "redis_url": f"redis://127.0.0.1:{free_port()}/0"})
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
            "password": "faults-secret",
        },
        "regions": regions,
        "sources": [{**example["sources"][0], "snapshot_mode": "no_data"}],
        "entities": example["entities"],
        "pipeline": {**example["pipeline"], "partitions": 2},
    }


# -- load that survives a database restart ------------------------------------------------------


class Load:
    """The demo shop's load at ``rate`` changes/s, in a thread, reconnecting after a
    PostgreSQL restart (a transaction that failed is simply not counted)."""

    def __init__(self, settings: EdgefeedSettings, rate: float) -> None:
        self.shop = ShopLoad(settings.database.dsn(), settings.region_names, users=200, items=50)
        self.rate = rate
        self.stop = threading.Event()
        self.written = 0
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.stop.clear()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def finish(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=60)

    def _run(self) -> None:
        tick = 0.1
        conn: psycopg.Connection[Any] | None = None
        while not self.stop.is_set():
            started = time.monotonic()
            try:
                if conn is None:
                    conn = psycopg.connect(self.shop.dsn, autocommit=True, connect_timeout=3)
                self.shop.write(conn, max(1, int(self.rate * tick)))
                self.written += max(1, int(self.rate * tick))
            except psycopg.Error:
                if conn is not None:
                    conn.close()
                conn = None
                time.sleep(0.5)
            time.sleep(max(0.0, tick - (time.monotonic() - started)))
        if conn is not None:
            conn.close()


# -- the run ------------------------------------------------------------------------------------


@dataclass
class Outcome:
    fault: str
    recovered_s: float | None
    lost: int
    double_counted: int
    leaked: int
    wrong: int
    dead_lettered: int
    rebuild_shown: bool  # a region's cache listed a history rebuild while it settled
    examples: list[str]
    # Pipeline processes that died or were replaced during a fault that restarts
    # none (a crash loop shows here): 0 expected.
    crashed: int = 0


class Suite:
    def __init__(self, state: Path, rate: float, load_s: float) -> None:
        self.mapping = make_settings()
        self.settings = settings_from_mapping(self.mapping)
        self.settings_file = state / "edgefeed.yaml"
        self.settings_file.write_text(yaml.safe_dump(self.mapping))
        self.stack = DevStack(self.settings, state)
        self.load = Load(self.settings, rate)
        self.load_s = load_s
        self.probe = 0
        self.lineage = 0  # new deployments made by the "retention passed" fault
        self.rebuild_shown = False
        self.dead_reset = False  # a fault recreated the dead-letter topics

    # -- set-up

    def up(self) -> None:
        self.stack.up()
        apply_schema(self.settings.database.dsn())
        with ConnectClient(self.settings.connect.url, timeout_s=30) as client:
            deploy.apply(client, self.settings.database, self.settings.sources, wait_s=120)
        names = self.settings.pipeline.names
        topics = {names.region_topic(r): self.settings.pipeline.partitions for r in self.regions}
        topics.update(dict.fromkeys(names.dead_letter_topics(self.regions), 1))
        asyncio.run(ensure_topics(self.settings.kafka.bootstrap_servers, topics))
        apps = ("router", *self.regions)
        for app in apps:  # side by side: their start-up waits overlap
            self.start_app(app, wait=False)
        for app in apps:
            self.wait_ready(app)
        self.load.shop.seed_rows()

    @property
    def regions(self) -> list[str]:
        return self.settings.region_names

    def start_app(self, name: str, region: str | None = None, wait: bool = True) -> None:
        args = ["--role", "router"] if name == "router" else ["--region", region or name]
        argv = [EDGEFEED, "--settings", str(self.settings_file), "pipeline", "run", *args]
        self.stack.start_app(name, argv, ready="Worker]: Ready" if wait else None, timeout_s=180)

    def wait_ready(self, name: str, timeout_s: float = 180.0) -> None:
        """Wait for an app started with ``wait=False`` to report ready (its first run)."""
        app = f"{self.stack._APP_PREFIX}{name}"
        log = self.stack.log_path(app)
        deadline = time.monotonic() + timeout_s
        while b"Worker]: Ready" not in (log.read_bytes() if log.exists() else b""):
            record = read_pid(self.stack.pid_path(app))
            if record is None or not record.alive() or time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
                raise RuntimeError(f"{name} did not become ready; the end of {log}:\n{tail}")
            time.sleep(0.2)

    def kill9(self, service: str, app: bool) -> None:
        name = f"{self.stack._APP_PREFIX}{service}" if app else service
        record = read_pid(self.stack.pid_path(name))
        if record is None or not record.alive():
            return
        if not app:
            # The whole service, as a container's kill: PostgreSQL's backends die
            # with the postmaster (a live backend, or the unreaped postmaster named
            # in postmaster.pid, keeps the restarted server from starting).
            with contextlib.suppress(ProcessLookupError):
                os.killpg(record.pid, signal.SIGKILL)
        stop_pid(record, sig=signal.SIGKILL, timeout_s=30)  # waits, and reaps it
        if not app:
            # A multi-threaded process (Connect's JVM) shows as a zombie once its
            # main thread is gone, while its other threads still hold the port
            # until the last exits: wait for the port, or the restart finds it
            # taken ("a process the local stack did not start").
            port = self.stack.service(service).port
            wait_until(lambda: not port_in_use(port), timeout_s=30)

    # -- measuring

    def dead_letters(self) -> int:
        async def count() -> int:
            consumer = AIOKafkaConsumer(bootstrap_servers=self.settings.kafka.bootstrap_servers)
            await consumer.start()
            try:
                names = self.settings.pipeline.names
                tps = [TopicPartition(t, 0) for t in names.dead_letter_topics(self.regions)]
                return sum(int(end) for end in (await consumer.end_offsets(tps)).values())
            finally:
                await consumer.stop()

        return asyncio.run(count())

    def write_probe(self) -> int:
        """A new user per region with one event: visible once the region recovered."""
        self.probe += 1
        base = 900_000 + self.probe * 10
        with psycopg.connect(self.settings.database.dsn(), autocommit=True) as conn:
            for i, region in enumerate(self.regions):
                conn.execute(
                    "INSERT INTO public.users (user_id, home_region, country, segment, email) "
                    "VALUES (%s, %s, 'XX', 1, 'probe@example.org')",
                    (base + i, region),
                )
        return base

    def probe_visible(self, base: int) -> bool:
        visible = True
        for i, region in enumerate(self.regions):
            url = self.settings.region(region).redis_url
            try:
                with redis.Redis.from_url(url, socket_timeout=1) as client:
                    # What `edgefeed lag` shows as REBUILDING (pipeline.history).
                    if client.hlen(KeyLayout().rebuild_key()):
                        self.rebuild_shown = True
                    if not client.exists(f"ef:{{user:{base + i}}}"):
                        visible = False
            except redis.RedisError:
                return False
        return visible

    def settle(self, deadline_s: float) -> tuple[float | None, list[Mismatch]]:
        """Wait for a probe written after the fault in every region, then for the caches
        to equal the recomputation; returns (when the probe was seen, differences left)."""
        started = time.monotonic()
        base = self.write_probe()
        recovered: float | None = None
        while time.monotonic() - started < deadline_s:
            if self.probe_visible(base):
                recovered = time.monotonic()
                break
            time.sleep(0.2)
        mismatches: list[Mismatch] = []
        while time.monotonic() - started < deadline_s:
            try:
                mismatches = verify(self.settings).mismatches
            except Exception as exc:  # a region still down: try again
                mismatches = [Mismatch("?", "?", "?", f"verify failed: {exc}")]
            if not mismatches:
                break
            self.probe_visible(base)  # notes a rebuild still listed
            time.sleep(1.0)
        return recovered, mismatches

    def app_pids(self) -> dict[str, int | None]:
        """The router's and the regional workers' process ids (None: not running)."""
        pids: dict[str, int | None] = {}
        for app in ("router", *self.regions):
            record = read_pid(self.stack.pid_path(f"{self.stack._APP_PREFIX}{app}"))
            pids[app] = record.pid if record is not None and record.alive() else None
        return pids

    def run_fault(self, name: str, inject: Callable[[], None], deadline_s: float) -> Outcome:
        dead_before = self.dead_letters()
        pids_before = self.app_pids()
        self.rebuild_shown = False
        self.dead_reset = False
        self.load.start()
        time.sleep(self.load_s / 2)
        fault_at = time.monotonic()
        inject()
        time.sleep(max(0.0, self.load_s / 2 - (time.monotonic() - fault_at)))
        self.load.finish()
        probe_at, mismatches = self.settle(deadline_s)
        recovered = None if probe_at is None else round(probe_at - fault_at, 1)
        lost = double = leaked = wrong = 0
        for m in mismatches:
            if m.what == "missing":
                lost += 1
            elif m.what == "unexpected":
                leaked += 1
            elif m.what in COUNTS and isinstance(m.expected, int | float):
                if (m.found or 0) < m.expected:
                    lost += 1
                else:
                    double += 1
            else:
                wrong += 1
        examples = [
            f"{m.region} {m.entity}:{m.entity_id} {m.what}: expected {m.expected!r}, "
            f"found {m.found!r}"
            for m in mismatches[:5]
        ]
        crashed = 0
        if name in STEADY:
            after = self.app_pids()
            crashed = sum(1 for app, pid in pids_before.items() if pid is None or after[app] != pid)
        return Outcome(
            name, recovered, lost, double, leaked, wrong,
            # A lost broker or recreated topics start from 0.
            self.dead_letters() if self.dead_reset else max(0, self.dead_letters() - dead_before),
            self.rebuild_shown, examples, crashed,
        )  # fmt: skip

    # -- the faults

    def faults(self, short: bool) -> list[tuple[str, Callable[[], None]]]:
        def restart_app(name: str) -> Callable[[], None]:
            def inject() -> None:
                self.kill9(name, app=True)
                self.start_app(name)

            return inject

        def restart_service(name: str) -> Callable[[], None]:
            def inject() -> None:
                self.kill9(name, app=False)
                self.stack.up()

            return inject

        def pause(service: str, app: bool, seconds: float) -> Callable[[], None]:
            # SIGSTOP of the whole process group (PostgreSQL's backends, Connect's
            # JVM threads, a worker), then SIGCONT: a hung process, not a dead one.
            # Longer than the session timeout, a paused worker is put out of its
            # group and resumes as a stale owner (the rebalance race).
            def inject() -> None:
                name = f"{self.stack._APP_PREFIX}{service}" if app else service
                record = read_pid(self.stack.pid_path(name))
                if record is None or not record.alive():
                    raise RuntimeError(f"{name} is not running: nothing to pause")
                os.killpg(record.pid, signal.SIGSTOP)
                try:
                    time.sleep(seconds)
                finally:
                    os.killpg(record.pid, signal.SIGCONT)

            return inject

        def restart_redis_keeping_data(region: str) -> Callable[[], None]:
            # Writes held (CLIENT PAUSE WRITE), a snapshot, kill -9, restart: the
            # server loads the snapshot and holds exactly what it held before.
            def inject() -> None:
                service = f"redis-{region}"
                with redis.Redis.from_url(self.settings.region(region).redis_url) as client:
                    client.execute_command("CLIENT", "PAUSE", 10_000, "WRITE")
                    client.execute_command("SAVE")
                self.kill9(service, app=False)
                self.stack.up()
                # Later faults of this Redis lose their data, as before.
                (self.stack.service(service).home / "dump.rdb").unlink(missing_ok=True)

            return inject

        def scale_out() -> None:
            # Two more workers join eu-west's group; one of them is killed -9.
            self.start_app("eu-west-2", region="eu-west")
            self.start_app("eu-west-3", region="eu-west")
            self.kill9("eu-west-2", app=True)

        def pause_redis() -> None:
            url = self.settings.region("eu-west").redis_url
            with redis.Redis.from_url(url) as client:
                client.execute_command("CLIENT", "PAUSE", 6000, "ALL")

        def poison() -> None:
            asyncio.run(self.send_poison())

        def oversize() -> None:
            asyncio.run(self.send_poison(oversize_only=True))

        def dead_letters_unavailable() -> None:
            # The dead-letter topics are deleted, poison arrives, and the topics come
            # back 6 s later: the router waits (retrying as a pointer, with backoff)
            # instead of crash-looping or dropping the dead letters.
            names = self.settings.pipeline.names
            topics = names.dead_letter_topics(self.regions)
            asyncio.run(self.delete_topics(topics))
            self.dead_reset = True  # the topics count from 0 again
            asyncio.run(self.send_poison())
            time.sleep(6)
            asyncio.run(
                ensure_topics(self.settings.kafka.bootstrap_servers, dict.fromkeys(topics, 1))
            )

        def retention_passed() -> None:
            # The stream's history begins after rows the windows need, as when a topic's
            # retention is shorter than the longest window: a new deployment (a new
            # connector, whose topics begin now; a new pipeline, whose topics,
            # changelogs and history record are new) over tables that hold the day of
            # rows the load wrote, while the load goes on (what is committed between
            # the old connector and the new one is in no stream). The caches keep what
            # the old pipeline wrote.
            for app in ("router", *self.regions, "eu-west-2", "eu-west-3"):
                self.kill9(app, app=True)
            old = self.settings.sources[0]
            with ConnectClient(self.settings.connect.url, timeout_s=30) as client:
                client.delete(old.connector_name)
            with psycopg.connect(self.settings.database.dsn(), autocommit=True) as conn:
                drop_slot(conn, old.effective_slot_name, old.effective_publication)
            self.lineage += 1
            tag = f"r{self.lineage}"
            self.mapping["sources"] = [{**self.mapping["sources"][0], "name": f"shop{tag}"}]
            self.mapping["pipeline"] = {
                **self.mapping["pipeline"],
                "app_prefix": f"edgefeed-{tag}",
                "region_topic_prefix": f"edgefeed.{tag}.region",
                "dead_letter_topic": f"edgefeed.{tag}.deadletter",
            }
            self.settings = settings_from_mapping(self.mapping)
            self.settings_file.write_text(yaml.safe_dump(self.mapping))
            with ConnectClient(self.settings.connect.url, timeout_s=30) as client:
                deploy.apply(client, self.settings.database, self.settings.sources, wait_s=120)
            for app in ("router", *self.regions):
                self.start_app(app)

        def broker_lost() -> None:
            # The local broker keeps everything in memory: restarted, it has no topics,
            # no Connect offsets or configs, no changelogs, no history records. What a
            # platform does after a lost cluster follows: the broker is back, Connect
            # and the pipeline's processes are restarted by their supervisor and the
            # connector config is applied again (it lived on the broker). Nothing
            # rebuilds the windows' history but the router (pipeline.history).
            for app in ("router", *self.regions, "eu-west-2", "eu-west-3"):
                self.kill9(app, app=True)
            self.kill9("broker", app=False)
            self.kill9("connect", app=False)
            self.stack.up()
            with ConnectClient(self.settings.connect.url, timeout_s=30) as client:
                deploy.apply(client, self.settings.database, self.settings.sources, wait_s=120)
            for app in ("router", *self.regions):
                self.start_app(app)

        chosen = [
            ("kill -9 router", restart_app("router")),
            ("kill -9 worker eu-west", restart_app("eu-west")),
            ("pause Redis eu-west 6 s", pause_redis),
            ("hostile Debezium events", poison),
        ]
        if not short:
            chosen += [
                ("oversize changes (2 MB, shared and personal)", oversize),
                ("dead-letter topics unavailable 6 s", dead_letters_unavailable),
                ("kill -9 worker us-east", restart_app("us-east")),
                ("kill -9 worker ap-southeast", restart_app("ap-southeast")),
                ("kill -9 Redis us-east (data lost)", restart_service("redis-us-east")),
                ("kill -9 Redis eu-west (data kept)", restart_redis_keeping_data("eu-west")),
                ("kill -9 Kafka Connect", restart_service("connect")),
                ("kill -9 PostgreSQL", restart_service("postgres")),
                ("pause Kafka Connect 10 s", pause("connect", False, 10)),
                ("pause PostgreSQL 10 s", pause("postgres", False, 10)),
                ("pause router 10 s", pause("router", True, 10)),
                ("pause worker us-east 10 s", pause("us-east", True, 10)),
                ("pause worker ap-southeast 10 s", pause("ap-southeast", True, 10)),
                ("eu-west scaled to 3 workers, one killed -9", scale_out),
                # Two eu-west workers now: the paused one's partitions move to the
                # other, and it resumes as their stale owner.
                ("pause worker eu-west 10 s (2 in its group)", pause("eu-west", True, 10)),
                ("broker lost (restarted empty)", broker_lost),
                ("retention passed (a new deployment over a day of rows)", retention_passed),
            ]
        return chosen

    async def delete_topics(self, topics: list[str]) -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=self.settings.kafka.bootstrap_servers)
        await admin.start()
        try:
            await admin.delete_topics(topics)
        finally:
            await admin.close()

    async def send_poison(self, oversize_only: bool = False) -> None:
        topic = self.settings.sources[0].topic_for("public.users")
        events = self.settings.sources[0].topic_for("public.events")
        items = self.settings.sources[0].topic_for("public.items")
        source = {"ts_ms": int(time.time() * 1000), "schema": "public", "lsn": 1}
        user = {"user_id": 999_001, "home_region": "eu-west", "country": "DE", "segment": 1}
        corpus: list[tuple[str, Any]] = [
            (topic, b"{not json"),
            (topic, {"op": "c", "after": {**user, "segment": 2**40}}),
            (topic, {"op": "c", "after": {**user, "user_id": 1.5}}),
            (topic, {"op": "c", "after": {**user, "home_region": "mars"}}),
            (topic, {"op": "d", "before": {"user_id": 999_002, "home_region": ""}}),
            (
                events,
                {
                    "op": "c",
                    "after": {
                        "event_id": 1,
                        "user_id": 1,
                        "item_id": 1,
                        "category_id": 1,
                        "price": "1e39",
                        "home_region": "eu-west",
                        "kind": "v" * 600_000,
                        "occurred_at": 1e300,
                    },
                },
            ),
            # Over the broker's message limit (~1 MB) for the dead letters: once a crash
            # loop (the send of the dead letter failed, the router restarted on it).
            (items, {"op": "c", "after": {"item_id": 999_003, "price": 1, "x": "y" * 2_000_000}}),
            (
                events,
                {
                    "op": "c",
                    "after": {
                        "event_id": 999_004,
                        "user_id": 1,
                        "home_region": "eu-west",
                        "kind": "view",
                        "item_id": 1,
                        "blob": "z" * 2_000_000,
                    },
                },
            ),
        ]
        if oversize_only:
            corpus = corpus[-2:]
        producer = AIOKafkaProducer(
            bootstrap_servers=self.settings.kafka.bootstrap_servers, max_request_size=2**22
        )
        await producer.start()
        try:
            for name, body in corpus:
                table = {events: "events", items: "items"}.get(name, "users")
                value = (
                    body
                    if isinstance(body, bytes)
                    else json.dumps({**body, "source": {**source, "table": table}}).encode()
                )
                await producer.send_and_wait(name, value)
        finally:
            await producer.stop()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--short", action="store_true", help="four faults (the CI variant)")
    parser.add_argument("--rate", type=float, default=200.0, help="changes per second")
    parser.add_argument("--load-s", type=float, default=8.0, help="seconds of load per fault")
    parser.add_argument("--deadline-s", type=float, default=120.0, help="recovery deadline")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="TEXT",
        help="run only the faults whose name contains TEXT (repeatable)",
    )
    args = parser.parse_args()
    # SIGTERM (a test's timeout, a supervisor) unwinds like Ctrl-C: the stack stops.
    signal.signal(signal.SIGTERM, _interrupt)
    state = Path(tempfile.mkdtemp(prefix="edgefeed-faults-"))
    state.chmod(0o755)
    suite = Suite(state, args.rate, args.load_s)
    outcomes: list[Outcome] = []
    try:
        suite.up()
        for name, inject in suite.faults(args.short):
            if args.only and not any(text in name for text in args.only):
                continue
            if not args.json:
                print(f"fault: {name} ...", flush=True)
            outcomes.append(suite.run_fault(name, inject, args.deadline_s))
    finally:
        suite.load.finish()
        suite.stack.down()
        if not os.environ.get("EDGEFEED_FAULTS_KEEP"):
            shutil.rmtree(state, ignore_errors=True)
    if args.json:
        print(json.dumps([asdict(o) for o in outcomes], indent=2))
    else:
        header = ("fault", "recovered in s", "lost", "double-counted", "leaked", "wrong",
                  "dead-lettered", "rebuilding shown", "crashed")  # fmt: skip
        rows = [
            (o.fault, "not recovered" if o.recovered_s is None else f"{o.recovered_s:.1f}",
             str(o.lost), str(o.double_counted), str(o.leaked), str(o.wrong),
             str(o.dead_lettered), "yes" if o.rebuild_shown else "no", str(o.crashed))
            for o in outcomes
        ]  # fmt: skip
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        for row in [header, *rows]:
            print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    bad = [
        o
        for o in outcomes
        if o.recovered_s is None or o.lost or o.double_counted or o.leaked or o.wrong or o.crashed
    ]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
