"""`edgefeed features plan`'s rules, on the example settings' user entity."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edge_cache import FeatureSchema
from edgefeed.settings import load_settings
from pipeline.featureplan import plan_entity
from pipeline.features import EntityEngine
from pipeline.settings import AggregateFeature, EntitySettings, FeatureReader, LatestFeature

ROOT = Path(__file__).resolve().parents[3]
SETTINGS = load_settings(ROOT / "examples" / "edgefeed.yaml", env={})
USER = next(e for e in SETTINGS.entities if e.name == "user")
VIEWS_7D = AggregateFeature.model_validate(
    {
        "name": "views_7d",
        "table": "public.events",
        "agg": "count",
        "where": {"kind": "view"},
        "window": {"size": "7d"},
    }
)
RANKER = FeatureReader(name="shop-ranker", version="3", reads={"user": ["views_30m", "segment"]})


def schema(entity: EntitySettings) -> FeatureSchema:
    return EntityEngine(entity).schema


def changed(**update: Any) -> EntitySettings:
    return USER.model_copy(update=update)


def test_a_7_day_window_is_added_with_a_new_version_and_needs_history() -> None:
    desired = changed(version=2, aggregates=[*USER.aggregates, VIEWS_7D])
    plan = plan_entity("eu-west", desired, schema(USER), USER, [RANKER])
    assert plan.action == "change" and not plan.problems
    assert [(c.name, c.kind) for c in plan.changes] == [("views_7d", "added")]
    assert plan.history == {"public.events": "a 604800000 ms window, the state kept 86400000 ms"}
    assert plan.snapshot == ("public.events",)


def test_a_changed_feature_set_under_the_same_version_is_refused() -> None:
    desired = changed(aggregates=[*USER.aggregates, VIEWS_7D])
    plan = plan_entity("eu-west", desired, schema(USER), USER)
    (problem,) = plan.problems
    assert "views_7d (added) under the deployed version 1" in problem
    assert "set entities[user].version to 2" in problem


def test_a_new_meaning_under_an_old_name_is_a_change_that_rebuilds() -> None:
    wider = [
        a.model_copy(update={"window": a.window.model_copy(update={"size": "2h"})})
        if a.name == "views_30m" and a.window is not None
        else a
        for a in USER.aggregates
    ]
    same_version = plan_entity("eu-west", changed(aggregates=wider), schema(USER), USER)
    assert [(c.name, c.kind) for c in same_version.changes] == [("views_30m", "changed")]
    assert same_version.problems  # same name, new meaning, same version: refused
    bumped = plan_entity("eu-west", changed(version=2, aggregates=wider), schema(USER), USER)
    assert not bumped.problems
    assert bumped.history == {}  # 2 h is within the state's day
    assert bumped.snapshot == ("public.events",)  # every vector it feeds is rewritten


def test_dropping_a_feature_a_deployed_model_reads_is_refused() -> None:
    kept = [a for a in USER.aggregates if a.name != "views_30m"]
    plan = plan_entity("eu-west", changed(version=2, aggregates=kept), schema(USER), USER, [RANKER])
    assert [(c.name, c.kind) for c in plan.changes] == [("views_30m", "removed")]
    assert any(
        "model shop-ranker version 3 still reads views_30m" in problem for problem in plan.problems
    )
    # Nobody reads it: still not append-only (readers of v1 would refuse v2's vectors)...
    alone = plan_entity("eu-west", changed(version=2, aggregates=kept), schema(USER), USER)
    assert len(alone.problems) == 1 and "not an append-only evolution" in alone.problems[0]
    # ... unless the operator accepts that.
    allowed = plan_entity(
        "eu-west", changed(version=2, aggregates=kept), schema(USER), USER, allow_breaking=True
    )
    assert not allowed.problems


def test_a_new_latest_column_needs_history_and_must_not_reorder_the_vector() -> None:
    country = LatestFeature(name="country_code", table="public.users", column="country")
    desired = changed(version=2, latest=[*USER.latest, country])
    plan = plan_entity("eu-west", desired, schema(USER), USER)
    assert (
        "public.users" in plan.history and "new column(s) country" in plan.history["public.users"]
    )
    # Latest values come before the aggregates in a vector: this one lands mid-vector.
    assert any("not an append-only evolution" in p for p in plan.problems)


def test_unknown_or_missing_deployments() -> None:
    first = plan_entity("eu-west", USER, None, None)
    assert first.action == "create" and first.snapshot == ()
    desired = changed(version=2, aggregates=[*USER.aggregates, VIEWS_7D])
    unknown = plan_entity("eu-west", desired, schema(USER), None)
    assert not unknown.known and not unknown.problems
    assert unknown.snapshot == ("public.events",)
    assert plan_entity("eu-west", USER, schema(USER), USER).action == "unchanged"
