"""Connect worker config providers limited to what the connector reads; the replication role."""

from __future__ import annotations

import base64
import hashlib
import hmac
from pathlib import Path

import pytest
from pydantic import SecretStr, ValidationError

from connectors.config import render_connector_config, worker_provider_properties
from connectors.database import scram_verifier
from connectors.settings import DatabaseSettings, ReplicationRoleSettings, SourceSettings

SOURCE = SourceSettings.model_validate(
    {"name": "shop", "tables": [{"name": "users", "key": ["id"]}]}
)


def test_no_provider_is_configured_when_the_settings_reference_none() -> None:
    props = worker_provider_properties(DatabaseSettings(password=SecretStr("x")))
    assert props == {"connector.client.config.override.policy": "None"}


def test_providers_allow_only_the_named_variable_and_folder(tmp_path: Path) -> None:
    database = DatabaseSettings(
        password_env="PG_PASSWORD",
        replication=ReplicationRoleSettings(password_file=tmp_path / "secrets" / "cdc"),
    )
    props = worker_provider_properties(database)
    assert props["config.providers"] == "env,dir"
    assert props["config.providers.env.param.allowlist.pattern"] == "^(PG_PASSWORD)$"
    assert props["config.providers.dir.param.allowed.paths"] == str(tmp_path / "secrets")
    assert not any(key.startswith("config.providers.file") for key in props)
    config = render_connector_config(database, SOURCE)
    assert config["database.user"] == "edgefeed_cdc"
    assert config["database.password"] == f"${{dir:{tmp_path / 'secrets'}:cdc}}"
    assert config["publication.autocreate.mode"] == "disabled"


def test_without_a_replication_role_debezium_connects_as_the_database_user() -> None:
    config = render_connector_config(DatabaseSettings(user="app", password=SecretStr("x")), SOURCE)
    assert config["database.user"] == "app"
    assert config["publication.autocreate.mode"] == "filtered"


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"password": "a", "password_env": "B"},
        {"user": "Bad-Name", "password": "a"},
    ],
)
def test_replication_role_settings_are_checked(fields: dict[str, str]) -> None:
    with pytest.raises(ValidationError):
        ReplicationRoleSettings.model_validate(fields)


def test_scram_verifier_follows_rfc_7677() -> None:
    # RFC 7677's example: password "pencil", salt W22ZaJ0SNY7soEsUEjb6gQ==, 4096 iterations.
    salt = base64.b64decode("W22ZaJ0SNY7soEsUEjb6gQ==")
    verifier = scram_verifier("pencil", salt=salt)
    salted = hashlib.pbkdf2_hmac("sha256", b"pencil", salt, 4096)
    server_key = hmac.digest(salted, b"Server Key", "sha256")
    assert verifier.startswith("SCRAM-SHA-256$4096:W22ZaJ0SNY7soEsUEjb6gQ==$")
    assert verifier.endswith(":" + base64.b64encode(server_key).decode())
    assert "pencil" not in verifier
