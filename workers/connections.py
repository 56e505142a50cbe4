"""Slow and surplus clients: a header deadline and a connection cap for the aiohttp server.

aiohttp (3.14) bounds neither the time a client may take to send its request
headers (its keep-alive timer stops at the first byte, so a client sending one
byte every few seconds holds a connection for ever) nor the number of open
connections. :class:`GuardedTCPSite` listens like ``web.TCPSite`` but wraps
each connection's protocol in :class:`_GuardedProtocol`:

* a connection must deliver a request's headers within ``header_timeout_s``
  of opening, and of the first byte of each later request; otherwise it is
  closed (an idle keep-alive connection, which sends nothing, is left to
  aiohttp's own ``keepalive_timeout``);
* past ``max_connections`` open connections a new one is answered ``503``
  with ``Retry-After`` and closed at once;
* beside the other processes of one supervisor (``SO_REUSEPORT``), a process
  holding more than its share of the port's keep-alive connections closes
  the surplus one at a time, each after the answer it was carrying
  (``Connection: close``): see :class:`ConnectionGuard`'s ``over_share``.

The request body has its own deadline, enforced by the server around
``request.read()`` (``ServerConfig.body_timeout_s``).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Callable
from typing import Any, cast

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

__all__ = ["ConnectionGuard", "GuardedTCPSite", "OneLineBadRequests", "quiet_bad_requests"]

log = logging.getLogger(__name__)

_REFUSAL_BODY = (
    b'{"error": {"type": "OverloadedError", "message": "too many open connections; '
    b'retry shortly", "retryable": true, "retry_after_ms": 1000.0}}'
)
_REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\n"
    b"Content-Type: application/json\r\n"
    b"Retry-After: 1\r\n"
    b"Connection: close\r\n"
    b"Content-Length: " + str(len(_REFUSAL_BODY)).encode() + b"\r\n\r\n" + _REFUSAL_BODY
)


class ConnectionGuard:
    """Counts open connections and holds each one's header deadline.

    Args:
        header_timeout_s: Longest wait for a request's headers.
        max_connections: Most connections open at once.
        on_refused: Called when a connection is refused (over the cap).
        on_timeout: Called when a connection is closed for slow headers.
        on_open_change: Called with the number of open connections.
        over_share: Given this process's open connections less those already being
            closed, whether it holds more than its share of the port's (None: one
            process, nothing to share). Linux spreads new connections over the
            processes of one port by a hash of their addresses, never again once
            open: 64 keep-alive connections over 2 processes came out 27/37 to
            32/32, and the fuller process answers its clients later (its queue is
            longer) for as long as they stay connected. While this says so, each
            answer closes its connection after it is sent (``Connection: close``),
            one connection per surplus at a time; the client connects again and
            lands anywhere, so the split converges on even.
        on_shed: Called for every connection closed that way.
    """

    def __init__(
        self,
        *,
        header_timeout_s: float,
        max_connections: int,
        on_refused: Callable[[], None] = lambda: None,
        on_timeout: Callable[[], None] = lambda: None,
        on_open_change: Callable[[int], None] = lambda _open: None,
        over_share: Callable[[int], bool] | None = None,
        on_shed: Callable[[], None] = lambda: None,
    ) -> None:
        self.header_timeout_s = header_timeout_s
        self.max_connections = max_connections
        self.open = 0
        self.shedding = 0  # connections told to close after their answer, still open
        self._on_refused = on_refused
        self._on_timeout = on_timeout
        self._on_open_change = on_open_change
        self._over_share = over_share
        self._on_shed = on_shed
        self._by_handler: dict[RequestHandler, _GuardedProtocol] = {}

    def protocol(self, inner: RequestHandler) -> _GuardedProtocol:
        """Wrap the aiohttp protocol of one new connection."""
        return _GuardedProtocol(self, inner)

    def request_started(self, request: web.BaseRequest) -> None:
        """Headers arrived: stop the header deadline (the body has its own)."""
        guarded = self._by_handler.get(request.protocol)
        if guarded is not None:
            guarded.busy = True
            guarded.disarm()

    def request_finished(self, request: web.BaseRequest) -> None:
        """Answered: the next request's deadline starts with its first byte."""
        guarded = self._by_handler.get(request.protocol)
        if guarded is not None:
            guarded.busy = False
            guarded.began = None

    def request_began(self, request: web.BaseRequest) -> float | None:
        """``time.perf_counter()`` at the first byte of ``request`` (None: not known,
        e.g. a pipelined request whose bytes came while the previous one ran)."""
        guarded = self._by_handler.get(request.protocol)
        return None if guarded is None else guarded.began

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """aiohttp middleware marking each request's start and end on its connection."""
        self.request_started(request)
        try:
            response: web.StreamResponse = await handler(request)
            if self._over_share is not None and not response.prepared:
                self._shed(request, response, self._over_share)
            return response
        finally:
            self.request_finished(request)

    def _shed(
        self,
        request: web.BaseRequest,
        response: web.StreamResponse,
        over_share: Callable[[int], bool],
    ) -> None:
        """Close ``request``'s connection after ``response`` if this process holds more
        than its share of the port's connections (less those already closing)."""
        guarded = self._by_handler.get(request.protocol)
        if guarded is None or guarded.shed or not request.keep_alive:
            return
        if over_share(self.open - self.shedding):
            guarded.shed = True
            self.shedding += 1
            response.force_close()
            self._on_shed()


