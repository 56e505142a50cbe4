"""``edgefeed features plan|apply``: feature-set changes across regions, with backfill.

Plan: per region and entity, the settings' declaration against the newest
version in the region's schema registry (pipeline.featureplan). Apply, all or
nothing up to the registration: every problem of every region is reported
and nothing is registered; otherwise each changed entity's new version is
registered (schema, declaration, tables to snapshot) in every region, apply
waits until the regions' workers write the new version (they are restarted
with the new settings meanwhile), then signals one incremental snapshot per
table that needs history or feeds a new feature, and follows the snapshots to
their end, paced so streaming keeps its freshness (connectors.pacing). The snapshot's reads give the
workers the rows their state lacks and make them write every vector they touch
again under the new version. Interrupted, apply resumes where it stopped: the
tables still to snapshot are kept in the registry.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis

from edge_cache.exceptions import SchemaError
from edge_cache.registry import Registry
from edgefeed.errors import EdgefeedError
from pipeline.featureplan import EntityPlan, declaration, plan_entity
from pipeline.features import EntityEngine
from pipeline.settings import EntitySettings, FeatureReader

if TYPE_CHECKING:
    from connectors.client import ConnectClient
    from connectors.pacing import PaceReport
    from connectors.snapshot import SnapshotRequest
    from edge_cache import RegionSettings
    from edgefeed.settings import EdgefeedSettings

__all__ = [
    "FeaturePlanError",
    "FeaturePlanRefused",
    "FeaturesApplied",
    "WorkersNotReadyError",
    "apply_features",
    "plan_features",
]


class FeaturePlanError(EdgefeedError):
    """Base class of ``edgefeed features`` errors."""


class FeaturePlanRefused(FeaturePlanError, ValueError):
    """The plan has problems (a changed feature without a new version, a dropped
    feature a deployed model reads, a version readers of the older one cannot
    read); each is listed with its fix. Not retryable: change the settings.
    Nothing was registered or signalled."""


class WorkersNotReadyError(FeaturePlanError):
    """The new version is registered but a region's workers do not write it yet.
    Retryable: restart them with the new settings, then ``edgefeed features
    apply`` again (it resumes with the snapshots)."""

    retryable = True


@dataclass(slots=True)
class FeaturesApplied:
    """What apply did: plans, registrations and the snapshots it signalled."""

    plans: list[EntityPlan]
    registered: list[tuple[str, str, int]] = field(default_factory=list)  # region, entity, v
    snapshots: list[SnapshotRequest] = field(default_factory=list)
    paced: list[PaceReport] = field(default_factory=list)  # one per source, when paced

    def as_dict(self) -> dict[str, Any]:
        return {
            "plans": [p.as_dict() for p in self.plans],
            "registered": [{"region": r, "entity": e, "version": v} for r, e, v in self.registered],
            "snapshots": [s.as_dict() for s in self.snapshots],
            "paced": [p.as_dict() for p in self.paced],
        }


def _client(region: RegionSettings, role: str) -> Any:
    options = region.redis_options(role)  # type: ignore[arg-type]
    if region.cluster:
        return redis.RedisCluster.from_url(region.redis_url, socket_timeout=10, **options)
    return redis.Redis.from_url(region.redis_url, socket_timeout=10, **options)


@contextmanager
def _registry(region: RegionSettings, *, write: bool) -> Iterator[Registry]:
    reader = _client(region, "reader")
    writer = _client(region, "writer") if write else None
    try:
        yield Registry(reader, writer)
    except redis.RedisError as exc:
        raise FeaturePlanError(
            f"the schema registry of region {region.name} cannot be read: {type(exc).__name__}; "
            "is its Redis up?"
        ) from None
    finally:
        reader.close()
        if writer is not None:
            writer.close()


def _deployed(registry: Registry, entity: EntitySettings) -> tuple[Any, EntitySettings | None]:
    """The newest registered schema other than the desired version's own registration,
    and its declaration."""
    versions = registry.versions(entity.name)
    if entity.version in versions and (
        registry.backfill(entity.name, entity.version)
        or registry.declaration(entity.name, entity.version) is None
    ):
        # Registered by an interrupted apply, or by a worker restarted with the new
        # settings before apply ran: plan against the version it replaces.
        older = {v: s for v, s in versions.items() if v < entity.version}
        versions = older or versions
    if not versions:
        return None, None
    schema = versions[max(versions)]
    text = registry.declaration(entity.name, schema.version)
    return schema, EntitySettings.model_validate_json(text) if text else None


def plan_features(
    settings: EdgefeedSettings,
    readers: Sequence[FeatureReader] = (),
    *,
    regions: Sequence[str] | None = None,
    allow_breaking: bool = False,
) -> list[EntityPlan]:
    """The plan of every declared entity in each region (``regions``: default all).

    Raises:
        SettingsError: a region is not declared.
    """
    plans: list[EntityPlan] = []
    readers = [*settings.models, *readers]
    for region in [settings.region(name) for name in regions or settings.region_names]:
        with _registry(region, write=False) as registry:
            for entity in settings.entities:
                schema, deployed = _deployed(registry, entity)
                plans.append(
                    plan_entity(
                        region.name,
                        entity,
                        schema,
                        deployed,
                        readers,
                        allow_breaking=allow_breaking,
                    )
                )
    return plans


def _wait_for_workers(
    settings: EdgefeedSettings, wanted: dict[str, dict[str, int]], wait_s: float
) -> None:
    deadline = time.monotonic() + wait_s
    while True:
        behind: list[str] = []
        for region_name, entities in wanted.items():
            with _registry(settings.region(region_name), write=False) as registry:
                writers = registry.writers()
            for entity, version in entities.items():
                if not any(w.get(entity, 0) >= version for w in writers):
                    behind.append(f"{entity} v{version} in region {region_name}")
        if not behind:
            return
        if time.monotonic() >= deadline:
            raise WorkersNotReadyError(
                f"no worker writes {', '.join(behind)} yet (registered); restart every "
                "regional worker of those regions with the new settings (`edgefeed pipeline "
                "run region NAME`), then run `edgefeed features apply` again to snapshot"
            )
        time.sleep(0.5)


def apply_features(
    settings: EdgefeedSettings,
    connect: ConnectClient,
    readers: Sequence[FeatureReader] = (),
    *,
    regions: Sequence[str] | None = None,
    wait_s: float = 600.0,
    allow_breaking: bool = False,
    on_registered: Callable[[], None] | None = None,
    pace: bool = True,
    pace_timeout_s: float | None = None,
) -> FeaturesApplied:
    """Check, register, wait for the workers, snapshot (see the module docstring).

    Args:
        on_registered: Called once the versions are registered, before waiting
            (the CLI tells the operator to restart the workers).
        pace: Follow the snapshots to their end, paced to each source's
            ``snapshot_rows_per_s`` (connectors/pacing.py); False signals them and
            returns.
        pace_timeout_s: Stop following after this long (the snapshots go on,
            unpaced); None: until they end.

    Raises:
        FeaturePlanRefused: the plan has problems; nothing was registered.
        WorkersNotReadyError: the workers did not write the new version in time.
        SnapshotTableError, SnapshotUnavailableError: from the snapshot signal.
    """
    from connectors.snapshot import request_snapshot, snapshot_paced

    plans = plan_features(settings, readers, regions=regions, allow_breaking=allow_breaking)
    problems = [problem for plan in plans for problem in plan.problems]
    if problems:
        raise FeaturePlanRefused(
            "the feature plan is refused (nothing was registered):\n  " + "\n  ".join(problems)
        )
    done = FeaturesApplied(plans)
    entities = {e.name: e for e in settings.entities}
    wanted: dict[str, dict[str, int]] = {}
    tables: set[str] = set()
    for plan in plans:
        entity = entities[plan.entity]
        with _registry(settings.region(plan.region), write=True) as registry:
            pending = registry.backfill(entity.name, entity.version)
            known = registry.declaration(entity.name, entity.version) is not None
            if plan.action == "unchanged" and not pending and known:
                continue
            schema = EntityEngine(entity).schema
            try:
                registry.register(schema, declaration(entity), list(plan.snapshot))
            except SchemaError as exc:
                raise FeaturePlanRefused(f"region {plan.region}: {exc}") from None
            done.registered.append((plan.region, entity.name, entity.version))
            todo = registry.backfill(entity.name, entity.version) or []
        if todo:
            wanted.setdefault(plan.region, {})[entity.name] = entity.version
            tables.update(todo)
    if not tables:
        return done
    if on_registered is not None:
        on_registered()
    _wait_for_workers(settings, wanted, wait_s)

    def signalled(requests: list[SnapshotRequest]) -> None:
        done.snapshots.extend(requests)
        if len(done.snapshots) < len(tables):
            return  # another source's tables are still to signal
        for region_name, versions in wanted.items():
            with _registry(settings.region(region_name), write=True) as registry:
                for entity_name, version in versions.items():
                    registry.backfilled(entity_name, version)

    if not pace:
        signalled(
            [
                request_snapshot(connect, settings.database, settings.sources, table)
                for table in sorted(tables)
            ]
        )
        return done
    _, done.paced = snapshot_paced(
        connect,
        settings.database,
        settings.sources,
        [(table, None) for table in sorted(tables)],
        settings.kafka.bootstrap_servers,
        client_options=settings.kafka.security.aiokafka_options(),
        timeout_s=pace_timeout_s,
        on_signalled=signalled,
    )
    return done
