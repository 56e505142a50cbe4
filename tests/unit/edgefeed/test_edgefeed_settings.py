"""The settings file: expansion, validation and the messages users read."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgefeed.errors import EdgefeedError
from edgefeed.settings import SettingsError, expand_env, load_settings

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "edgefeed.yaml"

VALID = """
kafka:
  bootstrap_servers: "127.0.0.1:9092"
regions:
  - name: eu-west
    redis_url: redis://127.0.0.1:6379/0
    residency_zone: eu
    failover: [us-east]
  - name: us-east
    redis_url: redis://127.0.0.1:6380/0
    residency_zone: us
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "edgefeed.yaml"
    path.write_text(text)
    return path


def test_example_settings_load_with_three_regions() -> None:
    settings = load_settings(EXAMPLE, env={})
    assert settings.region_names == ["eu-west", "us-east", "ap-southeast"]
    assert settings.kafka.bootstrap_servers == ["127.0.0.1:19092"]
    assert settings.region("eu-west").residency_zone == "eu"
    assert settings.database.port == 15432


def test_env_references_expand_with_defaults(tmp_path: Path) -> None:
    settings = load_settings(EXAMPLE, env={"EDGEFEED_BROKER_PORT": "29092"})
    assert settings.kafka.bootstrap_servers == ["127.0.0.1:29092"]
    assert expand_env({"a": ["${X:-d}", "${Y}"]}, {"Y": "y"}) == {"a": ["d", "y"]}


def test_unset_env_reference_without_default_is_named(tmp_path: Path) -> None:
    path = write(tmp_path, VALID.replace("127.0.0.1:9092", "${BROKER}"))
    with pytest.raises(SettingsError, match=r"'BROKER'.*not set"):
        load_settings(path, env={})


def test_unknown_key_is_named_with_the_fix(tmp_path: Path) -> None:
    path = write(tmp_path, VALID + "\nkafkaa: {}\n")
    with pytest.raises(
        SettingsError, match=r"kafkaa: unknown key; remove it or check its spelling"
    ):
        load_settings(path, env={})


def test_bad_value_names_key_value_and_what_is_allowed(tmp_path: Path) -> None:
    path = write(tmp_path, VALID.replace("redis://127.0.0.1:6380/0", "http://x:1"))
    with pytest.raises(SettingsError) as info:
        load_settings(path, env={})
    message = str(info.value)
    assert "regions.1.redis_url" in message
    assert "'http://x:1'" in message
    assert "redis://" in message


def test_failover_to_an_undeclared_region_lists_the_declared_ones(tmp_path: Path) -> None:
    path = write(tmp_path, VALID.replace("failover: [us-east]", "failover: [ap-south]"))
    with pytest.raises(
        SettingsError, match=r"'ap-south', which is not a declared region: eu-west, us-east"
    ):
        load_settings(path, env={})


def test_bootstrap_server_without_port_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, VALID.replace("127.0.0.1:9092", "broker-1"))
    with pytest.raises(SettingsError, match=r"'broker-1' must be host:port"):
        load_settings(path, env={})


def test_password_never_appears_in_errors_or_repr(tmp_path: Path) -> None:
    secret = "hunter2-very-secret"
    bad = VALID + f"\ndatabase:\n  password: {secret}\n  port: not-a-port\n"
    with pytest.raises(SettingsError) as info:
        load_settings(write(tmp_path, bad), env={})
    assert secret not in str(info.value)
    good = load_settings(write(tmp_path, VALID + f"\ndatabase:\n  password: {secret}\n"), env={})
    assert secret not in repr(good)
    assert secret not in str(good.database)


def test_missing_file_and_bad_yaml_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="not found; pass --settings PATH"):
        load_settings(tmp_path / "nope.yaml")
    with pytest.raises(SettingsError, match="not valid YAML"):
        load_settings(write(tmp_path, "regions: [\n"))
    with pytest.raises(SettingsError, match="mapping at the top level"):
        load_settings(write(tmp_path, "- 1\n"))


def test_unknown_region_lookup_lists_regions(tmp_path: Path) -> None:
    settings = load_settings(write(tmp_path, VALID), env={})
    with pytest.raises(SettingsError, match="region 'eu' not in regions: eu-west, us-east"):
        settings.region("eu")


def test_settings_errors_are_typed() -> None:
    assert issubclass(SettingsError, EdgefeedError)
    assert issubclass(SettingsError, ValueError)
    assert SettingsError.retryable is False
