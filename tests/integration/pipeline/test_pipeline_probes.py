"""``pipeline run --metrics-port``'s probes on the real stack: what the kubelet sees.

The router and a regional worker are real ``edgefeed pipeline run`` processes
serving /healthz, /readyz and /metrics (behind a token). The worker's readiness
bound (``pipeline.ready_max_behind_s``) is 2 s here, so that "behind" is reached
within seconds: its region's Redis is paused for writes (CLIENT PAUSE WRITE) while
changes keep arriving, and the worker stops taking messages, retrying its write;
then the pause ends and it catches up.
"""

from __future__ import annotations

import http.client
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
from e2e_harness import PipelineRun, shop_pipeline, shop_settings
from stackhelpers import free_ports, unique_name
from test_pipeline_end_to_end import vector, wait_for

from edgefeed.devstack import DevStack

pytestmark = pytest.mark.integration

REGION = "eu-west"
MAX_BEHIND_S = 2.0
USERS = list(range(5101, 5113))  # keyed user:<id>: spread over both partitions
DEADLINE_S = 180  # a start or a recovery on a busy 2-core machine: a deadline, not a timing

# What /readyz may say before a regional worker is first ready (pipeline.probes).
STARTING = re.compile(
    r"starting: waiting for an assignment of partitions|recovering partitions \(rebalance\)"
    r"|recovered; waiting for the first offsets of its partitions"
    r"|catching up: .+|behind: .+|no progress report for .+"
)
BEHIND = re.compile(
    r"behind: (?P<s>\d+\.\d) s \(partition \d+, (?P<n>\d+) messages? waiting; "
    rf"bound {MAX_BEHIND_S:g} s\)"
)

Answer = tuple[int, str]  # (HTTP status, body); status 0: nothing listens yet


@dataclass(frozen=True)
class Endpoint:
    """One process's ``--metrics-port``, asked as the kubelet and Prometheus would."""

    port: int
    token_file: Path

    def get(self, path: str, token: str | None = None) -> Answer:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            headers = {} if token is None else {"Authorization": f"Bearer {token}"}
            conn.request("GET", path, headers=headers)
            response = conn.getresponse()
            return response.status, response.read().decode(errors="replace").strip()
        except (ConnectionRefusedError, ConnectionResetError) as exc:
            return 0, type(exc).__name__
        finally:
            conn.close()

    def options(self) -> list[str]:
        return ["--metrics-port", str(self.port), "--metrics-token-file", str(self.token_file)]


def follow(
    run: PipelineRun,
    name: str,
    endpoint: Endpoint,
    path: str,
    until: Callable[[Answer], bool],
    what: str,
    token: str | None = None,
) -> list[Answer]:
    """Ask ``path`` every 50 ms until ``until`` holds; returns every answer that differed
    from the one before it, the last one included. Fails if the process exits."""
    seen: list[Answer] = []
    deadline = time.monotonic() + DEADLINE_S
    while True:
        answer = endpoint.get(path, token)
        if not seen or seen[-1] != answer:
            seen.append(answer)
        if until(answer):
            return seen
        if run.procs[name].poll() is not None:
            raise AssertionError(f"{name} exited; {path} said {seen}:\n{run.log_tail(name)}")
        if time.monotonic() > deadline:
            raise AssertionError(
                f"not within {DEADLINE_S} s: {what}; {path} said {seen[-20:]}:\n"
                f"{run.log_tail(name)}"
            )
        time.sleep(0.05)


def history_complete(metrics: str) -> set[str]:
    """The tables whose history the router found complete, from its /metrics."""
    found = set()
    for labels, value in re.findall(
        r"^edgefeed_pipeline_history_state\{(.*)\} (\S+)$", metrics, re.MULTILINE
    ):
        pairs = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if pairs.get("state") == "complete" and float(value) == 1:
            found.add(pairs["table"])
    return found


def views(run: PipelineRun, user: int) -> int:
    return int((vector(run, REGION, "user", user) or {}).get("views_30m") or 0)


def said(what: str, answers: list[Answer]) -> None:
    """Show what a probe said (``pytest -s``): each answer that differed from the one
    before it, the first and last few of a long run."""
    shown = answers if len(answers) <= 8 else [*answers[:4], (0, "..."), *answers[-3:]]
    print(f"\n{what}:", *(f"  {status} {reason}" for status, reason in shown), sep="\n")


