"""Connectors applied to the real Kafka Connect + Debezium + PostgreSQL of the local stack."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
import requests
from pydantic import SecretStr
from stackhelpers import PG_PASSWORD, drop_slot, read_topic, unique_name

from connectors import deploy
from connectors.client import ConnectClient
from connectors.exceptions import (
    ConnectorFailedError,
    ConnectorInvalidError,
    ConnectUnavailableError,
    SourceValidationError,
)
from connectors.settings import SourceSettings, TableSettings
from edgefeed.devstack import DevStack
from edgefeed.settings import EdgefeedSettings, load_settings

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def client(devstack: DevStack) -> Iterator[ConnectClient]:
    settings = devstack.settings
    with ConnectClient(settings.connect.url, timeout_s=30, secrets=[PG_PASSWORD]) as c:
        yield c


@pytest.fixture
def cleanup(
    client: ConnectClient, pg_conn: psycopg.Connection[tuple[object, ...]]
) -> Iterator[Callable[[SourceSettings], None]]:
    """Register sources whose connector, slot and publication are removed after the test."""
    sources: list[SourceSettings] = []
    yield sources.append
    for source in sources:
        client.delete(source.connector_name)
        drop_slot(pg_conn, source.effective_slot_name, source.effective_publication)


def make_source(table: str, **options: object) -> SourceSettings:
    name = unique_name("src").lower()
    return SourceSettings(
        name=name,
        tables=[TableSettings(name=table, key=["id"])],
        snapshot_mode="no_data",
        **options,  # type: ignore[arg-type]
    )


def example_settings(devstack: DevStack) -> EdgefeedSettings:
    s = devstack.settings
    redis_ports = [r.redis_url.rsplit(":", 1)[1].split("/")[0] for r in s.regions]
    env = {
        "EDGEFEED_BROKER_PORT": s.kafka.bootstrap_servers[0].rsplit(":", 1)[1],
        "EDGEFEED_CONNECT_PORT": s.connect.url.rsplit(":", 1)[1],
        "EDGEFEED_PG_PORT": str(s.database.port),
        "EDGEFEED_PG_PASSWORD": PG_PASSWORD,
        "EDGEFEED_REDIS_EU_PORT": redis_ports[0],
        "EDGEFEED_REDIS_US_PORT": redis_ports[1],
        "EDGEFEED_REDIS_AP_PORT": redis_ports[2],
    }
    return load_settings(ROOT / "examples" / "edgefeed.yaml", env=env)


async def test_example_settings_stream_inserts_updates_and_deletes(
    devstack: DevStack,
    client: ConnectClient,
    pg_conn: psycopg.Connection[tuple[object, ...]],
    cleanup: Callable[[SourceSettings], None],
) -> None:
    settings = example_settings(devstack)
    source = settings.source("shop")
    pg_conn.execute((ROOT / "edgefeed" / "data" / "shop_schema.sql").read_text())
    cleanup(source)
    changes = deploy.apply(client, settings.database, settings.sources, wait_s=240)
    assert [(c.name, c.action) for c in changes] == [("edgefeed-shop", "create")]

    pg_conn.execute(
        "INSERT INTO users (user_id, home_region, country, email) "
        "VALUES (9001, 'eu-west', 'DE', 'a@example.org')"
    )
    pg_conn.execute("UPDATE users SET country = 'FR' WHERE user_id = 9001")
    pg_conn.execute("DELETE FROM users WHERE user_id = 9001")

    records = await read_topic(
        settings.kafka.bootstrap_servers, source.topic_for("public.users"), count=4
    )
    keys = [json.loads(k) if k else None for k, _ in records]
    values = [json.loads(v) if v else None for _, v in records]
    assert keys == [{"user_id": 9001}] * 4
    create, update, delete, tombstone = values
    assert create is not None and update is not None and delete is not None
    assert [create["op"], update["op"], delete["op"]] == ["c", "u", "d"]
    assert tombstone is None  # tombstones.on.delete: compaction forgets the key
    assert create["before"] is None
    assert create["after"]["country"] == "DE"
    assert "email" not in create["after"]  # exclude_columns
    assert update["before"]["country"] == "DE"  # replica_identity: full
    assert update["after"]["country"] == "FR"
    assert delete["before"]["user_id"] == 9001 and delete["after"] is None
    lsns = [v["source"]["lsn"] for v in (create, update, delete)]
    assert lsns == sorted(lsns) and len(set(lsns)) == 3

    # Re-applying the same settings changes nothing and does not restart anything.
    again = deploy.apply(client, settings.database, settings.sources)
    assert [c.action for c in again] == ["unchanged"]


def test_changed_option_is_an_update_and_plan_shows_manual_drift(
    devstack: DevStack,
    client: ConnectClient,
    make_table: Callable[[str, str], str],
    cleanup: Callable[[SourceSettings], None],
) -> None:
    db = devstack.settings.database
    table = make_table("prices", "id bigint PRIMARY KEY, price numeric(10,2)")
    source = make_source(table)
    cleanup(source)
    deploy.apply(client, db, [source], wait_s=240)

    changed = source.model_copy(update={"poll_interval_ms": 25})
    planned = deploy.plan(client, db, [changed])
    assert [(c.action, dict(c.changed)) for c in planned] == [
        ("update", {"poll.interval.ms": ("50", "25")})
    ]
    deploy.apply(client, db, [changed], wait_s=240)
    config = client.get_config(source.connector_name)
    assert config is not None and config["poll.interval.ms"] == "25"

    # Someone edits the connector by hand through Connect's REST API: plan shows it.
    manual = dict(config)
    manual["max.batch.size"] = "17"
    requests.put(
        f"{devstack.settings.connect.url}/connectors/{source.connector_name}/config",
        json=manual,
        timeout=30,
    ).raise_for_status()
    drift = deploy.plan(client, db, [changed])
    assert drift[0].action == "update"
    assert drift[0].changed == {"max.batch.size": ("17", "4096")}
    # The password is never shown, even in a plan.
    assert PG_PASSWORD not in json.dumps([c.as_dict() for c in drift])


def test_bad_password_is_reported_with_connects_reason_and_nothing_applied(
    devstack: DevStack,
    client: ConnectClient,
    make_table: Callable[[str, str], str],
    cleanup: Callable[[SourceSettings], None],
) -> None:
    wrong = "not-the-password-42"
    db = devstack.settings.database.model_copy(update={"password": SecretStr(wrong)})
    source = make_source(make_table("acct", "id bigint PRIMARY KEY"))
    cleanup(source)
    checking = ConnectClient(devstack.settings.connect.url, timeout_s=30, secrets=[wrong])
    with pytest.raises((ConnectorInvalidError, ConnectorFailedError)) as info:
        deploy.apply(checking, db, [source], wait_s=240)
    message = str(info.value)
    assert "password authentication failed" in message
    assert wrong not in message
    assert client.get_config(source.connector_name) is None


def test_unknown_table_and_missing_key_column_apply_nothing(
    devstack: DevStack,
    client: ConnectClient,
    make_table: Callable[[str, str], str],
    cleanup: Callable[[SourceSettings], None],
) -> None:
    db = devstack.settings.database
    real = make_table("orders", "id bigint PRIMARY KEY, total numeric")
    good = make_source(real)
    bad = SourceSettings(
        name=unique_name("bad").lower(),
        snapshot_mode="no_data",
        tables=[
            TableSettings(name="public.no_such_table", key=["id"]),
            TableSettings(name=real, key=["order_id"]),
        ],
    )
    cleanup(good)
    cleanup(bad)
    with pytest.raises(SourceValidationError) as info:
        deploy.apply(client, db, [good, bad])
    message = str(info.value)
    assert "public.no_such_table does not exist" in message
    assert "key column 'order_id' is not a column" in message
    assert "id, total" in message  # the columns that do exist
    assert client.get_config(good.connector_name) is None
    assert client.get_config(bad.connector_name) is None


def test_unreachable_connect_says_what_to_do() -> None:
    client = ConnectClient("http://127.0.0.1:9", timeout_s=2, retries=1, backoff_s=0.01)
    with client, pytest.raises(ConnectUnavailableError) as info:
        client.list_connectors()
    assert "http://127.0.0.1:9" in str(info.value)
    assert "connect.url" in str(info.value)
    assert info.value.retryable


def _edgefeed(settings_file: Path, *args: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("edgefeed")
    return subprocess.run(
        [str(exe), "--settings", str(settings_file), "connectors", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_cli_plan_apply_status_exit_codes(
    devstack: DevStack,
    tmp_path: Path,
    make_table: Callable[[str, str], str],
    stack_mapping: dict[str, object],
    cleanup: Callable[[SourceSettings], None],
) -> None:
    import yaml

    table = make_table("carts", "id bigint PRIMARY KEY, n int")
    source = make_source(table)
    cleanup(source)
    mapping = dict(stack_mapping)
    mapping["sources"] = [source.model_dump(mode="json", exclude_none=True)]
    settings_file = tmp_path / "edgefeed.yaml"
    settings_file.write_text(yaml.safe_dump(mapping))

    planned = _edgefeed(settings_file, "plan", "--json")
    assert planned.returncode == 3, planned.stderr
    assert json.loads(planned.stdout)[0]["action"] == "create"
    assert PG_PASSWORD not in planned.stdout
    assert "********" in planned.stdout

    applied = _edgefeed(settings_file, "apply", "--wait", "240")
    assert applied.returncode == 0, applied.stderr
    assert f"created {source.connector_name}" in " ".join(applied.stdout.split())

    status = _edgefeed(settings_file, "status", "--json")
    assert status.returncode == 0, status.stdout + status.stderr
    assert json.loads(status.stdout)[0]["tasks"][0]["state"] == "RUNNING"

    assert _edgefeed(settings_file, "plan").returncode == 0
