"""Feature changes: what a settings change does to one region's vectors (sans-IO).

``edgefeed features plan`` compares each entity as the settings declare it with
what the region has deployed (the newest version in its schema registry, and
the declaration that version was registered with) and
``edgefeed features apply`` carries out a plan without problems. The rules:

- a changed definition needs a new version, never the same name with a new
  meaning under the same version;
- the new version must be an append-only evolution of the deployed one, so
  readers of the older version keep reading (edge_cache's registry rule); a
  feature a deployed model still reads is never dropped;
- a feature that needs rows the worker state no longer holds (a window longer
  than the state kept, a new column, a new table, more ``last_n`` rows) is
  backfilled by an incremental snapshot of its table; so is every table
  feeding an added or changed feature, which rewrites the vectors of every
  entity it feeds under the new version.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from edge_cache import FeatureSchema
from pipeline.features import EntityEngine
from pipeline.settings import EntitySettings, FeatureReader

__all__ = [
    "EntityPlan",
    "FeatureChange",
    "declaration",
    "feature_definitions",
    "plan_entity",
]

ChangeKind = Literal["added", "removed", "changed"]


@dataclass(frozen=True, slots=True)
class FeatureChange:
    """One feature's change. ``deployed``/``desired``: its definitions (JSON), or None."""

    name: str
    kind: ChangeKind
    deployed: str | None
    desired: str | None


@dataclass(frozen=True, slots=True)
class EntityPlan:
    """One entity type in one region.

    Attributes:
        deployed_version: The newest registered version (None: nothing deployed).
        known: False when that version was registered without its declaration
            (by a worker, before ``features apply`` existed): only names and
            dtypes are compared, and every table of a new feature is snapshotted.
        changes: Added, removed and changed features.
        history: Table -> why the worker state lacks what it needs.
        snapshot: Tables ``apply`` snapshots (history, and every table feeding
            an added or changed feature, to rebuild the vectors).
        problems: Why ``apply`` refuses this plan (each with its fix).
    """

    region: str
    entity: str
    deployed_version: int | None
    desired_version: int
    known: bool
    changes: tuple[FeatureChange, ...] = ()
    history: Mapping[str, str] = field(default_factory=dict)
    snapshot: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()

    @property
    def action(self) -> str:
        if self.deployed_version is None:
            return "create"
        if not self.changes and self.deployed_version == self.desired_version:
            return "unchanged"
        return "change"

    def as_dict(self) -> dict[str, Any]:
        return {
            "region": self.region,
            "entity": self.entity,
            "action": self.action,
            "deployed_version": self.deployed_version,
            "desired_version": self.desired_version,
            "definitions_known": self.known,
            "changes": [
                {"feature": c.name, "change": c.kind, "deployed": c.deployed, "desired": c.desired}
                for c in self.changes
            ],
            "needs_history": dict(self.history),
            "snapshot": list(self.snapshot),
            "problems": list(self.problems),
        }


def declaration(entity: EntitySettings) -> str:
    """The entity's declaration as registered beside its schema version (canonical JSON)."""
    return json.dumps(entity.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))


def feature_definitions(entity: EntitySettings) -> dict[str, str]:
    """Feature name -> the definition that gives it its meaning (canonical JSON).

    A ``last_n``/``top_k`` declaration defines several features (``name.1`` ..);
    each carries the whole declaration.
    """
    found: dict[str, str] = {}
    time_columns = entity.time_columns
    for latest in entity.latest:
        found[latest.name] = json.dumps(
            {"latest": latest.model_dump(mode="json", exclude={"name"})}, sort_keys=True
        )
    for agg in entity.aggregates:
        declared = agg.model_dump(mode="json", exclude={"name"})
        window = declared.get("window")
        if window and window.get("time_zone") == "UTC":
            del window["time_zone"]  # the default: definitions from before it stay equal
        body: dict[str, Any] = {"aggregate": declared, "time_column": time_columns.get(agg.table)}
        text = json.dumps(body, sort_keys=True)
        for name in agg.feature_names:
            found[name] = text
    return found


