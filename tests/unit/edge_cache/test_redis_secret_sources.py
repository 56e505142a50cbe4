"""The lookup client and the writer against a real redis-server with ACL users, when
their user's password cannot be read (issue 30).

Before, a ``password_file`` that did not exist or a ``password_env`` that was unset
became an empty password: the client was built, and the first read failed as an
unavailable region after an authentication error that named nothing. Now building
the client (or the writer) raises the typed error naming the setting and the file
or variable; with the source readable, the same user reads and writes.
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

from edge_cache import (
    AsyncFeatureClient,
    AsyncFeatureWriter,
    FeatureClient,
    FeatureSchema,
    FeatureWriter,
    NearCacheConfig,
    Position,
    RedisUserSettings,
    RegionSettings,
    Upsert,
)
from edge_cache.acl import acl_rule
from edgefeed.devstack import binaries
from edgefeed_base.errors import EdgefeedError

USER = FeatureSchema.of("user", ["a"])
READER_PASSWORD = "reader-M4rker-acl-pw"
WRITER_PASSWORD = "writer-M4rker-acl-pw"
ADMIN_PASSWORD = "admin-M4rker-acl-pw"
WRITER_ENV = "EF_TEST_SECRET_WRITER"


@dataclass(frozen=True, slots=True)
class Server:
    url: str
    secrets: Path

    def region(self) -> RegionSettings:
        return RegionSettings(
            name="eu-west",
            redis_url=self.url,
            residency_zone="eu",
            reader=RedisUserSettings(
                username="edgefeed-lookup", password_file=self.secrets / "reader"
            ),
            writer=RedisUserSettings(username="edgefeed-writer", password_env=WRITER_ENV),
        )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A redis-server on a free loopback port: default user off, edgefeed's two users."""
    home = tmp_path_factory.mktemp("redis-secrets")
    acl = home / "users.acl"
    acl.write_text(
        "user default off resetpass resetkeys -@all\n"
        f"user admin on >{ADMIN_PASSWORD} ~* &* +@all\n"
        f"{acl_rule('reader', 'edgefeed-lookup', READER_PASSWORD)}\n"
        f"{acl_rule('writer', 'edgefeed-writer', WRITER_PASSWORD)}\n"
    )
    port = _free_port()
    argv = [
        *(binaries.redis_server_binary(), "--bind", "127.0.0.1", "--port", str(port)),
        *("--dir", str(home), "--save", "", "--appendonly", "no", "--aclfile", str(acl)),
    ]
    url = f"redis://127.0.0.1:{port}/0"
    secrets = home / "secrets"
    secrets.mkdir()
    log = home / "redis.log"
    with (
        log.open("wb") as log_file,
        subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT) as process,
    ):
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    with redis.Redis.from_url(url, username="admin", password=ADMIN_PASSWORD) as r:
                        r.ping()
                    break
                except redis.ConnectionError:
                    assert process.poll() is None, log.read_text()
                    assert time.monotonic() < deadline, "redis-server did not answer"
                    time.sleep(0.05)
            yield Server(url, secrets)
        finally:
            process.terminate()
            process.wait(timeout=30)


@pytest.fixture
def clean(server: Server, monkeypatch: pytest.MonkeyPatch) -> Server:
    with redis.Redis.from_url(server.url, username="admin", password=ADMIN_PASSWORD) as admin:
        admin.flushdb()
    (server.secrets / "reader").unlink(missing_ok=True)
    monkeypatch.delenv(WRITER_ENV, raising=False)
    return server


def _assert_names(error: BaseException, *parts: str) -> None:
    assert type(error).__name__ == "SecretSourceError", repr(error)
    assert isinstance(error, ValueError)
    text = f"{error} {error!r}"
    for part in parts:
        assert part in text, text
    for secret in (READER_PASSWORD, WRITER_PASSWORD, ADMIN_PASSWORD):
        assert secret not in text


@pytest.mark.parametrize("near_cache", [None, NearCacheConfig(max_entries=10, ttl_s=60)])
def test_a_lookup_client_whose_reader_file_is_missing_fails_naming_it(
    clean: Server, near_cache: NearCacheConfig | None
) -> None:
    region = clean.region()
    missing = str(clean.secrets / "reader")
    with pytest.raises(EdgefeedError) as info:
        FeatureClient("eu-west", [region], [USER], timeout_s=2, near_cache=near_cache).close()
    _assert_names(info.value, "regions[eu-west].reader.password_file", missing, "does not exist")

    async def async_face() -> None:
        with pytest.raises(EdgefeedError) as info:
            await AsyncFeatureClient("eu-west", [region], [USER], timeout_s=2).close()
        _assert_names(info.value, "regions[eu-west].reader.password_file", missing)

    asyncio.run(async_face())

    # The same client, once the secret is mounted, reads as the reader user.
    (clean.secrets / "reader").write_text(READER_PASSWORD + "\n")
    with FeatureClient("eu-west", [region], [USER], timeout_s=2, near_cache=near_cache) as client:
        assert list(client.get("user", [1]).found) == [False]


def test_a_writer_whose_password_env_is_unset_or_empty_fails_naming_it(
    clean: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    region = clean.region()
    with pytest.raises(EdgefeedError) as info:
        FeatureWriter.from_region(region, [USER])
    _assert_names(info.value, "regions[eu-west].writer.password_env", WRITER_ENV, "is not set")

    monkeypatch.setenv(WRITER_ENV, "")
    with pytest.raises(EdgefeedError) as info:
        AsyncFeatureWriter.from_region(region, [USER])
    _assert_names(info.value, "regions[eu-west].writer.password_env", WRITER_ENV, "is empty")

    monkeypatch.setenv(WRITER_ENV, WRITER_PASSWORD)
    with FeatureWriter.from_region(region, [USER]) as writer:
        writer.publish_schemas()
        assert writer.write([Upsert("user", 1, {"a": 1.0}, Position(1), time.time())]) == [True]


def test_a_reader_file_that_is_empty_or_a_directory_fails_naming_it(clean: Server) -> None:
    region = clean.region()
    path = clean.secrets / "reader"
    path.write_text("\n")
    with pytest.raises(EdgefeedError) as info:
        FeatureClient("eu-west", [region], [USER], timeout_s=2).close()
    _assert_names(info.value, "regions[eu-west].reader.password_file", str(path), "is empty")
    path.unlink()
    path.mkdir()
    try:
        with pytest.raises(EdgefeedError) as info:
            FeatureClient("eu-west", [region], [USER], timeout_s=2).close()
        _assert_names(info.value, str(path), "is a directory")
    finally:
        path.rmdir()
