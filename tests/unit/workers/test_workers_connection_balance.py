"""A worker process beside others on one port sheds the keep-alive connections it holds
beyond its share (issue 35): the rule (:meth:`Cluster.over_share`) and the shedding
itself (:class:`ConnectionGuard`), on a real aiohttp server and real sockets."""

from __future__ import annotations

import asyncio
import socket

from aiohttp import web

from workers.connections import ConnectionGuard, GuardedTCPSite
from workers.supervisor import ChildSlot, Cluster

READY, STARTING = 1, 0


def _cluster(index: int, states: list[int], connections: list[int] | None) -> Cluster:
    return Cluster(ChildSlot(index, len(states), 0, states, None, connections))


def test_a_child_is_over_its_share_above_the_ready_children_s_mean_rounded_up() -> None:
    # Ready children 0 and 1 hold 5 + 3 = 8: a share of 4 each. Child 2 is starting
    # (restarted after a crash): it holds none yet and does not count.
    cluster = _cluster(0, [READY, READY, STARTING], [5, 3, 9])
    assert cluster.over_share(5) is True
    assert cluster.over_share(4) is False
    # Nine over two: a share of 5 (rounded up), so an odd total never churns.
    assert _cluster(0, [READY, READY], [5, 4]).over_share(5) is False
    assert _cluster(1, [READY, READY], [3, 6]).over_share(6) is True


def test_nothing_is_shed_with_nowhere_else_to_go() -> None:
    # One ready child (the other restarting): its connections have nowhere to go.
    assert _cluster(0, [READY, STARTING], [64, 0]).over_share(64) is False
    # A child not ready itself (draining, starting) leaves its connections alone.
    assert _cluster(0, [STARTING, READY, READY], [9, 1, 1]).over_share(9) is False
    # No shared counts (a slot from before them): nothing to compare with.
    assert _cluster(0, [READY, READY], None).over_share(100) is False


def test_set_connections_is_seen_by_every_child() -> None:
    states, connections = [READY, READY], [0, 0]
    first, second = _cluster(0, states, connections), _cluster(1, states, connections)
    first.set_connections(7)
    second.set_connections(1)
    assert connections == [7, 1]
    assert first.over_share(7) is True and second.over_share(1) is False


async def _exchange(sock: socket.socket) -> bytes:
    """One keep-alive GET on a connected socket; the response head."""
    loop = asyncio.get_running_loop()
    await loop.sock_sendall(sock, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data or not data.endswith(b"ok"):
        chunk = await loop.sock_recv(sock, 4096)
        if not chunk:
            break
        data += chunk
    return data.split(b"\r\n\r\n", 1)[0].lower()


async def _closed_by_server(sock: socket.socket) -> bool:
    loop = asyncio.get_running_loop()
    try:
        return await asyncio.wait_for(loop.sock_recv(sock, 1), 5) == b""
    except TimeoutError:
        return False


async def test_the_surplus_connections_close_one_at_a_time_after_their_answers() -> None:
    shed: list[int] = []
    share = 1  # this process may hold one connection: the others are surplus
    guard = ConnectionGuard(
        header_timeout_s=10,
        max_connections=100,
        over_share=lambda holding: holding > share,
        on_shed=lambda: shed.append(1),
    )

    async def hello(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(middlewares=[guard.middleware])
    app.router.add_get("/", hello)
    runner = web.AppRunner(app)
    await runner.setup()
    site = GuardedTCPSite(runner, "127.0.0.1", 0, guard)
    await site.start()
    sockets = []
    try:
        for _ in range(3):
            sock = socket.socket()
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", site.port))
            sockets.append(sock)

        async def three_open() -> None:
            while guard.open < 3:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(three_open(), 10)
        heads = [await _exchange(sock) for sock in sockets]
        # Three open, a share of one: the first two answers carry Connection: close
        # (each counted once as closing), the third keeps its connection.
        assert [b"connection: close" in head for head in heads] == [True, True, False]
        assert all(head.startswith(b"http/1.1 200") for head in heads)
        assert [await _closed_by_server(sock) for sock in sockets[:2]] == [True, True]

        async def settled() -> None:
            while guard.open != 1 or guard.shedding != 0:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(settled(), 10)
        assert len(shed) == 2
        # At its share, the kept connection stays open request after request.
        for _ in range(3):
            assert b"connection: close" not in await _exchange(sockets[2])
        assert len(shed) == 2 and guard.open == 1
    finally:
        for sock in sockets:
            sock.close()
        await runner.cleanup()
