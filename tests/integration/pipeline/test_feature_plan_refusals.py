"""`edgefeed features plan|apply` refusals against the regions' real schema registries:
a clear error, exit 2, and not one key changed in any region."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from e2e_harness import EDGEFEED, shop_settings
from stackhelpers import unique_name

from connectors.client import ConnectClient
from edgefeed.devstack import DevStack
from edgefeed.features import FeaturePlanRefused, apply_features
from edgefeed.settings import EdgefeedSettings, settings_from_mapping

pytestmark = pytest.mark.integration

RANKER = {"name": "shop-ranker", "version": "3", "reads": {"user": ["views_30m", "segment"]}}


def registries(clients: dict[str, redis.Redis]) -> dict[str, dict[bytes, bytes | None]]:
    return {
        name: {key: client.get(key) for key in client.scan_iter(match="ef:*")}
        for name, client in clients.items()
    }


def changed_user(mapping: dict[str, Any], **update: Any) -> dict[str, Any]:
    entities = [dict(e) for e in mapping["entities"]]
    user = next(e for e in entities if e["name"] == "user")
    user.update(update)
    return {**mapping, "entities": entities, "models": [RANKER]}


def refused(settings: EdgefeedSettings) -> str:
    with (
        ConnectClient(settings.connect.url, timeout_s=30) as connect,
        pytest.raises(FeaturePlanRefused) as info,
    ):
        apply_features(settings, connect, wait_s=0)
    assert isinstance(info.value, ValueError)
    return str(info.value)


def test_refused_plans_change_nothing(
    devstack: DevStack,
    stack_mapping: dict[str, Any],
    region_redis: dict[str, redis.Redis],
    tmp_path: Path,
) -> None:
    mapping = shop_settings(stack_mapping, "public", unique_name("rf").lower())
    v1 = settings_from_mapping(mapping)
    with ConnectClient(v1.connect.url, timeout_s=30) as connect:
        done = apply_features(v1, connect, wait_s=0)
    assert {(r, e, v) for r, e, v in done.registered} == {
        (region, entity, 1) for region in v1.region_names for entity in ("user", "item")
    }
    before = registries(region_redis)
    assert all(before.values())

    # Dropping a feature the deployed ranker reads.
    user = next(e for e in mapping["entities"] if e["name"] == "user")
    kept = [a for a in user["aggregates"] if a["name"] != "views_30m"]
    dropping = changed_user(mapping, version=2, aggregates=kept)
    message = refused(settings_from_mapping(dropping))
    assert "model shop-ranker version 3 still reads views_30m" in message
    assert "nothing was registered" in message

    # A new feature under the deployed version.
    views_7d = {
        "name": "views_7d",
        "table": "public.events",
        "agg": "count",
        "where": {"kind": "view"},
        "window": {"size": "7d"},
    }
    same_version = changed_user(mapping, aggregates=[*user["aggregates"], views_7d])
    message = refused(settings_from_mapping(same_version))
    assert "views_7d (added) under the deployed version 1" in message
    assert "set entities[user].version to 2" in message

    # The CLI: exit 2, the reason on stderr, for plan and apply alike.
    path = tmp_path / "edgefeed.yaml"
    path.write_text(yaml.safe_dump(dropping))
    for command in (["features", "plan", "--json"], ["features", "apply", "--wait", "0"]):
        result = subprocess.run(
            [EDGEFEED, "--settings", str(path), *command],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert result.returncode == 2, result.stderr
        shown = result.stdout if "--json" in command else result.stderr
        assert "still reads views_30m" in shown
    plans = json.loads(
        subprocess.run(
            [EDGEFEED, "--settings", str(path), "features", "plan", "--json"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        ).stdout
    )
    user_plans = [p for p in plans if p["entity"] == "user"]
    assert [c["change"] for c in user_plans[0]["changes"]] == ["removed"]
    assert registries(region_redis) == before
