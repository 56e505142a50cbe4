"""CDC through a dedicated replication role on the real Connect + Debezium + PostgreSQL.

``edgefeed connectors apply`` creates the role (LOGIN REPLICATION, no superuser,
SELECT on the captured tables only) and the publication; Debezium streams as
that role; the role can read nothing else and write nothing but the heartbeat.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator

import psycopg
import pytest
from pydantic import SecretStr
from stackhelpers import PG_PASSWORD, drop_slot, read_topic, unique_name

from connectors import deploy
from connectors.client import ConnectClient
from connectors.settings import ReplicationRoleSettings, SourceSettings, TableSettings
from edgefeed.devstack import DevStack

pytestmark = pytest.mark.integration

ROLE_PASSWORD = "cdc S3cr3t 'pw"  # a space and a quote: sent only as a SCRAM verifier


@pytest.fixture
def role_name(pg_conn: psycopg.Connection[tuple[object, ...]]) -> Iterator[str]:
    name = unique_name("cdc").lower()
    yield name
    # Grants and the role go after the test (the connector and slot are gone by then).
    pg_conn.execute(f"DROP OWNED BY {name}")
    pg_conn.execute(f"DROP ROLE IF EXISTS {name}")


async def test_debezium_streams_as_the_replication_role_with_minimal_grants(
    devstack: DevStack,
    pg_conn: psycopg.Connection[tuple[object, ...]],
    make_table: Callable[[str, str], str],
    role_name: str,
) -> None:
    captured = make_table("captured", "id bigint PRIMARY KEY, v text")
    other = make_table("other", "id bigint PRIMARY KEY, secret text")
    source = SourceSettings(
        name=unique_name("role").lower(),
        tables=[TableSettings(name=captured, key=["id"])],
        snapshot_mode="no_data",
    )
    database = devstack.settings.database.model_copy(
        update={
            "replication": ReplicationRoleSettings(
                user=role_name, password=SecretStr(ROLE_PASSWORD)
            )
        }
    )
    secrets = [PG_PASSWORD, ROLE_PASSWORD]
    with ConnectClient(devstack.settings.connect.url, timeout_s=30, secrets=secrets) as client:
        try:
            changes = deploy.apply(client, database, [source], wait_s=90)
            assert [c.action for c in changes] == ["create"]
            assert client.get_config(source.connector_name)["database.user"] == role_name  # type: ignore[index]

            pg_conn.execute(f"INSERT INTO {captured} (id, v) VALUES (1, 'a')")
            records = await read_topic(
                devstack.settings.kafka.bootstrap_servers, source.topic_for(captured), count=1
            )
            value = json.loads(records[0][1] or "null")
            assert value["op"] == "c" and value["after"] == {"id": 1, "v": "a"}

            # The slot is read by the role, not by the admin user.
            deadline = time.monotonic() + 30
            while True:
                row = pg_conn.execute(
                    "SELECT a.usename FROM pg_replication_slots s "
                    "JOIN pg_stat_activity a ON a.pid = s.active_pid WHERE s.slot_name = %s",
                    (source.effective_slot_name,),
                ).fetchone()
                if row is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert row == (role_name,)

            attributes = pg_conn.execute(
                "SELECT rolsuper, rolreplication, rolcreatedb, rolcreaterole, rolbypassrls "
                "FROM pg_roles WHERE rolname = %s",
                (role_name,),
            ).fetchone()
            assert attributes == (False, True, False, False, False)
            owned = pg_conn.execute(
                "SELECT count(*) FROM pg_class c JOIN pg_roles r ON r.oid = c.relowner "
                "WHERE r.rolname = %s",
                (role_name,),
            ).fetchone()
            assert owned == (0,)

            # As the role: the captured table reads; nothing else does, nothing writes.
            role_dsn = psycopg.conninfo.make_conninfo(
                database.dsn(), user=role_name, password=ROLE_PASSWORD
            )
            with psycopg.connect(role_dsn, autocommit=True) as as_role:
                assert as_role.execute(f"SELECT v FROM {captured}").fetchall() == [("a",)]
                for statement in (
                    f"SELECT * FROM {other}",
                    f"INSERT INTO {captured} (id, v) VALUES (2, 'b')",
                    f"DELETE FROM {captured}",
                    f"CREATE TABLE {captured}_x (id int)",
                ):
                    with pytest.raises(psycopg.errors.InsufficientPrivilege):
                        as_role.execute(statement)

            # Applying again keeps the role and changes nothing.
            again = deploy.apply(client, database, [source])
            assert [c.action for c in again] == ["unchanged"]
        finally:
            client.delete(source.connector_name)
            drop_slot(pg_conn, source.effective_slot_name, source.effective_publication)