def _history(
    desired: EntityEngine, deployed: EntityEngine | None, tables: set[str]
) -> dict[str, str]:
    """Why the state of ``deployed`` lacks what ``desired`` needs, per table."""
    reasons: dict[str, str] = {}
    for table in sorted(tables):
        need = desired.needs.get(table)
        if need is None:
            continue
        had = deployed.needs.get(table) if deployed is not None else None
        if had is None:
            reasons[table] = (
                "a table the state does not hold"
                if deployed is not None
                else "the deployed declaration is unknown: assumed missing"
            )
            continue
        why: list[str] = []
        missing = sorted(set(need.columns) - set(had.columns))
        if missing:
            why.append(f"new column(s) {', '.join(missing)}")
        if need.retention_ms is not None and (
            had.retention_ms is None or need.retention_ms > had.retention_ms
        ):
            kept = "only the newest rows" if had.retention_ms is None else f"{had.retention_ms} ms"
            why.append(f"a {need.retention_ms} ms window, the state kept {kept}")
        if need.keep_last > had.keep_last:
            why.append(f"the newest {need.keep_last} rows, the state kept {had.keep_last}")
        if need.time_column != had.time_column:
            why.append(f"event time from {need.time_column or 'the commit time'}")
        if why:
            reasons[table] = "; ".join(why)
    return reasons


def plan_entity(
    region: str,
    desired: EntitySettings,
    deployed_schema: FeatureSchema | None,
    deployed: EntitySettings | None,
    readers: Sequence[FeatureReader] = (),
    *,
    allow_breaking: bool = False,
) -> EntityPlan:
    """Compare ``desired`` with what ``region`` has deployed.

    Args:
        deployed_schema: The newest registered schema (None: none).
        deployed: The declaration registered with it (None: unknown).
        readers: The deployed model versions and the features they read.
        allow_breaking: Accept a version that is not an append-only evolution
            (readers of the older version then refuse the new vectors).
    """
    engine = EntityEngine(desired)
    schema = engine.schema
    if deployed_schema is None:
        return EntityPlan(region, desired.name, None, desired.version, True)
    old_engine = EntityEngine(deployed) if deployed is not None else None
    new_defs = feature_definitions(desired)
    old_defs = feature_definitions(deployed) if deployed is not None else None
    old_dtypes = {f.name: f.dtype for f in deployed_schema.features}
    new_dtypes = {f.name: f.dtype for f in schema.features}
    changes: list[FeatureChange] = []
    for name in schema.names:
        if name not in old_dtypes:
            changes.append(FeatureChange(name, "added", None, new_defs[name]))
        elif old_dtypes[name] != new_dtypes[name] or (
            old_defs is not None and old_defs.get(name) != new_defs[name]
        ):
            before = old_defs.get(name) if old_defs is not None else None
            changes.append(FeatureChange(name, "changed", before, new_defs[name]))
    for name in deployed_schema.names:
        if name not in new_dtypes:
            before = old_defs.get(name) if old_defs is not None else None
            changes.append(FeatureChange(name, "removed", before, None))
    old_version = deployed_schema.version
    problems: list[str] = []
    if desired.version < old_version:
        problems.append(
            f"entity {desired.name!r}: version {desired.version} is older than the deployed "
            f"{old_version} in region {region}; set entities[{desired.name}].version to "
            f"{old_version + 1} or more"
        )
    elif changes and desired.version == old_version:
        what = ", ".join(f"{c.name} ({c.kind})" for c in changes)
        problems.append(
            f"entity {desired.name!r}: {what} under the deployed version {old_version}: a "
            f"changed feature set needs a new version; set entities[{desired.name}].version "
            f"to {old_version + 1}"
        )
    removed = {c.name for c in changes if c.kind == "removed"}
    for reader in readers:
        used = sorted(removed & set(reader.reads.get(desired.name, ())))
        if used:
            problems.append(
                f"entity {desired.name!r}: model {reader.name} version {reader.version} still "
                f"reads {', '.join(used)}, which this plan drops; keep the feature(s), or first "
                "deploy a model version that no longer reads them (models: in the settings)"
            )
    if (
        desired.version != old_version
        and not deployed_schema.is_prefix_of(schema)
        and not allow_breaking
    ):
        problems.append(
            f"entity {desired.name!r}: version {desired.version} "
            f"({', '.join(schema.names)}) is not an append-only evolution of version "
            f"{old_version} ({', '.join(deployed_schema.names)}): readers of version "
            f"{old_version} would refuse its vectors; keep every feature, in order, with its "
            "dtype, and declare new ones after them (new aggregates at the end), or pass "
            "--break-readers"
        )
    touched = {c.name for c in changes if c.kind != "removed"}
    feeding: set[str] = set()
    for latest in desired.latest:
        if latest.name in touched:
            feeding.add(latest.table)
    for agg in desired.aggregates:
        if touched & set(agg.feature_names):
            feeding.add(agg.table)
    history = _history(engine, old_engine, set(desired.tables))
    if old_engine is None:
        history = {t: r for t, r in history.items() if t in feeding}
    snapshot = tuple(sorted(set(history) | feeding))
    return EntityPlan(
        region,
        desired.name,
        old_version,
        desired.version,
        deployed is not None,
        tuple(changes),
        history,
        snapshot,
        tuple(problems),
    )
