"""The WAN emulator's proxy and control API on loopback (in-process, no stack)."""

from __future__ import annotations

import asyncio
import socket
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from edgefeed.wan import ControlServer, Link, LinkParams, LinkSpec, UnknownLinkError, WanControl
from edgefeed.wan.exceptions import LinkSettingError, WanError


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()


@pytest.fixture
async def link() -> AsyncIterator[Link]:
    echo = await asyncio.start_server(_echo, "127.0.0.1", 0)
    port = echo.sockets[0].getsockname()[1]
    spec = LinkSpec("central-eu-west", _free_port(), "127.0.0.1", port, LinkParams(delay_ms=50))
    running = Link(spec)
    await running.start()
    yield running
    await running.close()
    echo.close()
    await echo.wait_closed()


async def _connect(link: Link) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", link.spec.listen_port)


async def test_bytes_cross_in_order_and_take_at_least_the_delay_each_way(link: Link) -> None:
    reader, writer = await _connect(link)
    started = time.monotonic()
    payload = b"".join(i.to_bytes(4, "big") for i in range(50_000))
    writer.write(payload)
    await writer.drain()
    echoed = await reader.readexactly(len(payload))
    assert echoed == payload
    assert time.monotonic() - started >= 0.1  # 50 ms there, 50 ms back
    assert link.bytes_up == len(payload) and link.bytes_down == len(payload)
    writer.close()


async def test_a_cut_holds_the_bytes_and_the_heal_delivers_them_in_order(link: Link) -> None:
    reader, writer = await _connect(link)
    writer.write(b"before")
    await writer.drain()
    assert await reader.readexactly(6) == b"before"
    link.cut()
    writer.write(b"during-the-cut")
    await writer.drain()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(reader.readexactly(14), timeout=0.4)
    # A connection opened during the cut is accepted but carries nothing either.
    other_reader, other_writer = await _connect(link)
    other_writer.write(b"new")
    await other_writer.drain()
    assert link.status()["state"] == "cut"
    link.heal()
    assert await reader.readexactly(14) == b"during-the-cut"
    assert await other_reader.readexactly(3) == b"new"
    writer.close()
    other_writer.close()


async def test_an_unreachable_endpoint_closes_the_client_connection() -> None:
    spec = LinkSpec("dead", _free_port(), "127.0.0.1", _free_port(), LinkParams())
    running = Link(spec)
    await running.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", spec.listen_port)
        assert await reader.read(10) == b""
        writer.close()
        # The monitor's "reachable" relies on it: the link names the endpoint it failed.
        assert f"127.0.0.1:{spec.target_port}" in running.status()["endpoint_error"]
    finally:
        await running.close()


async def test_set_changes_the_link_and_rejects_bad_values(link: Link) -> None:
    link.set(delay_ms=5, bandwidth_mbit=10)
    assert (link.params.delay_ms, link.params.bandwidth_mbit) == (5, 10)
    link.set(bandwidth_mbit=0)
    assert link.params.bandwidth_mbit is None
    with pytest.raises(LinkSettingError, match="delay_ms -3"):
        link.set(delay_ms=-3)
    assert link.params.delay_ms == 5


async def test_control_api_over_the_unix_socket(link: Link) -> None:
    folder = Path(tempfile.mkdtemp(prefix="edgefeed-wan-"))
    path = folder / "wan.sock"
    server = ControlServer({link.name: link}, path)
    await server.start()
    control = WanControl(path)
    try:
        assert path.stat().st_mode & 0o077 == 0  # only the owner may connect
        status = await asyncio.to_thread(control.status)
        assert [entry["name"] for entry in status] == ["central-eu-west"]
        cut = await asyncio.to_thread(control.cut, "central-eu-west")
        assert cut["state"] == "cut"
        healed = await asyncio.to_thread(control.heal, "central-eu-west")
        assert healed["state"] == "healed"
        changed = await asyncio.to_thread(
            lambda: control.set("central-eu-west", delay_ms=100, bandwidth_mbit=20)
        )
        assert (changed["delay_ms"], changed["bandwidth_mbit"]) == (100, 20)
        with pytest.raises(UnknownLinkError, match="central-eu-west"):
            await asyncio.to_thread(control.cut, "central-mars")
        with pytest.raises(LinkSettingError, match="jitter_ms -1"):
            await asyncio.to_thread(lambda: control.set("central-eu-west", jitter_ms=-1))
        with pytest.raises(WanError, match="unknown op 'explode'"):
            await asyncio.to_thread(lambda: control.request({"op": "explode"}))
        assert (await asyncio.to_thread(control.status))[0]["delay_ms"] == 100  # still serving
    finally:
        await server.close()
        path.unlink(missing_ok=True)
        folder.rmdir()
