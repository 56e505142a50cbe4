"""The worker's own overload is shed by the worker, never blamed on a healthy region.

Real worker server, real lookup client, a real redis-server of this module's own (a
free port, no persistence; no shared stack), the ranker's lookups not coalesced. A
burst of concurrent requests gets 200 or 429 + Retry-After, never 503, and counts no
region failure; answers that came in time but found the event loop stalled are read;
a region that does not answer still times out, is counted and trips its breaker.

:class:`GatedLink`, a TCP proxy in front of the redis-server, holds chosen replies: it
makes "the region has answered" and "the region has not answered" facts of the test,
not races against this machine's speed.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator

import pytest
import redis
from prometheus_client import CollectorRegistry

from edge_cache import AsyncFeatureClient, AsyncFeatureWriter, Position, RegionSettings, Upsert
from workers.batcher import BatchingConfig
from workers.client import WorkerClient
from workers.exceptions import FeatureLookupError, QueueFullError, WorkerResponseError
from workers.features import EdgeCacheFeatureSource, pool_size
from workers.models import Ranker, RankerConfig, load_served_model
from workers.server import InferenceServer, run_on_loop
from workers.synthetic import click_world

WORLD = click_world()
CONFIG = RankerConfig()
ITEMS = list(WORLD.item_ids[:20])
BURST = 1000  # concurrent requests: the server's default max_connections
ROUNDS = 5


@pytest.fixture(scope="module")
def redis_port(workers_redis_url: str) -> int:
    """The workers' own redis-server (tests/integration/workers/conftest.py)."""
    return int(workers_redis_url.rsplit(":", 1)[1].split("/", 1)[0])


@pytest.fixture
def region(redis_port: int) -> RegionSettings:
    """The region eu-west on the workers' redis-server, flushed."""
    with redis.Redis(port=redis_port) as client:
        client.flushdb()
    return RegionSettings(
        name="eu-west", redis_url=f"redis://127.0.0.1:{redis_port}/0", residency_zone="eu"
    )