class Feed:
    """Inserts a view for one of ``USERS`` (round robin) every 50 ms until stopped."""

    def __init__(self, run: PipelineRun) -> None:
        self.run = run
        self.sent = dict.fromkeys(USERS, 0)
        self.error: BaseException | None = None
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="probe-feed", daemon=True)

    def _loop(self) -> None:
        try:
            with psycopg.connect(self.run.settings.database.dsn(), autocommit=True) as conn:
                turn = 0
                while not self._halt.wait(0.05):
                    user = USERS[turn % len(USERS)]
                    turn += 1
                    conn.execute(
                        f"INSERT INTO {self.run.schema}.events (user_id, item_id, category_id, "
                        "price, home_region, kind, occurred_at) "
                        "VALUES (%s, 100, 1, 2.00, %s, 'view', now())",
                        (user, REGION),
                    )
                    self.sent[user] += 1
        except BaseException as exc:  # surfaced by stop()
            self.error = exc

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._halt.set()
        if self._thread.is_alive():
            self._thread.join(timeout=60)
        assert not self._thread.is_alive(), "the feed did not stop"
        assert self.error is None, self.error


@dataclass
class Probed:
    run: PipelineRun
    router: Endpoint
    worker: Endpoint
    token: str
    router_answers: list[Answer]


@pytest.fixture(scope="module")
def probed(
    devstack: DevStack, stack_mapping: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Probed]:
    """The shop pipeline with a readiness bound of 2 s and its router started with
    ``--metrics-port`` (what /readyz said while it started is kept); the regional
    worker is the tests' to start."""
    tag = unique_name("probe").lower()
    schema = f"s_{tag}"
    mapping = shop_settings(stack_mapping, schema, tag)
    mapping["pipeline"] = {**mapping["pipeline"], "ready_max_behind_s": MAX_BEHIND_S}
    folder = tmp_path_factory.mktemp("probes")
    token = secrets.token_urlsafe(32)
    token_file = folder / "metrics.token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    router_port, worker_port = free_ports(2)
    router = Endpoint(router_port, token_file)
    with shop_pipeline(mapping, schema, folder, [], wait_s=90) as run:
        run.spawn("router", extra=router.options())
        answers = follow(
            run, "router", router, "/readyz", lambda a: a[0] == 200, "the router ready"
        )
        said("router /readyz while it started", answers)
        # Rows written while the router checks the stream's history would be rebuilt by
        # a snapshot (correct, but another path each run): its metrics say when it is done.
        tables = {f"{schema}.{name}" for name in ("users", "items", "events")}
        follow(
            run,
            "router",
            router,
            "/metrics",
            lambda a: tables <= history_complete(a[1]),
            "the router's history check",
            token=token,
        )
        with psycopg.connect(run.settings.database.dsn(), autocommit=True) as conn:
            # A personal entity has a vector while its own row exists.
            conn.execute(
                f"INSERT INTO {schema}.users (user_id, home_region, country, segment, email) "
                "SELECT u, %s, 'DE', 1, 'p@example.org' FROM unnest(%s::bigint[]) AS u",
                (REGION, USERS),
            )
        yield Probed(run, router, Endpoint(worker_port, token_file), token, answers)


def test_the_router_is_ready_once_it_has_recovered(probed: Probed) -> None:
    answers = probed.router_answers
    # Not ready from the moment it answers until its table of homes is recovered.
    *before, last = [a for a in answers if a[0] != 0]
    assert before, f"the router was ready at its first answer: {answers}"
    assert all(status == 503 for status, _ in before), answers
    assert before[0][1].startswith("starting: "), answers
    assert re.fullmatch(r"ready: \d+ source partitions assigned", last[1]), answers
    assert int(last[1].split()[1]) >= 1, "the router owns no source partition"
    assert probed.router.get("/healthz") == (200, "alive")
    assert probed.router.get("/readyz")[0] == 200
    assert probed.router.get("/metrics")[0] == 401  # the router's has a token too


