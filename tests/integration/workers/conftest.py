"""A real redis-server on a free loopback port, standing in for a region's edge cache.

Started once per session (the same binary the local stack runs), flushed before
each test, stopped at the end even when tests fail.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import redis
import redis.asyncio as aioredis


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def workers_redis_url() -> Iterator[str]:
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    workdir = tempfile.mkdtemp(prefix="edgefeed-workers-redis-")
    for _attempt in range(5):
        port = _free_port()
        process = subprocess.Popen(
            [
                binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                workdir,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=port)
        deadline = time.monotonic() + 10
        while process.poll() is None and time.monotonic() < deadline:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.01)
        if process.poll() is None and time.monotonic() < deadline:
            break
        process.kill()
        process.wait()
    else:
        pytest.fail("could not start redis-server on a free port")
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        client.close()
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
async def region_cache(workers_redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """An empty edge cache (the session's Redis, flushed)."""
    client = aioredis.Redis.from_url(workers_redis_url)
    await client.flushdb()
    try:
        yield client
    finally:
        await client.aclose()
