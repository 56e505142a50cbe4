"""The WAN links: one asyncio TCP proxy per link, shaping both directions.

Each connection accepted on a link's loopback port gets its own connection to
the endpoint behind the link, and two pumps (client -> endpoint, endpoint ->
client). A pump reads a chunk, asks the link's :class:`DirectionSchedule` when
it arrives, and writes it at that time. Bandwidth and delay belong to the link,
shared by its connections.

A cut is a black hole, the way a partition looks to TCP: nothing is refused or
reset. New connections are accepted but not carried on until the heal; bytes
of open connections stay queued (a pump stops reading once its queue is full,
like a full socket buffer) and are delivered, in order, at the heal. Clients
therefore see what a real partition shows them: requests that time out, not
errors. A connection whose client gave up meanwhile is closed when the heal
finds it closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from dataclasses import dataclass, replace
from typing import Any

from edgefeed.wan.shaping import DirectionSchedule, LinkParams

__all__ = ["Link", "LinkSpec"]

log = logging.getLogger("edgefeed.wan")

_CHUNK = 64 * 1024
_QUEUE_CHUNKS = 64  # per pump: about 4 MiB in flight at most, like a socket buffer
_ids = itertools.count(1)


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """One link: its name, where it listens, what it fronts, and how it shapes."""

    name: str
    listen_port: int
    target_host: str
    target_port: int
    params: LinkParams

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LinkSpec:
        host, _, port = str(data["target"]).rpartition(":")
        return cls(
            name=str(data["name"]),
            listen_port=int(data["listen_port"]),
            target_host=host,
            target_port=int(port),
            params=LinkParams(
                delay_ms=float(data.get("delay_ms", 0.0)),
                jitter_ms=float(data.get("jitter_ms", 0.0)),
                bandwidth_mbit=(
                    None if data.get("bandwidth_mbit") is None else float(data["bandwidth_mbit"])
                ),
            ),
        )


class Link:
    """A running link (see the module docstring for what a cut does)."""

    def __init__(self, spec: LinkSpec) -> None:
        self.spec = spec
        self.up = DirectionSchedule(spec.params)  # client -> endpoint
        self.down = DirectionSchedule(spec.params)  # endpoint -> client
        self._healed = asyncio.Event()
        self._healed.set()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.bytes_up = 0
        self.bytes_down = 0
        self.connections_total = 0
        self.connections_open = 0
        self.observed_delay_ms = 0.0  # moving average of read-to-write time
        self.cut_since: float | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def params(self) -> LinkParams:
        return self.up.params

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.spec.listen_port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        # asyncio's start_server (Python 3.11) asks a finished connection task for its
        # exception, which raises for a cancelled one and logs a traceback per open
        # connection at close(): a connection cut short by close() ends normally.
        with contextlib.suppress(asyncio.CancelledError):
            await self._carry(client_r, client_w)

    def cut(self) -> None:
        if self._healed.is_set():
            self.cut_since = time.time()
        self._healed.clear()

    def heal(self) -> None:
        self.cut_since = None
        self._healed.set()

    def set(
        self,
        *,
        delay_ms: float | None = None,
        jitter_ms: float | None = None,
        bandwidth_mbit: float | None = None,
    ) -> LinkParams:
        """Change delay, jitter or bandwidth; None leaves a value as it is and
        ``bandwidth_mbit=0`` removes the cap.

        Raises:
            LinkSettingError: a value is out of range (the link keeps its settings).
        """
        params = self.params
        if delay_ms is not None:
            params = replace(params, delay_ms=delay_ms)
        if jitter_ms is not None:
            params = replace(params, jitter_ms=jitter_ms)
        if bandwidth_mbit is not None:
            params = replace(params, bandwidth_mbit=bandwidth_mbit or None)
        self.up.update(params)
        self.down.update(params)
        return params

    def status(self) -> dict[str, Any]:
        params = self.params
        return {
            "name": self.name,
            "listen": f"127.0.0.1:{self.spec.listen_port}",
            "target": f"{self.spec.target_host}:{self.spec.target_port}",
            "state": "healed" if self._healed.is_set() else "cut",
            "cut_for_s": None if self.cut_since is None else round(time.time() - self.cut_since, 3),
            "delay_ms": params.delay_ms,
            "jitter_ms": params.jitter_ms,
            "bandwidth_mbit": params.bandwidth_mbit,
            "observed_delay_ms": round(self.observed_delay_ms, 3),
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
            "connections_open": self.connections_open,
            "connections_total": self.connections_total,
        }

    async def _carry(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        self.connections_total += 1
        self.connections_open += 1
        stream = next(_ids)
        upstream_w: asyncio.StreamWriter | None = None
        try:
            await self._healed.wait()
            try:
                upstream_r, upstream_w = await asyncio.open_connection(
                    self.spec.target_host, self.spec.target_port
                )
            except OSError as exc:
                log.info("link %s: endpoint unreachable: %s", self.name, exc)
                return
            pumps = [
                asyncio.create_task(self._pump(client_r, upstream_w, self.up, stream, "up")),
                asyncio.create_task(self._pump(upstream_r, client_w, self.down, stream, "down")),
            ]
            try:
                # One side closing (or failing) ends the connection for both.
                await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for pump in pumps:
                    pump.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)
        finally:
            self.connections_open -= 1
            self.up.forget(stream)
            self.down.forget(stream)
            for writer in (client_w, upstream_w):
                if writer is not None:
                    writer.close()
            if task is not None:
                self._tasks.discard(task)

    async def _pump(
        self,
        source: asyncio.StreamReader,
        sink: asyncio.StreamWriter,
        schedule: DirectionSchedule,
        stream: int,
        direction: str,
    ) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, float, bytes] | None] = asyncio.Queue(_QUEUE_CHUNKS)

        async def read() -> None:
            try:
                while data := await source.read(_CHUNK):
                    now = loop.time()
                    await queue.put((now, schedule.arrival(stream, len(data), now), data))
            except OSError:
                pass
            await queue.put(None)

        reader = asyncio.create_task(read())
        try:
            while (item := await queue.get()) is not None:
                read_at, arrives, data = item
                wait = arrives - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                await self._healed.wait()
                sink.write(data)
                await sink.drain()
                took_ms = (loop.time() - read_at) * 1000.0
                self.observed_delay_ms += (took_ms - self.observed_delay_ms) * 0.1
                if direction == "up":
                    self.bytes_up += len(data)
                else:
                    self.bytes_down += len(data)
        except OSError:
            pass
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
