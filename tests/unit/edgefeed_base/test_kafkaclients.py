"""The factory of the synchronous Kafka clients (kafka-python): edgefeed's security
settings reach the clients, the password never shows (repr, errors, kafka-python's
own DEBUG log), a broker that cannot be reached is a typed error naming the servers
and the setting, and a client that could not connect leaves no thread behind.

No broker runs here: the servers are a closed loopback port or a TCP server that
accepts and says nothing. The reads on the real broker are in
tests/integration/monitoring/test_monitoring.py.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from edgefeed_base.errors import EdgefeedError
from edgefeed_base.kafkaclients import (
    KafkaClients,
    KafkaOptionsError,
    KafkaUnavailableError,
    in_daemon_thread,
)
from pipeline.settings import KafkaSecuritySettings

SECRET = "k4fka-S3cret-pw"


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def silent_broker() -> Iterator[str]:
    """A TCP server that accepts connections and never answers a request."""
    server = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            accepted.append(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(timeout=10)
        server.close()
        for conn in accepted:
            conn.close()


def sasl_options(tmp_path: Path, protocol: str = "SASL_PLAINTEXT") -> dict[str, Any]:
    (tmp_path / "kafka-pw").write_text(SECRET + "\n")
    security = KafkaSecuritySettings(
        protocol=protocol,  # type: ignore[arg-type]
        sasl_mechanism="PLAIN",
        username="edgefeed",
        password_file=tmp_path / "kafka-pw",
    )
    return security.aiokafka_options()


def kafka_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kafka-io-")]


def test_the_settings_reach_kafka_python_and_the_password_shows_nowhere(
    tmp_path: Path, silent_broker: str, caplog: pytest.LogCaptureFixture
) -> None:
    clients = KafkaClients(
        (silent_broker,),
        client_id="edgefeed-test",
        request_timeout_ms=1000,
        options=sasl_options(tmp_path),
    )
    assert SECRET not in repr(clients)
    with (
        caplog.at_level(logging.DEBUG, logger="kafka"),
        pytest.raises(KafkaUnavailableError) as info,
    ):
        clients.admin()
    # kafka-python logs the admin client's whole configuration at DEBUG level.
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "'security_protocol': 'SASL_PLAINTEXT'" in logged
    assert "'sasl_mechanism': 'PLAIN'" in logged
    assert "'sasl_plain_username': 'edgefeed'" in logged
    assert "'sasl_plain_password': '**********'" in logged
    assert SECRET not in logged
    error = info.value
    assert isinstance(error, EdgefeedError) and error.retryable
    assert silent_broker in str(error) and "kafka.bootstrap_servers" in str(error)
    assert SECRET not in str(error) and SECRET not in repr(error)
    assert error.servers == (silent_broker,)


def test_the_password_kafka_python_sends_is_the_real_one(
    tmp_path: Path, silent_broker: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stars are only its repr: the SASL PLAIN exchange carries the password."""
    import kafka.net.compat
    from kafka.net.sasl.plain import SaslMechanismPlain

    seen: list[dict[str, Any]] = []
    real = kafka.net.compat.KafkaNetClient

    class Recording(real):  # type: ignore[misc,valid-type]
        def __init__(self, **configs: Any) -> None:
            seen.append(configs)
            super().__init__(**configs)

    monkeypatch.setattr(kafka.net.compat, "KafkaNetClient", Recording)
    clients = KafkaClients(
        (silent_broker,), request_timeout_ms=1000, options=sasl_options(tmp_path)
    )
    with pytest.raises(KafkaUnavailableError):
        clients.consumer()
    assert seen, "the factory did not build kafka-python's network client"
    config = seen[0]
    assert config["security_protocol"] == "SASL_PLAINTEXT"
    assert config["group_id"] is None and config["enable_auto_commit"] is False
    assert config["bootstrap_timeout_ms"] == 1000
    sent = SaslMechanismPlain(**config).auth_bytes()
    assert sent == b"\0".join([b"edgefeed", b"edgefeed", SECRET.encode()])


def test_tls_settings_hand_kafka_python_the_settings_context(tmp_path: Path) -> None:
    security = KafkaSecuritySettings(protocol="SSL", check_hostname=False)
    clients = KafkaClients(("127.0.0.1:9093",), options=security.aiokafka_options())
    assert clients.options["security_protocol"] == "SSL"
    context = clients.options["ssl_context"]
    assert context.check_hostname is False