def test_a_regional_worker_is_alive_at_once_and_ready_once_recovered(probed: Probed) -> None:
    run, worker = probed.run, probed.worker
    # A backlog waiting for the worker when it starts: once it is taken, nothing waits
    # and the worker is ready, however old its last change (an idle region).
    with psycopg.connect(run.settings.database.dsn(), autocommit=True) as conn:
        conn.execute(
            f"INSERT INTO {run.schema}.events (user_id, item_id, category_id, price, "
            "home_region, kind, occurred_at) "
            "SELECT u, 100, 1, 2.00, %s, 'view', now() FROM unnest(%s::bigint[]) AS u",
            (REGION, USERS),
        )
    offset = run.spawn(REGION, extra=worker.options())
    alive = follow(run, REGION, worker, "/healthz", lambda a: a[0] != 0, "/healthz answers")
    assert alive[-1] == (200, "alive"), alive
    status, reason = worker.get("/readyz")
    assert status == 503 and reason.startswith("starting: "), (status, reason)

    answers = follow(
        run, REGION, worker, "/readyz", lambda a: a[0] == 200, "the regional worker ready"
    )
    said("worker /readyz while it started", [alive[-1], *answers])
    *before, last = answers
    assert all(s == 503 and STARTING.fullmatch(r) for s, r in before), answers
    assert last == (200, "ready: caught up on 2 partitions"), answers
    assert worker.get("/healthz") == (200, "alive")
    run.wait_started(REGION, offset)  # Faust's own word, for the harness
    wait_for("the backlog in the cache", lambda: all(views(run, u) == 1 for u in USERS))
    status, reason = worker.get("/readyz")
    assert (status, reason) == (200, "ready: caught up on 2 partitions"), reason

    # /metrics is behind the token; the probes are not.
    assert worker.get("/metrics")[0] == 401
    assert worker.get("/metrics", token="x" * 43)[0] == 401
    status, body = worker.get("/metrics", token=probed.token)
    assert status == 200
    assert f'edgefeed_pipeline_cache_up{{region="{REGION}"}} 1.0' in body


def test_a_worker_behind_is_not_ready_until_it_has_caught_up(probed: Probed) -> None:
    run, worker = probed.run, probed.worker
    if REGION not in run.procs:  # this test run alone
        run.start(REGION, extra=worker.options())
    follow(run, REGION, worker, "/readyz", lambda a: a[0] == 200, "the worker ready")
    cache = redis.Redis.from_url(run.settings.region(REGION).redis_url)
    before = {u: views(run, u) for u in USERS}
    feed = Feed(run)
    feed.start()
    try:
        # Changes flowing through a worker that keeps up: ready.
        wait_for("the feed in the cache", lambda: any(views(run, u) > before[u] for u in USERS))
        answers = follow(
            run, REGION, worker, "/readyz", lambda a: a[0] == 200, "ready under the feed"
        )
        said("worker /readyz under the feed", answers)

        # The region's Redis refuses writes (for at most 2 minutes, should this test
        # die): the worker stops taking messages while they keep arriving.
        cache.execute_command("CLIENT", "PAUSE", 120_000, "WRITE")
        try:
            answers = follow(
                run,
                REGION,
                worker,
                "/readyz",
                lambda a: a[0] == 503 and BEHIND.fullmatch(a[1]) is not None,
                "/readyz says behind",
            )
            said("worker /readyz, its Redis paused", answers)
            behind = BEHIND.fullmatch(answers[-1][1])
            assert behind is not None
            assert float(behind["s"]) > MAX_BEHIND_S and int(behind["n"]) >= 1, answers[-1]
            assert worker.get("/healthz") == (200, "alive")  # behind, but alive
            feed.stop()
        finally:
            cache.execute_command("CLIENT", "UNPAUSE")
    finally:
        feed.stop()
        cache.close()

    answers = follow(
        run,
        REGION,
        worker,
        "/readyz",
        lambda a: a == (200, "ready: caught up on 2 partitions"),
        "caught up after the pause",
    )
    said("worker /readyz once its Redis answers again", answers)
    wait_for(
        "every view of the feed in the cache",
        lambda: all(views(run, u) == before[u] + feed.sent[u] for u in USERS),
    )
    assert run.procs[REGION].poll() is None
