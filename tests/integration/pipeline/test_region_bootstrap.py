"""A region added later is bootstrapped by incremental snapshots (its personal rows,
filtered by home region, plus the shared rows), without touching the other regions."""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
import yaml
from e2e_harness import PipelineRun, shop_pipeline, shop_settings
from stackhelpers import unique_name

from connectors.client import ConnectClient
from connectors.snapshot import request_snapshot
from edgefeed.devstack import DevStack
from edgefeed.lookup import feature_client
from edgefeed.settings import settings_from_mapping
from edgefeed.verify import verify

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("empty_region_caches")]

NEW = "ap-southeast"
OLD = "eu-west"


def without_new_region(mapping: dict[str, Any]) -> dict[str, Any]:
    reduced = copy.deepcopy(mapping)
    reduced["regions"] = [
        {**r, "failover": [f for f in r["failover"] if f != NEW]}
        for r in reduced["regions"]
        if r["name"] != NEW
    ]
    return reduced


def dump(client: redis.Redis) -> dict[bytes, Any]:
    found: dict[bytes, Any] = {}
    for key in client.scan_iter(match="ef:*"):
        kind = client.type(key)
        found[key] = client.hgetall(key) if kind == b"hash" else client.get(key)
    return found


def poll(what: str, check: Any, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s}s: {what}")
        time.sleep(0.5)


@pytest.fixture
def bootstrap_run(
    devstack: DevStack,
    stack_mapping: dict[str, Any],
    tmp_path: Path,
    region_redis: dict[str, redis.Redis],  # flushed before the pipeline starts, not after
) -> Iterator[tuple[PipelineRun, dict[str, Any]]]:
    tag = unique_name("rb").lower()
    schema = f"s_{tag}"
    full = shop_settings(stack_mapping, schema, tag)
    with shop_pipeline(without_new_region(full), schema, tmp_path, ["router", OLD]) as pipeline:
        yield pipeline, full


@pytest.mark.timeout(1800)  # three process starts on a busy 2-core machine
def test_a_new_region_is_bootstrapped_without_touching_the_others(
    bootstrap_run: tuple[PipelineRun, dict[str, Any]],
    region_redis: dict[str, redis.Redis],
) -> None:
    pipeline, full = bootstrap_run
    schema = pipeline.schema
    v1 = pipeline.settings

    def sql(statement: str) -> None:
        with psycopg.connect(v1.database.dsn(), autocommit=True) as conn:
            conn.execute(statement.replace("{s}", schema))

    # Rows of both regions while the new one is not declared: its users' rows are
    # dead-lettered (a region not in regions), the shared item reaches eu-west.
    sql(
        "INSERT INTO {s}.users (user_id, home_region, country, segment, email) VALUES "
        "(3001, 'eu-west', 'DE', 1, 'a@example.org'), (3002, 'ap-southeast', 'SG', 2, 'b@x.org')"
    )
    sql("INSERT INTO {s}.items (item_id, category_id, price) VALUES (7001, 4, 9.90)")
    sql(
        "INSERT INTO {s}.events (user_id, item_id, category_id, price, home_region, kind, "
        "occurred_at) VALUES (3001, 7001, 4, 9.90, 'eu-west', 'view', now()), "
        "(3002, 7001, 4, 9.90, 'ap-southeast', 'view', now()), "
        "(3002, 7001, 4, 9.90, 'ap-southeast', 'purchase', now())"
    )

    def eu_settled() -> bool:
        client = feature_client(v1, OLD, timeout_s=2)
        try:
            user, item = client.get("user", [3001]), client.get("item", [7001])
        finally:
            client.close()
        return bool(user.found[0] and item.found[0] and item.to_dicts()[0]["views_1h"] == 1)

    poll("eu-west holds its user and the shared item", eu_settled)
    eu_before = dump(region_redis[OLD])

    # The region is declared: the router restarts with it, its worker starts.
    pipeline.settings_file.write_text(yaml.safe_dump(full))
    v2 = settings_from_mapping(full)
    pipeline.kill9("router")
    pipeline.start("router")
    pipeline.start(NEW)
    with ConnectClient(v2.connect.url, timeout_s=30) as connect:
        for table, where in (
            ("users", f"home_region = '{NEW}'"),
            ("events", f"home_region = '{NEW}'"),
            ("items", None),
        ):
            request_snapshot(connect, v2.database, v2.sources, f"{schema}.{table}", where)

    def new_region_verified() -> bool:
        report = verify(v2, [NEW])
        return report.ok and report.checked[NEW] > 0

    poll("ap-southeast equals the recomputation", new_region_verified, timeout_s=600)
    client = feature_client(v2, NEW, timeout_s=2)
    try:
        user = client.get("user", [3002]).to_dicts()[0]
    finally:
        client.close()
    assert user["views_30m"] == 1 and user["purchases_today"] == 1
    # eu-west re-read the shared item: a no-op. Nothing in its cache changed.
    assert dump(region_redis[OLD]) == eu_before
