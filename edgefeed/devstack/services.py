"""The services of the local stack: how each is prepared, started and probed."""

from __future__ import annotations

import json
import os
import pwd
import signal
import socket
import struct
import subprocess
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import psycopg
import redis
import requests

from edgefeed.devstack import binaries
from edgefeed.devstack.exceptions import DevStackError

__all__ = [
    "BrokerService",
    "ConnectService",
    "PostgresService",
    "RedisService",
    "Service",
    "WanService",
    "kafka_api_versions_ok",
]

LOOPBACK = "127.0.0.1"
_UNIX_PATH_MAX = 107  # sun_path is 108 bytes on Linux, with the terminating NUL


@dataclass(slots=True)
class Service(ABC):
    """One process of the local stack.

    Attributes:
        name: Unique name, used for the pid file, the log file and ``dev logs NAME``.
        port: The loopback TCP port it serves.
        setting: The settings key that chose the port, named in port errors.
        home: Its own folder under the state folder.
    """

    name: str
    port: int
    setting: str
    home: Path
    start_timeout_s: float = 60.0
    stop_signal: signal.Signals = signal.SIGTERM
    depends_on: tuple[str, ...] = ()
    kind: str = field(default="service", init=False)

    def prepare(self) -> None:  # noqa: B027 - optional hook
        """Create folders and config files before the first start (idempotent)."""

    @abstractmethod
    def argv(self) -> list[str]:
        """The command line that runs the service in the foreground."""

    def env(self) -> dict[str, str] | None:
        return None

    def user(self) -> str | None:
        return None

    @abstractmethod
    def probe(self) -> str | None:
        """None when the service answers as it should, else why not."""

    def after_start(self) -> None:  # noqa: B027 - optional hook
        """Runs once the service is healthy (create a database, form a cluster)."""


def kafka_api_versions_ok(host: str, port: int, timeout_s: float = 2.0) -> str | None:
    """Send a Kafka ApiVersions v0 request and check the answer.

    A raw request rather than a client library: the probe must work from sync
    code, inside or outside an event loop, in a few milliseconds.
    """
    client_id = b"edgefeed-probe"
    correlation_id = 0x0EDF
    body = struct.pack(">hhih", 18, 0, correlation_id, len(client_id)) + client_id
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(struct.pack(">i", len(body)) + body)
            header = _recv_exact(sock, 4)
            size = struct.unpack(">i", header)[0]
            payload = _recv_exact(sock, size)
    except OSError as exc:
        return f"no Kafka answer on {host}:{port}: {exc.strerror or exc}"
    got_id, error_code = struct.unpack(">ih", payload[:6])
    if got_id != correlation_id:
        return f"{host}:{port} answered with a foreign correlation id: not a Kafka broker?"
    if error_code != 0:
        return f"{host}:{port} answered ApiVersions with error code {error_code}"
    return None


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < size:
        chunk = sock.recv(size - len(chunks))
        if not chunk:
            raise ConnectionError("connection closed mid-answer")
        chunks.extend(chunk)
    return bytes(chunks)


@dataclass(slots=True)
class BrokerService(Service):
    """Tansu, a Kafka-protocol broker, with in-memory storage (dev and tests only)."""

    kind: str = field(default="kafka-broker", init=False)

    def argv(self) -> list[str]:
        url = f"tcp://{LOOPBACK}:{self.port}"
        return [
            binaries.tansu_binary(),
            "broker",
            "--listener-url",
            url,
            "--advertised-listener-url",
            url,
            "--storage-engine",
            "memory://tansu/",
            "--cluster-id",
            "edgefeed-dev",
        ]

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("RUST_LOG", "warn")
        return env

    def probe(self) -> str | None:
        return kafka_api_versions_ok(LOOPBACK, self.port)


@dataclass(slots=True)
class RedisService(Service):
    """One redis-server: a region's edge cache, or one node of a Redis Cluster."""

    cluster: bool = False
    kind: str = field(default="redis", init=False)

    def prepare(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)

    def argv(self) -> list[str]:
        argv = [
            binaries.redis_server_binary(),
            "--port",
            str(self.port),
            "--bind",
            LOOPBACK,
            "--dir",
            str(self.home),
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--protected-mode",
            "yes",
        ]
        if self.cluster:
            argv += [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                str(self.home / "nodes.conf"),
                "--cluster-node-timeout",
                "2000",
            ]
        return argv

    def probe(self) -> str | None:
        try:
            with redis.Redis(host=LOOPBACK, port=self.port, socket_timeout=2) as client:
                client.ping()
        except redis.RedisError as exc:
            return f"redis on {LOOPBACK}:{self.port} does not answer PING: {exc}"
        return None