class _GuardedProtocol(asyncio.Protocol):
    """Delegates to aiohttp's protocol; adds the cap and the header deadline."""

    def __init__(self, guard: ConnectionGuard, inner: RequestHandler) -> None:
        self.guard = guard
        self.inner = inner
        self.busy = False
        self.began: float | None = None
        self.refused = False
        self.shed = False  # told to close after its current answer (ConnectionGuard)
        self.transport: asyncio.Transport | None = None
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)
        self.transport = transport
        guard = self.guard
        if guard.open >= guard.max_connections:
            self.refused = True
            guard._on_refused()
            transport.write(_REFUSAL)
            transport.close()
            return
        guard.open += 1
        guard._on_open_change(guard.open)
        guard._by_handler[self.inner] = self
        self.inner.connection_made(transport)
        self.arm()

    def arm(self) -> None:
        self.disarm()
        if self.transport is not None and not self.transport.is_closing():
            loop = asyncio.get_running_loop()
            self._deadline = loop.call_later(self.guard.header_timeout_s, self._expired)

    def disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.busy or self.transport is None:
            return
        self.guard._on_timeout()
        peer = self.transport.get_extra_info("peername")
        log.info(
            "closed a connection from %s: no complete request headers within %.1f s",
            peer[0] if isinstance(peer, tuple) else "?",
            self.guard.header_timeout_s,
        )
        self.inner.force_close()
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        if not self.busy and self._deadline is None:
            self.arm()  # the first byte of a new request starts its header deadline
        if not self.busy and self.began is None:
            self.began = time.perf_counter()
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        if not self.refused:
            self.inner.eof_received()
        return None

    def pause_writing(self) -> None:
        if not self.refused:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if not self.refused:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.refused:
            return
        self.disarm()
        self.guard._by_handler.pop(self.inner, None)
        self.guard.open -= 1
        if self.shed:
            self.guard.shedding -= 1
        self.guard._on_open_change(self.guard.open)
        self.inner.connection_lost(exc)


class GuardedTCPSite(web.BaseSite):
    """A TCP site whose connections go through a :class:`ConnectionGuard`.

    Args:
        runner: The set-up ``web.AppRunner``.
        host: Interface to bind.
        port: TCP port (0: any free one; read :attr:`port` after :meth:`start`).
        guard: The guard every connection goes through.
        backlog: Listen backlog.
        ssl_context: Serve TLS with it (the handshake must finish within the
            guard's header timeout).
        reuse_port: Bind with ``SO_REUSEPORT`` (several processes on one port).
    """

    __slots__ = ("_bound_port", "_guard", "_host", "_port", "_reuse_port", "_tls")

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        guard: ConnectionGuard,
        *,
        backlog: int = 128,
        ssl_context: ssl.SSLContext | None = None,
        reuse_port: bool = False,
    ) -> None:
        super().__init__(runner, backlog=backlog)
        self._tls = ssl_context
        self._reuse_port = reuse_port
        self._host = host
        self._port = port
        self._guard = guard
        self._bound_port = port

    @property
    def port(self) -> int:
        """The bound port (the requested one until started)."""
        return self._bound_port

    @property
    def name(self) -> str:
        return f"{'http' if self._tls is None else 'https'}://{self._host}:{self.port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        if server is None:
            raise RuntimeError("call runner.setup() before starting the site")
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: self._guard.protocol(server()),
            self._host,
            self._port,
            backlog=self._backlog,
            ssl=self._tls,
            reuse_port=self._reuse_port or None,
            ssl_handshake_timeout=self._guard.header_timeout_s if self._tls else None,
        )
        sockets = self._server.sockets
        self._bound_port = int(sockets[0].getsockname()[1]) if sockets else self._port


class OneLineBadRequests(logging.Filter):
    """On aiohttp's ``aiohttp.server`` logger: a request aiohttp's parser refused (a
    64 KB header line, thousands of headers, a malformed request line) is bad input,
    answered 400; it is logged as one line with the reason, not a traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError

        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            peer = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
            reason = (exc.message or type(exc).__name__).strip().splitlines()[0][:200]
            record.msg = "refused a bad request from %s (400): %s: %s"
            record.args = (peer, type(exc).__name__, reason)
            record.exc_info = None
            record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def quiet_bad_requests() -> None:
    """Install :class:`OneLineBadRequests` on ``aiohttp.server`` (once per process)."""
    logger = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, OneLineBadRequests) for f in logger.filters):
        logger.addFilter(OneLineBadRequests())
