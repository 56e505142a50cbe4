"""Connector config generation, secrets handling and the source checks' messages."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr, ValidationError

from connectors import database as database_module
from connectors.config import HEARTBEAT_TABLE, render_connector_config
from connectors.database import check_sources
from connectors.exceptions import SourceValidationError
from connectors.secrets import MASK, mask_config, redact
from connectors.settings import DatabaseSettings, SourceSettings, TableSettings


def shop() -> SourceSettings:
    return SourceSettings(
        name="shop",
        tables=[
            TableSettings(
                name="users",
                key=["user_id"],
                home_region_column="home_region",
                exclude_columns=["email"],
                replica_identity="full",
            ),
            TableSettings(name="public.items", key=["item_id"], snapshot=False),
        ],
    )


def test_production_safe_defaults() -> None:
    config = render_connector_config(DatabaseSettings(password=SecretStr("pw")), shop())
    assert config["plugin.name"] == "pgoutput"
    assert config["publication.autocreate.mode"] == "filtered"
    assert config["slot.name"] == "edgefeed_shop"
    assert config["table.include.list"] == (
        f"public.users,public.items,{HEARTBEAT_TABLE},public.edgefeed_signal_shop"
    )
    # Incremental snapshots: signals from the source's own table, progress to a topic.
    assert config["signal.data.collection"] == "public.edgefeed_signal_shop"
    assert config["signal.enabled.channels"] == "source"
    assert config["notification.enabled.channels"] == "sink"
    assert config["notification.sink.topic.name"] == "edgefeed.shop.notifications"
    assert config["message.key.columns"] == "public.users:user_id;public.items:item_id"
    assert config["column.exclude.list"] == "public.users.email"
    assert config["snapshot.include.collection.list"] == "public.users"
    assert config["tombstones.on.delete"] == "true"
    assert config["decimal.handling.mode"] == "string"
    assert int(config["heartbeat.interval.ms"]) > 0
    assert "ON CONFLICT" in config["heartbeat.action.query"]
    assert config["value.converter"].endswith("JsonConverter")
    assert all(isinstance(v, str) for v in config.values())
    assert shop().topic_for("users") == "edgefeed.shop.public.users"


def test_password_providers_keep_the_secret_out_of_the_config(tmp_path: Path) -> None:
    by_env = DatabaseSettings(password_env="PG_PASS")
    assert render_connector_config(by_env, shop())["database.password"] == "${env:PG_PASS}"
    secret_file = tmp_path / "pg_password"
    secret_file.write_text("s3cret\n")
    by_file = DatabaseSettings(password_file=secret_file)
    rendered = render_connector_config(by_file, shop())["database.password"]
    assert rendered == f"${{dir:{tmp_path}:pg_password}}"
    assert by_file.secret() == "s3cret"
    with pytest.raises(ValidationError, match="give the password one way only"):
        DatabaseSettings(password=SecretStr("x"), password_env="PG_PASS")


def test_masking_and_redaction() -> None:
    masked = mask_config(
        {"database.password": "pw", "database.user": "u", "x.password": "${env:P}"}
    )
    assert masked == {"database.password": MASK, "database.user": "u", "x.password": "${env:P}"}
    assert redact("auth failed for pw=hunter2", ["hunter2", ""]) == f"auth failed for pw={MASK}"


def test_bad_table_declarations_are_refused_early() -> None:
    with pytest.raises(ValidationError, match="cannot be excluded"):
        TableSettings(name="users", key=["id"], exclude_columns=["id"])
    with pytest.raises(ValidationError, match=r"must be 'schema\.table'"):
        TableSettings(name="a.b.c", key=["id"])
    with pytest.raises(ValidationError, match="declared twice"):
        SourceSettings(
            name="s",
            tables=[
                TableSettings(name="t", key=["id"]),
                TableSettings(name="public.t", key=["id"]),
            ],
        )


class _FakeConn:
    def __init__(self, wal_level: str, columns: dict[tuple[str, str], list[str]]) -> None:
        self.wal_level = wal_level
        self.columns = columns
        self._rows: list[tuple[Any, ...]] = []

    def execute(self, query: str, params: tuple[str, str] | None = None) -> _FakeConn:
        if query.startswith("SHOW"):
            self._rows = [(self.wal_level,)]
        else:
            assert params is not None
            self._rows = [(c,) for c in self.columns.get(params, [])]
        return self

    def fetchone(self) -> tuple[Any, ...] | None:
        return self._rows[0] if self._rows else None

    def fetchall(self) -> list[tuple[Any, ...]]:
        return self._rows


def test_check_sources_lists_every_problem_with_its_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeConn("replica", {("public", "users"): ["user_id", "home_region", "email"]})

    @contextmanager
    def connect(_: DatabaseSettings) -> Iterator[_FakeConn]:
        yield fake

    monkeypatch.setattr(database_module, "_connect", connect)
    with pytest.raises(SourceValidationError) as info:
        check_sources(DatabaseSettings(), [shop()])
    message = str(info.value)
    assert "wal_level='replica'" in message and "wal_level=logical" in message
    assert "public.items does not exist" in message
    assert isinstance(info.value, ValueError)


def test_a_personal_table_whose_deletes_cannot_be_routed_is_refused() -> None:
    """Default replica identity: a delete's old row holds only the key, so the router
    cannot know the home region (all deletes of the shipped events table were lost)."""
    with pytest.raises(ValueError, match=r"public\.events.*needs replica_identity: full"):
        TableSettings(name="events", key=["event_id"], home_region_column="home_region")
    # The home region in the key travels with every delete: fine without it.
    TableSettings(name="visits", key=["home_region", "visit_id"], home_region_column="home_region")