@dataclass(slots=True)
class PostgresService(Service):
    """PostgreSQL 15 with ``wal_level=logical``, its own cluster made by initdb.

    As root, the server runs as the ``postgres`` system user (PostgreSQL refuses
    to run as root). With a password in the settings, TCP connections must
    authenticate with it (scram-sha-256); the Unix socket stays trusted.
    """

    dbname: str = "edgefeed"
    superuser: str = "postgres"
    password: str = ""
    kind: str = field(default="postgresql", init=False)
    stop_signal: signal.Signals = signal.SIGINT  # "fast" shutdown

    @property
    def data_dir(self) -> Path:
        return self.home / "data"

    @property
    def socket_dir(self) -> Path:
        return self.home / "sock"

    def user(self) -> str | None:
        return "postgres" if os.geteuid() == 0 else None

    def _chown(self, path: Path) -> None:
        owner = self.user()
        if owner is not None:
            entry = pwd.getpwnam(owner)
            os.chown(path, entry.pw_uid, entry.pw_gid)

    def _check_traversable(self) -> None:
        if self.user() is None:
            return
        for parent in [self.home, *self.home.parents]:
            if parent.exists() and not os.stat(parent).st_mode & 0o001:
                raise DevStackError(
                    f"PostgreSQL runs as user 'postgres', which cannot enter {parent} "
                    f"(mode {oct(os.stat(parent).st_mode & 0o777)}); choose a state folder "
                    "whose parents are world-executable (chmod o+x) with --state-dir"
                )

    def prepare(self) -> None:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            if os.geteuid() == 0:
                raise DevStackError(
                    "running as root, PostgreSQL needs the 'postgres' system user; install "
                    "postgresql-15 from Debian (it creates the user) or run as a normal user"
                ) from None
        self.home.mkdir(parents=True, exist_ok=True)
        self._chown(self.home)
        self._check_traversable()
        for folder in (self.data_dir, self.socket_dir):
            folder.mkdir(mode=0o700, exist_ok=True)
            self._chown(folder)
        if (self.data_dir / "PG_VERSION").exists():
            return
        pwfile = self.home / "pwfile"
        argv = [
            str(binaries.postgres_bindir() / "initdb"),
            "-D",
            str(self.data_dir),
            "-U",
            self.superuser,
            "--encoding=UTF8",
            "--locale=C",
            "--no-sync",
            "--auth-local=trust",
            "--auth-host=" + ("scram-sha-256" if self.password else "trust"),
        ]
        if self.password:
            pwfile.write_text(self.password)
            pwfile.chmod(0o600)
            self._chown(pwfile)
            argv.append(f"--pwfile={pwfile}")
        try:
            result = subprocess.run(
                argv, capture_output=True, text=True, user=self.user(), check=False, timeout=120
            )
        finally:
            pwfile.unlink(missing_ok=True)
        if result.returncode != 0:
            raise DevStackError(f"initdb failed for {self.data_dir}: {result.stderr.strip()}")

    def argv(self) -> list[str]:
        settings = {
            "listen_addresses": LOOPBACK,
            "port": str(self.port),
            "unix_socket_directories": str(self.socket_dir),
            "wal_level": "logical",
            "max_wal_senders": "10",
            "max_replication_slots": "10",
            # Commit times of current row versions: point-in-time training sets read them
            # (pipeline.training, docs/training.md).
            "track_commit_timestamp": "on",
            # Development only: the stack is disposable, speed matters more than durability.
            "fsync": "off",
            "full_page_writes": "off",
            "shared_buffers": "64MB",
            "log_min_messages": "warning",
        }
        argv = [str(binaries.postgres_bindir() / "postgres"), "-D", str(self.data_dir)]
        for key, value in settings.items():
            argv += ["-c", f"{key}={value}"]
        return argv

    def _connect(self, dbname: str) -> psycopg.Connection[tuple[object, ...]]:
        return psycopg.connect(
            host=str(self.socket_dir),
            port=self.port,
            dbname=dbname,
            user=self.superuser,
            connect_timeout=2,
            autocommit=True,
        )

    def probe(self) -> str | None:
        try:
            with self._connect("postgres") as conn:
                row = conn.execute("SHOW wal_level").fetchone()
        except psycopg.Error as exc:
            return f"PostgreSQL on port {self.port} does not accept connections: {exc}"
        if row is None or row[0] != "logical":
            return f"PostgreSQL on port {self.port} runs with wal_level={row}, not logical"
        return None

    def after_start(self) -> None:
        with self._connect("postgres") as conn:
            exists = conn.execute(
                "SELECT 1 FROM pg_database WHERE datname = %s", (self.dbname,)
            ).fetchone()
            if exists is None:
                conn.execute(
                    psycopg.sql.SQL("CREATE DATABASE {}").format(
                        psycopg.sql.Identifier(self.dbname)
                    )
                )


