"""Secrets in URLs and DSNs: masked wherever shown, quoted wherever used."""

from __future__ import annotations

import pytest
from psycopg.conninfo import conninfo_to_dict

from connectors.client import ConnectClient
from connectors.exceptions import ConnectUnavailableError
from connectors.secrets import redact, redact_url, redact_urls, url_secrets
from connectors.settings import DatabaseSettings


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:pw@127.0.0.1:6379/0", "redis://***@127.0.0.1:6379/0"),
        ("http://admin:p%40ss@connect:8083", "http://***@connect:8083"),
        ("rediss://user:raw/pass@word@h:1/0", "rediss://***@h:1/0"),
        ("https://TOKEN@host/path", "https://***@host/path"),
        ("http://127.0.0.1:8083", "http://127.0.0.1:8083"),
    ],
)
def test_redact_url_masks_the_whole_userinfo(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_redact_urls_masks_every_url_in_a_message() -> None:
    text = "a 'redis://:one@h:1/0' and http://u:two@h:2 (got \"ftp://x:three@h\")"
    masked = redact_urls(text)
    assert not any(word in masked for word in ("one", "two", "three"))
    assert "redis://***@h:1/0" in masked and "http://***@h:2" in masked


def test_url_secrets_holds_the_raw_and_decoded_password() -> None:
    secrets = url_secrets("redis://edge:a%20b@h:1/0")
    assert "a b" in secrets and "a%20b" in secrets
    assert redact("libpq said: a b", secrets) == "libpq said: ********"


@pytest.mark.parametrize("password", ["with space", "quote'and\\backslash", "a=b c=d", "   "])
def test_dsn_quotes_the_password(password: str) -> None:
    dsn = DatabaseSettings(password=password, host="db.internal", user="cdc").dsn()
    parsed = conninfo_to_dict(dsn)
    assert parsed["password"] == password
    assert parsed["host"] == "db.internal" and parsed["user"] == "cdc"


def test_dsn_without_a_password_has_no_password_key() -> None:
    assert "password" not in conninfo_to_dict(DatabaseSettings().dsn())


def test_connect_errors_show_the_url_without_its_userinfo(unused_tcp_port: int) -> None:
    url = f"http://admin:hunter2-secret@127.0.0.1:{unused_tcp_port}"
    with (
        ConnectClient(url, timeout_s=1, retries=0) as client,
        pytest.raises(ConnectUnavailableError) as caught,
    ):
        client.list_connectors()
    assert "hunter2" not in str(caught.value)
    assert f"http://***@127.0.0.1:{unused_tcp_port}" in str(caught.value)
