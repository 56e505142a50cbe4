"""Fixtures of the edge cache integration tests: real redis-servers, one per region,
and a 3-node Redis Cluster, started by the same devstack code as ``edgefeed dev up``
(only the Redis services: these tests need no broker, database or Connect).

A pytest plugin, loaded by each test module with ``pytest_plugins``, not a
``conftest.py``: a second ``conftest`` module would shadow ``tests/conftest.py``
for the test modules that do ``from conftest import ...``."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from edge_cache import FeatureSchema, FeatureWriter, RegionSettings
from edgefeed.devstack import DevStack
from edgefeed.settings import EdgefeedSettings

#: The lookup deadline of the clients in tests of what a lookup answers, not of how
#: fast. The serving default (0.25 s) for the whole read, a cluster client's slot
#: discovery included, can pass on a machine whose cores a CPU hog holds.
READ_TIMEOUT_S = 5.0


@pytest.fixture(scope="session")
def redis_stack(
    stack_settings: EdgefeedSettings, state_dir: Path, redis_cluster_ports: list[int]
) -> Iterator[DevStack]:
    """The region caches and the cluster. Shares ports and state folder with the session's
    full ``devstack``, so whichever starts first owns the processes and both can coexist."""
    names = [f"redis-{region.name}" for region in stack_settings.regions]
    names += [f"redis-cluster-{i}" for i in range(1, len(redis_cluster_ports) + 1)]
    stack = DevStack(
        stack_settings,
        state_dir,
        redis_cluster_ports=redis_cluster_ports,
        with_connect=False,
        only=names,
    )
    try:
        stack.up()
        yield stack
    finally:
        stack.down()


@pytest.fixture
def regions(redis_stack: DevStack) -> Iterator[list[RegionSettings]]:
    """The three region settings (eu-west, us-east, ap-southeast), caches flushed."""
    settings = list(redis_stack.settings.regions)
    for region in settings:
        with redis.Redis.from_url(region.redis_url) as client:
            client.flushdb()
            client.script_flush()
    yield settings


@pytest.fixture
def cluster_region(redis_stack: DevStack, redis_cluster_ports: list[int]) -> RegionSettings:
    """A region whose cache is the 3-node Redis Cluster, flushed."""
    for port in redis_cluster_ports:
        with redis.Redis(host="127.0.0.1", port=port) as client:
            client.flushall()
            client.script_flush()
    return RegionSettings(
        name="eu-west",
        redis_url=f"redis://127.0.0.1:{redis_cluster_ports[0]}/0",
        residency_zone="eu",
        cluster=True,
    )


@pytest.fixture(params=["single", "cluster"])
def home(
    request: pytest.FixtureRequest, regions: list[RegionSettings], cluster_region: RegionSettings
) -> RegionSettings:
    """The home region eu-west alone (no failover), once on a single server and once on
    the cluster."""
    region = regions[0] if request.param == "single" else cluster_region
    return region.model_copy(update={"failover": []})


@pytest.fixture
def make_writer() -> Iterator[Callable[..., FeatureWriter]]:
    writers: list[FeatureWriter] = []

    def factory(region: RegionSettings, schemas: list[FeatureSchema], **kw: Any) -> FeatureWriter:
        writer = FeatureWriter.from_region(region, schemas, **kw)
        writers.append(writer)
        return writer

    yield factory
    for writer in writers:
        writer.close()


class BlackHole:
    """A TCP listener that accepts connections and never answers: a region that hangs."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._conns: list[socket.socket] = []
        self._stop = False
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            self._conns.append(conn)

    def close(self) -> None:
        self._stop = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        self.sock.close()
        for conn in self._conns:
            conn.close()
        self._thread.join(timeout=5)


@pytest.fixture
def black_hole() -> Iterator[BlackHole]:
    hole = BlackHole()
    yield hole
    hole.close()


class DribbleProxy:
    """A TCP proxy in front of a real redis-server that passes requests at once and
    answers one byte every ``interval_s``: a link slow enough to stall a reader whose
    timeout is per socket read, never idle long enough to trip it."""

    def __init__(self, upstream_port: int, interval_s: float = 0.05) -> None:
        self.upstream_port = upstream_port
        self.interval_s = interval_s
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self._stop = threading.Event()
        self._sockets: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream_port))
            self._sockets += [client, server]
            for target in (self._forward, self._dribble):
                thread = threading.Thread(target=target, args=(client, server), daemon=True)
                self._threads.append(thread)
                thread.start()

    def _forward(self, client: socket.socket, server: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                server.sendall(data)

    def _dribble(self, client: socket.socket, server: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := server.recv(65536):
                for i in range(len(data)):
                    if self._stop.wait(self.interval_s):
                        return
                    client.sendall(data[i : i + 1])

    def close(self) -> None:
        self._stop.set()
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
def dribble() -> Iterator[Callable[[RegionSettings], RegionSettings]]:
    """Puts a :class:`DribbleProxy` in front of a region: the region's settings, via it."""
    proxies: list[DribbleProxy] = []

    def through(region: RegionSettings) -> RegionSettings:
        port = int(region.redis_url.rsplit(":", 1)[1].split("/")[0])
        proxy = DribbleProxy(port)
        proxies.append(proxy)
        return region.model_copy(update={"redis_url": f"redis://127.0.0.1:{proxy.port}/0"})

    yield through
    for proxy in proxies:
        proxy.close()
