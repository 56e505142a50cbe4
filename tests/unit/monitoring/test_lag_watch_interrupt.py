"""Ctrl-C stops ``edgefeed lag --watch`` at once, even in the middle of a round.

The round here is stuck on a Kafka Connect that accepts the request and never
answers (timeout 3600 s): the process must not wait for it. No services run;
the other systems are closed loopback ports.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def silent_connect() -> Iterator[tuple[int, threading.Event]]:
    """A TCP server that reads one request and never answers; the event fires on the request."""
    asked = threading.Event()
    server = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def serve() -> None:
        try:
            conn, _ = server.accept()
        except OSError:  # closed by the fixture's teardown
            return
        accepted.append(conn)
        if conn.recv(65536):
            asked.set()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield int(server.getsockname()[1]), asked
    finally:
        server.close()
        for conn in accepted:
            conn.close()
        thread.join(timeout=10)


@pytest.mark.parametrize("as_json", [False, True])
def test_sigint_stops_watch_while_a_round_waits_on_a_silent_system(
    tmp_path: Path, silent_connect: tuple[int, threading.Event], as_json: bool
) -> None:
    port, asked = silent_connect
    settings = tmp_path / "edgefeed.yaml"
    settings.write_text(
        f"kafka: {{bootstrap_servers: '127.0.0.1:{_closed_port()}'}}\n"
        f"connect: {{url: 'http://127.0.0.1:{port}', timeout_s: 3600, retries: 0}}\n"
        f"database: {{port: {_closed_port()}}}\n"
        f"regions: [{{name: eu-west, redis_url: 'redis://127.0.0.1:{_closed_port()}/0',"
        " residency_zone: eu}]\n"
        "sources: [{name: shop, tables: [{name: users, key: [id]}]}]\n"
    )
    exe = Path(sys.executable).with_name("edgefeed")
    argv = [str(exe), "--settings", str(settings), "lag", "--watch", "--interval", "0.2"]
    with subprocess.Popen(
        [*argv, *(["--json"] if as_json else [])],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as process:
        try:
            # Deadlines for a hang, not a speed bound: the Connect read would last an hour.
            assert asked.wait(timeout=120), "lag --watch never asked Kafka Connect"
            process.send_signal(signal.SIGINT)
            out, err = process.communicate(timeout=120)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert "Traceback" not in err, err
    # No round completed (Connect never answered): the interrupted exit code.
    assert process.returncode == 130, (out, err)