@dataclass(slots=True)
class ConnectService(Service):
    """Kafka Connect 3.9 (distributed mode) with the Debezium 3.1 PostgreSQL connector."""

    bootstrap: str = ""
    group_id: str = "edgefeed-connect"
    heap: str = "384m"
    providers: dict[str, str] = field(default_factory=dict)
    kind: str = field(default="kafka-connect", init=False)

    def prepare(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        internal = "_edgefeed_connect"
        props = {
            "bootstrap.servers": self.bootstrap,
            "group.id": self.group_id,
            "listeners": f"http://{LOOPBACK}:{self.port}",
            "rest.advertised.host.name": LOOPBACK,
            "rest.advertised.port": str(self.port),
            "key.converter": "org.apache.kafka.connect.json.JsonConverter",
            "value.converter": "org.apache.kafka.connect.json.JsonConverter",
            "config.storage.topic": f"{internal}_configs",
            "offset.storage.topic": f"{internal}_offsets",
            "status.storage.topic": f"{internal}_status",
            "config.storage.replication.factor": "1",
            "offset.storage.replication.factor": "1",
            "status.storage.replication.factor": "1",
            "offset.storage.partitions": "1",
            "status.storage.partitions": "1",
            "offset.flush.interval.ms": "1000",
            # Tansu answers a new group's join after about half the session timeout.
            "session.timeout.ms": "6000",
            "heartbeat.interval.ms": "2000",
            "scheduled.rebalance.max.delay.ms": "0",
            "plugin.discovery": "service_load",
            # Without these, the Java clients flood the log asking the broker for
            # client-metrics push (KIP-714), which Tansu does not support.
            "enable.metrics.push": "false",
            "producer.enable.metrics.push": "false",
            "consumer.enable.metrics.push": "false",
            "admin.enable.metrics.push": "false",
            # Config providers: only those the settings use, each limited to
            # what the connector reads (connectors.config.worker_provider_properties).
            **self.providers,
        }
        (self.home / "worker.properties").write_text(
            "".join(f"{key}={value}\n" for key, value in props.items())
        )
        (self.home / "log4j2.properties").write_text(
            "rootLogger.level=INFO\n"
            "rootLogger.appenderRef.stdout.ref=STDOUT\n"
            "appender.stdout.type=Console\n"
            "appender.stdout.name=STDOUT\n"
            "appender.stdout.layout.type=PatternLayout\n"
            "appender.stdout.layout.pattern=[%d] %p %m (%c)%n\n"
            "logger.reflections.name=org.reflections\n"
            "logger.reflections.level=ERROR\n"
        )

    def argv(self) -> list[str]:
        classpath = os.pathsep.join(str(jar) for jar in binaries.connect_classpath())
        return [
            binaries.java_binary(),
            f"-Xmx{self.heap}",
            "-XX:+UseSerialGC",
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile=file:{self.home / 'log4j2.properties'}",
            "-cp",
            classpath,
            "org.apache.kafka.connect.cli.ConnectDistributed",
            str(self.home / "worker.properties"),
        ]

    def probe(self) -> str | None:
        url = f"http://{LOOPBACK}:{self.port}/connectors"
        try:
            response = requests.get(url, timeout=2)
        except requests.RequestException as exc:
            return f"Kafka Connect REST at {url} does not answer: {type(exc).__name__}"
        if response.status_code != 200:
            return f"Kafka Connect REST at {url} answered {response.status_code}"
        return None


@dataclass(slots=True)
class WanService(Service):
    """The WAN link emulator (edgefeed.wan), one process for every link.

    ``port`` is its first link's port; the others are in ``links``. It is
    controlled through a Unix socket (``control``), not a port.
    """

    links: list[dict[str, object]] = field(default_factory=list)
    control: Path = Path()
    kind: str = field(default="wan-emulator", init=False)

    @property
    def links_file(self) -> Path:
        return self.home / "links.json"

    def prepare(self) -> None:
        if len(os.fsencode(self.control)) > _UNIX_PATH_MAX:
            raise DevStackError(
                f"the WAN emulator's control socket {self.control} is longer than a Unix "
                f"socket path may be ({_UNIX_PATH_MAX} bytes); choose a shorter --state-dir"
            )
        self.home.mkdir(parents=True, exist_ok=True)
        self.control.parent.mkdir(parents=True, exist_ok=True)
        # Written at every start: the settings are the links' starting point
        # (changes made with `edgefeed dev wan set` last until the emulator stops).
        self.links_file.write_text(json.dumps(self.links, indent=2))

    def argv(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "edgefeed.wan",
            "--links",
            str(self.links_file),
            "--control",
            str(self.control),
        ]

    def probe(self) -> str | None:
        from edgefeed.wan import WanControl, WanError

        try:
            running = {link["name"] for link in WanControl(self.control, timeout_s=2).status()}
        except WanError as exc:
            return str(exc)
        missing = sorted({str(link["name"]) for link in self.links} - running)
        return f"links not running: {', '.join(missing)}" if missing else None


def url_port(url: str, default: int) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "", parts.port or default
