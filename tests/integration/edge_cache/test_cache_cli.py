"""`edgefeed cache get` on the example settings, pointed at the test stack's caches."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import pytest
import typer
from typer.testing import CliRunner

from edge_cache import FeatureWriter, Position, RegionSettings
from edgefeed.cli.cache import register
from edgefeed.lookup import feature_schemas
from edgefeed.settings import load_settings

pytestmark = pytest.mark.integration
pytest_plugins = ["edge_cache_stack"]

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "edgefeed.yaml"


def _app() -> typer.Typer:
    root = typer.Typer()

    @root.callback()
    def _root(ctx: typer.Context, settings: Annotated[Path, typer.Option("--settings")]) -> None:
        ctx.obj = {"settings_path": settings}

    register(root)
    return root


@pytest.fixture
def example_env(regions: list[RegionSettings], monkeypatch: pytest.MonkeyPatch) -> None:
    for region, var in zip(
        regions,
        ("EDGEFEED_REDIS_EU_PORT", "EDGEFEED_REDIS_US_PORT", "EDGEFEED_REDIS_AP_PORT"),
        strict=True,
    ):
        monkeypatch.setenv(var, region.redis_url.rsplit(":", 1)[1].split("/")[0])


def test_cache_get_json_and_table(example_env: None) -> None:
    settings = load_settings(EXAMPLE)
    with FeatureWriter.from_region(settings.region("eu-west"), feature_schemas(settings)) as w:
        w.upsert(
            "item",
            "sku-1",
            {"price": 9.5, "category_id": 3, "views_1h": 12},
            Position(7),
            time.time(),
        )
    runner = CliRunner()
    done = runner.invoke(
        _app(),
        [
            "--settings",
            str(EXAMPLE),
            "cache",
            "get",
            "item",
            "sku-1",
            "sku-2",
            "--region",
            "eu-west",
            "--json",
        ],
    )
    assert done.exit_code == 0, done.output
    document = json.loads(done.output)
    assert document["served_by"] == "eu-west"
    first, second = document["rows"]
    assert first["found"] and not second["found"]
    assert first["values"] == {"price": 9.5, "category_id": 3, "views_1h": 12, "purchases_1h": None}
    assert first["commit_time"].endswith("Z") and second["commit_time"] is None

    table = runner.invoke(
        _app(), ["--settings", str(EXAMPLE), "cache", "get", "item", "sku-1", "-f", "price"]
    )
    assert table.exit_code == 0, table.output
    assert "9.5" in table.output and "item from eu-west" in table.output

    bad = runner.invoke(
        _app(), ["--settings", str(EXAMPLE), "cache", "get", "item", "sku-1", "-f", "nope"]
    )
    assert bad.exit_code == 2
    assert "unknown feature(s) 'nope'" in bad.output and "price" in bad.output