@pytest.mark.parametrize("make", ["admin", "consumer"])
def test_an_unreachable_broker_is_a_retryable_error_and_leaves_no_thread(make: str) -> None:
    before = kafka_threads()
    servers = f"127.0.0.1:{_closed_port()}"
    clients = KafkaClients((servers,), request_timeout_ms=1000)
    for _ in range(3):  # a monitor retries every round
        with pytest.raises(KafkaUnavailableError) as info:
            getattr(clients, make)()
        assert info.value.retryable
        assert f"brokers {servers}" in str(info.value)
        assert "is the broker running and kafka.bootstrap_servers right?" in str(info.value)
    assert kafka_threads() == before
    gc.collect()  # a socket left open would fail the test here (ResourceWarning)


def test_unknown_options_are_refused_by_name() -> None:
    with pytest.raises(KafkaOptionsError, match="sasl_plain_pasword") as info:
        KafkaClients(("127.0.0.1:9092",), options={"sasl_plain_pasword": SECRET})
    assert isinstance(info.value, ValueError)
    assert SECRET not in str(info.value)


def test_security_options_cannot_come_from_a_consumer_override() -> None:
    clients = KafkaClients(("127.0.0.1:9092",))
    with pytest.raises(KafkaOptionsError, match="security_protocol"):
        clients.consumer(security_protocol="PLAINTEXT")


@pytest.mark.parametrize("servers", ["127.0.0.1:9092", ()])
def test_servers_must_be_a_list_of_host_ports(servers: Any) -> None:
    with pytest.raises(KafkaOptionsError, match=r"kafka\.bootstrap_servers must list"):
        KafkaClients(servers)


def test_a_refused_option_names_the_option() -> None:
    clients = KafkaClients((f"127.0.0.1:{_closed_port()}",), request_timeout_ms=100)
    # kafka-python needs the request timeout above the consumer's fetch wait.
    with pytest.raises(KafkaOptionsError, match="fetch_max_wait_ms"):
        clients.consumer(fetch_max_wait_ms=500)
    gc.collect()  # a socket left open would fail the test here (ResourceWarning)


async def test_in_daemon_thread_returns_and_raises_like_the_call() -> None:
    def double(x: int) -> int:
        return 2 * x

    def broken() -> None:
        raise KafkaUnavailableError("down")

    assert await in_daemon_thread(double, 21) == 42
    with pytest.raises(KafkaUnavailableError, match="down"):
        await in_daemon_thread(broken)


async def test_a_cancelled_call_does_not_hold_the_loop() -> None:
    """Cancelling the await returns at once; the call goes on in its daemon thread."""
    release = threading.Event()
    task = asyncio.create_task(in_daemon_thread(release.wait, 60))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    release.set()


def test_authorized_operations_with_unknown_codes_are_read_not_refused() -> None:
    """Tansu reports every bit of DescribeGroups' authorized operations set; kafka-python
    3.0.12 alone raised ``ValueError: 15 is not a valid ACLOperation`` on them, and no
    group's members could be read."""
    from edgefeed_base.kafkaclients import _admin_class

    admin = _admin_class()
    group = {"group_id": "g", "group_state": "Empty", "authorized_operations": set(range(32))}
    read = admin._process_acl_operations(object.__new__(admin), group)
    assert read["group_state"] == "Empty"
    assert read["authorized_operations"][:2] == ["READ", "WRITE"]
    assert "DESCRIBE_TOKENS" in read["authorized_operations"]
    assert len(read["authorized_operations"]) == 12  # codes 3..14


def test_closing_a_client_closes_the_sockets_its_connections_left_open() -> None:
    """kafka-python 3.0.12 drops the connected socket of a connection still being set
    up when its client closes (freed later with a ResourceWarning, in whatever code
    runs then): closing a client built by KafkaClients closes every socket its
    connections opened, and the client's own close still runs."""
    import weakref

    from edgefeed_base.kafkaclients import _SOCKETS, _close_sockets_on_close

    class Net:  # stands for a KafkaNetClient's IO loop
        pass

    class NetClient:
        def __init__(self) -> None:
            self._net = Net()

    class Client:
        closed = False

        def close(self) -> None:
            self.closed = True

    net_client, client = NetClient(), Client()
    left, peer = socket.socketpair()
    _SOCKETS.setdefault(net_client._net, weakref.WeakSet()).add(left)
    _close_sockets_on_close(client, [net_client])
    try:
        assert left.fileno() != -1
        client.close()
        assert client.closed
        assert left.fileno() == -1, "the socket the client's connection left open"
    finally:
        left.close()
        peer.close()