class GatedLink:
    """A TCP proxy in front of a redis-server: requests pass at once; after
    :meth:`hold`, the replies on every connection that sent a request containing
    ``marker`` wait for :meth:`release`."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        self.marker: bytes | None = None
        self.held = 0  # requests with the marker passed while holding
        self._released = threading.Event()
        self._released.set()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def hold(self, marker: bytes) -> None:
        self.marker = marker
        self._released.clear()

    def release(self) -> None:
        self._released.set()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream_port))
            gated = threading.Event()  # this connection asked with the marker
            self._sockets += [client, server]
            for target in (self._requests, self._replies):
                thread = threading.Thread(target=target, args=(client, server, gated), daemon=True)
                self._threads.append(thread)
                thread.start()

    def _requests(
        self, client: socket.socket, server: socket.socket, gated: threading.Event
    ) -> None:
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                marker = self.marker
                if marker is not None and marker in data and not self._released.is_set():
                    with self._lock:
                        self.held += 1
                    gated.set()
                server.sendall(data)

    def _replies(
        self, client: socket.socket, server: socket.socket, gated: threading.Event
    ) -> None:
        with contextlib.suppress(OSError):
            while data := server.recv(65536):
                if gated.is_set():
                    while not self._released.wait(0.05):
                        if self._stop.is_set():
                            return
                    gated.clear()
                client.sendall(data)

    def close(self) -> None:
        self._stop.set()
        self._released.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for thread in self._threads:
            thread.join(timeout=5)


@pytest.fixture
def gated(region: RegionSettings, redis_port: int) -> Iterator[tuple[RegionSettings, GatedLink]]:
    """The region reached through a :class:`GatedLink`."""
    link = GatedLink(redis_port)
    try:
        yield region.model_copy(update={"redis_url": f"redis://127.0.0.1:{link.port}/0"}), link
    finally:
        link.close()


async def _seed(region: RegionSettings) -> None:
    users = [
        Upsert(
            CONFIG.user_entity,
            WORLD.user_ids[i],
            dict(zip(CONFIG.user_features, map(float, WORLD.user_features[i]), strict=True)),
            Position(1),
            time.time(),
        )
        for i in range(10)
    ]
    items = [
        Upsert(
            CONFIG.item_entity,
            WORLD.item_ids[i],
            dict(zip(CONFIG.item_features, map(float, WORLD.item_features[i]), strict=True)),
            Position(1),
            time.time(),
        )
        for i in range(len(ITEMS))
    ]
    async with AsyncFeatureWriter.from_region(region, CONFIG.schemas()) as writer:
        await writer.write(users + items)


def _failures(registry: CollectorRegistry) -> dict[str, float]:
    """``edgefeed_lookup_region_failures_total`` by reason (what the breaker counts too)."""
    counted: dict[str, float] = {}
    for metric in registry.collect():
        if metric.name == "edgefeed_lookup_region_failures":
            for sample in metric.samples:
                if sample.name.endswith("_total") and sample.value:
                    counted[sample.labels["reason"]] = sample.value
    return counted


async def _until(condition: Callable[[], bool], what: str, within_s: float = 30.0) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        await asyncio.sleep(0.002)


async def test_a_burst_is_shed_by_the_worker_never_blamed_on_a_healthy_region(
    region: RegionSettings,
) -> None:
    await _seed(region)
    registry = CollectorRegistry()
    # as `edgefeed workers serve --model ranker` with coalesce_lookups off builds it: the
    # serving deadline (0.25 s), a pool sized for the queue (256 requests), 256-row batches
    client = AsyncFeatureClient(
        "eu-west", [region], CONFIG.schemas(), registry=registry, max_connections=pool_size(256)
    )
    model = load_served_model(
        "ranker", features=lambda _config: EdgeCacheFeatureSource(client, coalesce=False)
    )
    assert isinstance(model, Ranker)
    batching = BatchingConfig(max_batch_size=Ranker.default_max_batch_size)
    statuses: Counter[int | str] = Counter()
    breaker: list[str] = []
    no_retry_after = 0
    async with (
        InferenceServer([model], batching=batching) as server,
        WorkerClient(server.url) as http,
    ):
        for _round in range(ROUNDS):
            answers = await asyncio.gather(
                *(http.rank("ranker", WORLD.user_ids[i % 10], ITEMS) for i in range(BURST)),
                return_exceptions=True,
            )
            for answer in answers:
                if isinstance(answer, WorkerResponseError):
                    statuses[answer.status] += 1
                    no_retry_after += answer.status == 429 and answer.retry_after_s is None
                elif isinstance(answer, BaseException):
                    statuses[repr(answer)] += 1
                else:
                    statuses[200] += 1
            breaker.append(client.breakers["eu-west"].state)
    print(f"\n{ROUNDS} bursts of {BURST}: {dict(statuses)}; region failures: {_failures(registry)}")
    assert set(statuses) <= {200, 429}, dict(statuses)
    assert statuses[200] > 0  # shedding everything would be no answer either
    assert no_retry_after == 0
    assert _failures(registry) == {}
    assert breaker == ["closed"] * ROUNDS


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_answers_that_came_in_time_are_read_though_the_event_loop_stalled(
    gated: tuple[RegionSettings, GatedLink], loop: str
) -> None:
    home, link = gated
    lookups = 8
    timeout_s = 1.0

    async def scenario() -> None:
        await _seed(home)
        registry = CollectorRegistry()
        client = AsyncFeatureClient(
            "eu-west", [home], CONFIG.schemas(), registry=registry, timeout_s=timeout_s
        )
        source = EdgeCacheFeatureSource(client, coalesce=False)
        try:
            await asyncio.gather(  # its connections open, nothing held
                *(source.get(CONFIG.item_entity, [i]) for i in ITEMS[:lookups])
            )
            link.hold(b"MGET")
            calls = [
                asyncio.ensure_future(source.get(CONFIG.item_entity, [i])) for i in ITEMS[:lookups]
            ]
            await _until(lambda: link.held == lookups, "every lookup asked")
            # The loop stalls (a GC pause, a CPU another process holds) for twice the
            # deadline; meanwhile the region answers, well within it.
            threading.Timer(0.01, link.release).start()
            time.sleep(2 * timeout_s)
            answers = await asyncio.gather(*calls, return_exceptions=True)
            assert [a for a in answers if isinstance(a, BaseException)] == []
            assert _failures(registry) == {}
            assert client.breakers["eu-west"].state == "closed"
        finally:
            await source.aclose()

    run_on_loop(scenario(), loop)  # type: ignore[arg-type]


async def test_a_region_that_does_not_answer_still_times_out_and_trips_its_breaker(
    gated: tuple[RegionSettings, GatedLink],
) -> None:
    home, link = gated
    await _seed(home)
    registry = CollectorRegistry()
    client = AsyncFeatureClient(
        "eu-west", [home], CONFIG.schemas(), registry=registry, timeout_s=0.25
    )
    source = EdgeCacheFeatureSource(client, coalesce=False)
    try:
        await source.get(CONFIG.item_entity, ITEMS[:1])  # it answered once
        link.hold(b"MGET")  # and no more
        with pytest.raises(FeatureLookupError, match=r"eu-west: timed out after 0\.25 s") as late:
            await source.get(CONFIG.item_entity, ITEMS[1:2])
        assert late.value.http_status == 503
        assert _failures(registry) == {"timeout": 1}
        assert client.breakers["eu-west"].state == "open"
        with pytest.raises(FeatureLookupError, match="circuit breaker open"):
            await source.get(CONFIG.item_entity, ITEMS[2:3])
    finally:
        link.release()
        await source.aclose()


async def test_a_late_answer_while_the_region_answers_others_is_shed_not_counted(
    gated: tuple[RegionSettings, GatedLink],
) -> None:
    home, link = gated
    await _seed(home)
    registry = CollectorRegistry()
    client = AsyncFeatureClient(
        "eu-west", [home], CONFIG.schemas(), registry=registry, timeout_s=0.25
    )
    source = EdgeCacheFeatureSource(client, coalesce=False)
    try:
        await source.get(CONFIG.item_entity, ITEMS[:1])
        link.hold(b"held-item")  # the replies of this one lookup's connection wait
        late = asyncio.ensure_future(source.get(CONFIG.item_entity, ["held-item"]))
        await _until(lambda: link.held == 1, "the held lookup asked")
        answered = 0
        while not late.done():  # meanwhile the region answers every other lookup
            await source.get(CONFIG.item_entity, ITEMS[answered % 20 : answered % 20 + 1])
            answered += 1
        with pytest.raises(QueueFullError, match="kept answering") as shed:
            late.result()
        assert shed.value.http_status == 429 and shed.value.retry_after_s == 0.25
        assert answered > 0
        assert _failures(registry) == {}
        assert client.breakers["eu-west"].state == "closed"
    finally:
        link.release()
        await source.aclose()
