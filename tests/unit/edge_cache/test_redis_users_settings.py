"""Region settings for Redis ACL users and TLS: one way to give each, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from edge_cache import RegionSettings
from edge_cache.acl import COMMANDS, acl_rule

SECRET = "pw-S3cr3t"


def _region(**extra: object) -> RegionSettings:
    fields: dict[str, object] = {
        "name": "eu-west",
        "redis_url": "redis://127.0.0.1:6379/0",
        "residency_zone": "eu",
    }
    fields.update(extra)
    return RegionSettings.model_validate(fields)


def test_each_role_gets_its_own_user_and_password(tmp_path: Path) -> None:
    (tmp_path / "w").write_text(SECRET + "-w\n")
    region = _region(
        reader={"username": "lookup", "password": SECRET},
        writer={"username": "writer", "password_file": str(tmp_path / "w")},
    )
    assert region.redis_options("reader") == {"username": "lookup", "password": SECRET}
    assert region.redis_options("writer") == {"username": "writer", "password": SECRET + "-w"}
    assert SECRET not in repr(region)


def test_no_users_means_no_options_and_the_url_credentials_apply() -> None:
    assert _region(redis_url="redis://:p@127.0.0.1/0").redis_options("reader") == {}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"redis_url": "redis://u:p@h/0", "reader": {"username": "r", "password": "x"}},
            "give them one way",
        ),
        ({"tls": {"ca_file": "/ca.pem"}}, "not rediss://"),
        ({"reader": {"username": "r"}}, "needs exactly one of password"),
        (
            {"reader": {"username": "r", "password": "x", "password_env": "X"}},
            "needs exactly one of password",
        ),
        (
            {"redis_url": "rediss://h/0", "tls": {"cert_file": "/c.pem"}},
            "both cert_file and key_file",
        ),
    ],
)
def test_bad_combinations_are_refused(extra: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        _region(**extra)


def test_tls_options_go_to_redis_py() -> None:
    region = _region(
        redis_url="rediss://cache:6380/0",
        tls={"ca_file": "/ca.pem", "cert_file": "/c.pem", "key_file": "/k.pem"},
    )
    assert region.redis_options("writer") == {
        "ssl_check_hostname": True,
        "ssl_ca_certs": "/ca.pem",
        "ssl_certfile": "/c.pem",
        "ssl_keyfile": "/k.pem",
    }


def test_acl_rules_hold_no_password_and_no_dangerous_command() -> None:
    for role in ("reader", "writer"):
        rule = acl_rule(role, "u", SECRET)
        assert SECRET not in rule and rule.startswith("user u reset on #")
        assert "~ef:*" in rule
    assert not {"set", "del", "evalsha", "hset", "eval"} & set(COMMANDS["reader"])
    for role in ("reader", "writer"):
        assert not {"flushall", "flushdb", "config", "keys", "eval", "del"} & set(COMMANDS[role])
