"""edgefeed's Redis users on a real redis-server loaded with the rules of edge_cache.acl.

The default user is off: only the reader (lookup client, near cache listener,
monitor) and the writer (the pipeline's cache writer) exist, each with the
commands of ``edge_cache.acl.COMMANDS``. Each client does its whole job as its
user; each user is refused what it must not do. The same over ``rediss://``.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from edge_cache_stack import READ_TIMEOUT_S

from edge_cache import (
    AsyncFeatureClient,
    AsyncFeatureWriter,
    FeatureClient,
    FeatureSchema,
    FeatureWriter,
    NearCacheConfig,
    Position,
    RedisTLSSettings,
    RedisUserSettings,
    RegionSettings,
    RegionUnavailableError,
    Upsert,
)
from edge_cache.acl import acl_rule
from edgefeed.devstack import binaries
from monitoring.freshness import read_region

pytestmark = pytest.mark.integration

USER = FeatureSchema.of("user", ["a", "b"])
READER_PASSWORD = "reader-S3cr3t-pw"
WRITER_PASSWORD = "writer-S3cr3t-pw"
ADMIN_PASSWORD = "admin-S3cr3t-pw"
DEADLINE_S = 10.0


@dataclass(frozen=True, slots=True)
class AclServer:
    url: str
    tls: RedisTLSSettings | None
    secrets: Path

    def region(self, *, reader: str = READER_PASSWORD) -> RegionSettings:
        (self.secrets / "reader").write_text(reader + "\n")
        return RegionSettings(
            name="eu-west",
            redis_url=self.url,
            residency_zone="eu",
            reader=RedisUserSettings(
                username="edgefeed-lookup", password_file=self.secrets / "reader"
            ),
            writer=RedisUserSettings(username="edgefeed-writer", password_env="TEST_REDIS_WRITER"),
            tls=self.tls,
        )

    def tls_options(self) -> dict[str, object]:
        """redis-py's ssl_* options for this server (none for redis://)."""
        options = self.region().redis_options("reader")
        return {k: v for k, v in options.items() if k.startswith("ssl_")}

    def connect(self, username: str, password: str) -> redis.Redis:
        return redis.Redis.from_url(
            self.url, username=username, password=password, **self.tls_options()
        )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _tls_files(folder: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1 it signed (openssl, as an operator would)."""
    ca_key, ca, key, csr, cert = (
        folder / n for n in ("ca.key", "ca.pem", "server.key", "server.csr", "server.pem")
    )

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes")
    openssl("req", "-x509", *ec, "-days", "2", "-subj", "/CN=test-ca", "-keyout", str(ca_key),
            "-out", str(ca))  # fmt: skip
    openssl("req", *ec, "-subj", "/CN=127.0.0.1", "-keyout", str(key), "-out", str(csr))
    ext = folder / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
            "-CAcreateserial", "-days", "2", "-extfile", str(ext), "-out", str(cert))  # fmt: skip
    return ca, cert, key


@pytest.fixture(params=["redis", "rediss"], scope="module")
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[AclServer]:
    home = tmp_path_factory.mktemp("redis-acl")
    acl = home / "users.acl"
    acl.write_text(
        "\n".join(
            [
                "user default off resetpass resetkeys -@all",
                f"user admin on >{ADMIN_PASSWORD} ~* &* +@all",
                acl_rule("reader", "edgefeed-lookup", READER_PASSWORD),
                acl_rule("writer", "edgefeed-writer", WRITER_PASSWORD),
            ]
        )
        + "\n"
    )
    port = _free_port()
    argv = [binaries.redis_server_binary(), "--bind", "127.0.0.1", "--dir", str(home),
            "--save", "", "--appendonly", "no", "--aclfile", str(acl)]  # fmt: skip
    tls: RedisTLSSettings | None = None
    if request.param == "rediss":
        ca, cert, key = _tls_files(home)
        argv += ["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(cert),
                 "--tls-key-file", str(key), "--tls-ca-cert-file", str(ca),
                 "--tls-auth-clients", "no"]  # fmt: skip
        tls = RedisTLSSettings(ca_file=ca)
    else:
        argv += ["--port", str(port)]
    secrets = home / "secrets"
    secrets.mkdir()
    acl_server = AclServer(f"{request.param}://127.0.0.1:{port}/0", tls, secrets)
    log = home / "redis.log"
    with (
        log.open("wb") as log_file,
        subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT) as process,
    ):
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    with acl_server.connect("admin", ADMIN_PASSWORD) as admin:
                        admin.ping()
                    break
                except redis.ConnectionError:
                    assert process.poll() is None, log.read_text()
                    assert time.monotonic() < deadline, "redis-server did not answer"
                    time.sleep(0.05)
            yield acl_server
        finally:
            process.terminate()
            process.wait(timeout=30)


@pytest.fixture(autouse=True)
def writer_password(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_REDIS_WRITER", WRITER_PASSWORD)


@pytest.fixture
def clean(server: AclServer) -> AclServer:
    with server.connect("admin", ADMIN_PASSWORD) as admin:
        admin.flushdb()
        admin.script_flush()
    return server


def _until(predicate: object) -> bool:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return bool(predicate())  # type: ignore[operator]


def test_writer_writes_and_reader_reads_each_as_its_own_user(clean: AclServer) -> None:
    region = clean.region()
    with FeatureWriter.from_region(region, [USER]) as writer:
        writer.publish_schemas()
        assert writer.write(
            [Upsert("user", 1, {"a": 1.0, "b": 2.0}, Position(1), time.time())], freshness=True
        ) == [True]
        with FeatureClient(
            "eu-west",
            [region],
            [USER],
            near_cache=NearCacheConfig(max_entries=10, ttl_s=60),
            timeout_s=READ_TIMEOUT_S,
        ) as client:
            result = client.get("user", [1, 2])
            assert result.to_dicts()[0] == {"a": 1.0, "b": 2.0}
            assert list(result.found) == [True, False]
            # The near cache's invalidation connection (CLIENT TRACKING) runs as the reader.
            assert client.near is not None and _until(lambda: client.near.active)  # type: ignore[union-attr]
            client.get("user", [1])
            writer.upsert("user", 1, {"a": 5.0, "b": 2.0}, Position(2), time.time())
            assert _until(lambda: client.get("user", [1]).to_dicts()[0]["a"] == 5.0)
        assert writer.delete("user", 1, Position(3), time.time())

    async def async_faces() -> None:
        async with AsyncFeatureWriter.from_region(region, [USER]) as awriter:
            await awriter.publish_schemas()
            assert await awriter.upsert("user", 7, {"a": 7.0}, Position(1), time.time())
            # The pipeline's quarantine list and its check that the cache kept its data.
            await awriter.mark_quarantined({"user:8": "OverflowError"}, released=["user:9"])
            layout = awriter.core.layout
            marker = layout.writer_marker_key("w1")
            assert await awriter.client.set(marker, b"1", ex=60)
            assert await awriter.client.expire(marker, 60)
            assert await awriter.client.exists(layout.schema_key("user", 1)) == 1
        async with AsyncFeatureClient(
            "eu-west", [region], [USER], timeout_s=READ_TIMEOUT_S
        ) as aclient:
            assert (await aclient.get("user", [7])).to_dicts() == [{"a": 7.0, "b": None}]
        # The monitor reads freshness records and samples vector headers as the reader.
        times = await read_region(
            "eu-west", region.redis_url, redis_options=region.redis_options("reader")
        )
        assert [e.entity for e in times.entities] == ["user"]
        assert times.quarantine_sample == (("user:8", "OverflowError"),)

    asyncio.run(async_faces())


@pytest.mark.parametrize(
    "command",
    [
        ("SET", "ef:{user:1}", "x"),
        ("DEL", "ef:{user:1}"),
        ("HSET", "ef:freshness:user", "f", "1"),
        ("EVALSHA", "0" * 40, "1", "ef:{user:1}"),
        ("EVAL", "return redis.call('SET', KEYS[1], 'x')", "1", "ef:{user:1}"),
        ("FLUSHALL",),
        ("FLUSHDB",),
        ("CONFIG", "SET", "maxmemory", "1"),
        ("KEYS", "*"),
        ("ACL", "LIST"),
        ("GET", "other-app:secret"),
    ],
)
def test_the_reader_cannot_write_flush_or_reconfigure(
    clean: AclServer, command: tuple[str, ...]
) -> None:
    with clean.connect("edgefeed-lookup", READER_PASSWORD) as reader:
        assert reader.get("ef:{user:1}") is None  # it can read
        with pytest.raises(redis.exceptions.NoPermissionError):
            reader.execute_command(*command)


@pytest.mark.parametrize(
    "command",
    [
        ("FLUSHALL",),
        ("FLUSHDB",),
        ("CONFIG", "SET", "maxmemory", "1"),
        ("CONFIG", "GET", "*"),
        ("KEYS", "*"),
        ("CLIENT", "KILL", "TYPE", "normal"),
        ("SHUTDOWN",),
        ("ACL", "LIST"),
        ("SCRIPT", "FLUSH"),
        ("EVAL", "return 1", "0"),  # only the write script, by its SHA
        ("SET", "other-app:key", "x"),  # outside the namespace
    ],
)
def test_the_writer_cannot_flush_reconfigure_or_leave_its_namespace(
    clean: AclServer, command: tuple[str, ...]
) -> None:
    with clean.connect("edgefeed-writer", WRITER_PASSWORD) as writer:
        writer.set("ef:probe", "1")  # it can write
        with pytest.raises(redis.exceptions.NoPermissionError):
            writer.execute_command(*command)


def test_a_wrong_password_is_a_failed_read_that_names_no_secret(clean: AclServer) -> None:
    region = clean.region(reader="not-the-password")
    with (
        FeatureClient("eu-west", [region], [USER], timeout_s=2) as client,
        pytest.raises(RegionUnavailableError) as failed,
    ):
        client.get("user", [1])
    text = f"{failed.value!r} {failed.value}"
    assert "not-the-password" not in text and READER_PASSWORD not in text
    assert "eu-west" in text


def test_default_user_is_off(clean: AclServer) -> None:
    with (
        redis.Redis.from_url(clean.url, **clean.tls_options()) as anonymous,
        pytest.raises(redis.exceptions.AuthenticationError),
    ):
        anonymous.get("ef:{user:1}")
