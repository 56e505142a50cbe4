"""``edgefeed pipeline verify``: every region's cache against a recomputation from the
source tables (pipeline.recompute), entity by entity and feature by feature."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from connectors.database import read_rows
from edge_cache import FeatureClient, KeyLayout, RegionSettings
from edgefeed.lookup import feature_schemas
from edgefeed.settings import EdgefeedSettings
from pipeline.recompute import Mismatch, compare, expected_vectors

__all__ = ["VerifyReport", "verify", "verify_until"]


@dataclass(slots=True)
class VerifyReport:
    """What ``verify`` found, per region."""

    checked: dict[str, int] = field(default_factory=dict)  # region -> vectors compared
    mismatches: list[Mismatch] = field(default_factory=list)
    unverifiable: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "checked": self.checked,
            "unverifiable": self.unverifiable,
            "mismatches": [
                {
                    "region": m.region,
                    "entity": m.entity,
                    "id": m.entity_id,
                    "what": m.what,
                    "expected": m.expected,
                    "found": m.found,
                }
                for m in self.mismatches
            ],
        }


def _cached_ids(region: RegionSettings, entity: str) -> set[str]:
    prefix = KeyLayout().prefix(entity)
    options = region.redis_options("reader")
    client: Any = (
        redis.RedisCluster.from_url(region.redis_url, **options)
        if region.cluster
        else redis.Redis.from_url(region.redis_url, **options)
    )
    try:
        return {
            key.decode()[len(prefix) : -1]
            for key in client.scan_iter(match=f"{prefix}*", count=1000)
        }
    finally:
        client.close()


def verify(
    settings: EdgefeedSettings, regions: Sequence[str] | None = None, at: float | None = None
) -> VerifyReport:
    """Compare each region's cache with the vectors recomputed from the source, both
    with windows read at ``at`` (seconds since the epoch; default: now).

    Raises:
        SourceValidationError: the source database cannot be reached.
        RegionUnavailableError: a region's cache cannot be read.
    """
    tables = settings.tables()
    fed = sorted({table for entity in settings.entities for table in entity.tables})
    rows = read_rows(settings.database, [tables[name] for name in fed])
    names = list(regions or settings.region_names)
    at = time.time() if at is None else at
    expected = expected_vectors(
        settings.entities, tables, settings.region_names, rows, int(at * 1000)
    )
    schemas = feature_schemas(settings)
    report = VerifyReport()
    for name in names:
        region = settings.region(name)
        alone = [r.model_copy(update={"failover": []}) for r in settings.regions]
        client = FeatureClient(name, alone, schemas, timeout_s=10)
        found: dict[str, dict[str, dict[str, Any] | None]] = {}
        try:
            for entity in settings.entities:
                ids = sorted(
                    set(expected[name].vectors.get(entity.name, {}))
                    | _cached_ids(region, entity.name)
                )
                found[entity.name] = {}
                for start in range(0, len(ids), 500):
                    chunk = ids[start : start + 500]
                    vectors = client.get(entity.name, chunk, at=at)
                    for entity_id, present, values in zip(
                        chunk, vectors.found, vectors.to_dicts(), strict=True
                    ):
                        found[entity.name][entity_id] = values if present else None
        finally:
            client.close()
        report.checked[name] = sum(len(v) for v in found.values())
        report.mismatches.extend(compare(name, expected[name], found))
        report.unverifiable = sorted(expected[name].unverifiable)
    return report


def verify_until(
    settings: EdgefeedSettings,
    regions: Sequence[str] | None = None,
    timeout_s: float = 120.0,
    interval_s: float = 2.0,
) -> VerifyReport:
    """:func:`verify` again every ``interval_s`` until it passes or ``timeout_s`` has
    passed (the last changes, or a history rebuild, may still be on their way); the
    last report."""
    deadline = time.monotonic() + timeout_s
    report = verify(settings, regions)
    while not report.ok and time.monotonic() < deadline:
        time.sleep(interval_s)
        report = verify(settings, regions)
    return report
