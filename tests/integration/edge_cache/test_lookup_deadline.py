"""``timeout_s`` is a deadline for a region's whole read, not for one socket read.

A proxy in front of the real redis-server answers one byte every 50 ms: each socket
read returns well within 0.25 s, so a per-read timeout never fires and a 3-id call
used to take ~34 s. Each test prints the elapsed time (run with ``-s`` to see it) and
asserts only a bound that holds unless the deadline is ignored.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import pytest
import typer
from typer.testing import CliRunner

from edge_cache import (
    AsyncFeatureClient,
    FeatureClient,
    FeatureSchema,
    FeatureWriter,
    LookupTimeoutError,
    Position,
    RegionSettings,
)
from edgefeed.cli.cache import register
from edgefeed.lookup import feature_schemas
from edgefeed.settings import load_settings

pytestmark = pytest.mark.integration
pytest_plugins = ["edge_cache_stack"]

ITEM = FeatureSchema.of("item", [f"f{i}" for i in range(16)])
IDS = ["a", "b", "c"]
# unbounded, the dribbled answer takes > 15 s (one byte per 50 ms); bounded, ~0.25 s
GENEROUS_S = 5.0
EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "edgefeed.yaml"


def _seed(region: RegionSettings, make_writer: Callable[..., FeatureWriter]) -> RegionSettings:
    home = region.model_copy(update={"failover": []})
    writer = make_writer(home, [ITEM])
    for entity_id in IDS:
        writer.upsert("item", entity_id, {f"f{i}": float(i) for i in range(16)}, Position(1), 1.0)
    return home


def test_sync_call_stops_at_its_deadline(
    regions: list[RegionSettings],
    make_writer: Callable[..., FeatureWriter],
    dribble: Callable[[RegionSettings], RegionSettings],
) -> None:
    slow = dribble(_seed(regions[0], make_writer))
    with FeatureClient("eu-west", [slow], [ITEM], timeout_s=0.25) as client:
        started = time.monotonic()
        with pytest.raises(LookupTimeoutError, match=r"eu-west: timed out after 0\.25 s"):
            client.get("item", IDS)
        elapsed = time.monotonic() - started
    print(f"sync FeatureClient.get behind a dribbling link: raised after {elapsed:.3f} s")
    assert elapsed < GENEROUS_S


async def test_async_call_stops_at_its_deadline(
    regions: list[RegionSettings],
    make_writer: Callable[..., FeatureWriter],
    dribble: Callable[[RegionSettings], RegionSettings],
) -> None:
    slow = dribble(_seed(regions[0], make_writer))
    async with AsyncFeatureClient("eu-west", [slow], [ITEM], timeout_s=0.25) as client:
        started = time.monotonic()
        with pytest.raises(LookupTimeoutError):
            await client.get("item", IDS)
        elapsed = time.monotonic() - started
    print(f"AsyncFeatureClient.get behind a dribbling link: raised after {elapsed:.3f} s")
    assert elapsed < GENEROUS_S


def test_cache_get_cli_stops_at_its_deadline(
    regions: list[RegionSettings],
    make_writer: Callable[..., FeatureWriter],
    dribble: Callable[[RegionSettings], RegionSettings],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # every region of the example settings behind its own dribbling proxy
    for region, var in zip(
        regions,
        ("EDGEFEED_REDIS_EU_PORT", "EDGEFEED_REDIS_US_PORT", "EDGEFEED_REDIS_AP_PORT"),
        strict=True,
    ):
        slow = dribble(region)
        monkeypatch.setenv(var, slow.redis_url.rsplit(":", 1)[1].split("/")[0])
    settings = load_settings(EXAMPLE)
    schemas = feature_schemas(settings)
    for region in regions:
        with FeatureWriter.from_region(region, schemas) as writer:
            writer.upsert("item", "sku-1", {"price": 9.5}, Position(1), time.time())

    root = typer.Typer()

    @root.callback()
    def _root(ctx: typer.Context, settings: Annotated[Path, typer.Option("--settings")]) -> None:
        ctx.obj = {"settings_path": settings}

    register(root)
    args = ["--settings", str(EXAMPLE), "cache", "get", "item", "sku-1", "sku-2", "sku-3"]
    started = time.monotonic()
    done = CliRunner().invoke(root, [*args, "--region", "eu-west", "--timeout-s", "0.25"])
    elapsed = time.monotonic() - started
    print(f"edgefeed cache get behind dribbling links: exit {done.exit_code} after {elapsed:.3f} s")
    assert done.exit_code != 0
    assert "timed out after 0.25 s" in done.output
    assert elapsed < 3 * GENEROUS_S  # three regions tried, each with its own deadline
