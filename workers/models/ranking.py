"""The ranking model: scores candidate items for a user from edge-cached features.

A request names ids only (``{"user_id": "u1", "item_ids": ["i1", "i2"]}``); the
model reads the user's and the items' feature vectors from the region's edge
cache through a :class:`~workers.features.FeatureSource` (that lookup is the
request's T_data) and scores every (user, item) pair: one row per item.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError
from torch import nn

from edge_cache import FeatureSchema
from workers.exceptions import InvalidTensorError, MissingFeaturesError, UnsupportedMediaTypeError
from workers.features import FeatureSource
from workers.models.base import Prepared, ServedModel
from workers.models.config import PlainConfig

if TYPE_CHECKING:
    from workers.featurelog import LogLayout

__all__ = ["MAX_ID_LENGTH", "RankRequest", "Ranker", "RankerConfig", "RankingNet"]

MAX_ID_LENGTH = 256
"""Longest user or item id accepted (ids are echoed in error messages, clipped)."""


def _clip_id(entity_id: str, limit: int = 64) -> str:
    """An id as error messages show it: at most ``limit`` characters."""
    if len(entity_id) <= limit:
        return repr(entity_id)
    return f"{entity_id[:limit]!r}... ({len(entity_id)} chars)"


@dataclass(frozen=True, slots=True)
class RankerConfig(PlainConfig):
    """Architecture and feature contract of :class:`RankingNet`.

    Attributes:
        user_features: Names of the user features, in input order.
        item_features: Names of the item features, in input order.
        user_entity: Entity type of users in the edge cache (the demo uses its own
            entity types so it never clashes with the pipeline's ``user``).
        item_entity: Entity type of items in the edge cache.
        tower: Width of the user and item towers.
        hidden: Widths of the scoring MLP over (user, item, user*item).
    """

    user_features: tuple[str, ...] = tuple(f"u{i}" for i in range(16))
    item_features: tuple[str, ...] = tuple(f"i{i}" for i in range(16))
    user_entity: str = "demo_user"
    item_entity: str = "demo_item"
    tower: int = 32
    hidden: tuple[int, ...] = (64,)

    def schemas(self) -> list[FeatureSchema]:
        """Edge cache schemas holding exactly these features (all float32; users personal)."""
        return [
            FeatureSchema.of(self.user_entity, self.user_features, personal=True),
            FeatureSchema.of(self.item_entity, self.item_features),
        ]


class RankingNet(nn.Module):
    """Two towers and an interaction MLP; returns the click probability of each pair."""

    def __init__(self, config: RankerConfig) -> None:
        super().__init__()
        self.user_tower = nn.Sequential(
            nn.Linear(len(config.user_features), config.tower), nn.ReLU()
        )
        self.item_tower = nn.Sequential(
            nn.Linear(len(config.item_features), config.tower), nn.ReLU()
        )
        layers: list[nn.Module] = []
        width = 3 * config.tower
        for hidden in config.hidden:
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, 1))
        self.scorer = nn.Sequential(*layers)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        u = self.user_tower(users)
        v = self.item_tower(items)
        logits: torch.Tensor = self.scorer(torch.cat([u, v, u * v], dim=1)).squeeze(1)
        return torch.sigmoid(logits)


class RankRequest(BaseModel):
    """Body of a ranking request.

    Attributes:
        user_id: The user to rank for.
        item_ids: Candidate items, 1 or more, unique.
        on_missing: ``reject`` answers 422 when any id lacks features; ``drop``
            scores the items that have them and lists the dropped ones (a user
            without features is always rejected).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    user_id: str = Field(min_length=1, max_length=MAX_ID_LENGTH)
    item_ids: list[Annotated[str, StringConstraints(min_length=1, max_length=MAX_ID_LENGTH)]] = (
        Field(min_length=1)
    )
    on_missing: Literal["reject", "drop"] = "reject"


def _describe_missing(
    entity: str, ids: Sequence[str], mask: np.ndarray, names: Sequence[str]
) -> str:
    parts = []
    for row, entity_id in enumerate(ids):
        missing = [names[int(col)] for col in np.flatnonzero(mask[row])]
        if not missing:
            continue
        what = "no features" if len(missing) == len(names) else f"missing {missing}"
        parts.append(f"{entity} {_clip_id(entity_id)}: {what}")
    return "; ".join(parts[:10]) + (f" (and {len(parts) - 10} more)" if len(parts) > 10 else "")


def _logged_ids(prepared: Prepared) -> tuple[Sequence[str], Sequence[str]]:
    user_id, item_ids, _ = prepared.meta
    return (user_id,), item_ids


class Ranker(ServedModel):
    """Serves :class:`RankingNet` with features read from the edge cache.

    Args:
        name: Model name.
        module: ``(users (n, Du), items (n, Di)) -> scores (n,)``.
        config: Feature names and entities.
        features: Where to read features from (the region's edge cache).
        version: Model version.
    """

    #: A row is a (user, item) pair of 32 floats: 256 rows is 32 KiB of features and a
    #: forward pass of ~80 us on one CPU thread here (20 rows: ~40 us), so a batch
    #: holds a dozen 20-candidate requests (at 32 rows, two never shared one) and a
    #: request may rank up to 256 candidates.
    default_max_batch_size: ClassVar[int] = 256

    def __init__(
        self,
        name: str,
        module: nn.Module,
        config: RankerConfig,
        features: FeatureSource,
        version: str = "1",
    ) -> None:
        self.name = name
        self.module = module
        self.config = config
        self.features = features
        self.version = version

    async def parse(
        self,
        body: bytes,
        content_type: str | None,
        headers: Mapping[str, str],
        *,
        max_rows: int,
        max_bytes: int | None = None,
    ) -> Prepared:
        media = (content_type or "").split(";", 1)[0].strip().lower()
        if media != "application/json":
            raise UnsupportedMediaTypeError(
                f"model {self.name!r} takes application/json "
                '({"user_id": ..., "item_ids": [...]}), got '
                f"{content_type or '(none)'!r}"
            )
        try:
            # pydantic parses and validates the JSON in one pass (no dict in between)
            request = RankRequest.model_validate_json(body)
        except (ValueError, ValidationError) as exc:
            raise InvalidTensorError(f"invalid ranking request: {exc}") from None
        if len(request.item_ids) > max_rows:
            raise InvalidTensorError(
                f"request ranks {len(request.item_ids)} items; this worker takes at most "
                f"{max_rows} per request (split the candidates)"
            )
        if len(set(request.item_ids)) != len(request.item_ids):
            raise InvalidTensorError("item_ids holds duplicates; send each candidate once")
        cfg = self.config
        (users, user_mask), (items, item_mask) = await asyncio.gather(
            self.features.get(cfg.user_entity, [request.user_id], cfg.user_features),
            self.features.get(cfg.item_entity, request.item_ids, cfg.item_features),
        )
        if user_mask.any():
            raise MissingFeaturesError(
                "cannot rank: "
                + _describe_missing(
                    cfg.user_entity, [request.user_id], user_mask, cfg.user_features
                )
                + "; sync the user to this region's edge cache"
            )
        row_missing = np.asarray(np.asarray(item_mask).any(axis=1), dtype=bool).reshape(-1)
        incomplete = [bool(flag) for flag in row_missing]
        dropped: list[str] = []
        item_ids = request.item_ids
        if any(incomplete):
            if request.on_missing == "reject" or all(incomplete):
                raise MissingFeaturesError(
                    "cannot rank: "
                    + _describe_missing(
                        cfg.item_entity, request.item_ids, item_mask, cfg.item_features
                    )
                    + '; sync the items or send "on_missing": "drop"'
                )
            dropped = [i for i, bad in zip(item_ids, incomplete, strict=True) if bad]
            item_ids = [i for i, bad in zip(item_ids, incomplete, strict=True) if not bad]
            items = items[~np.array(incomplete)]
        rows = len(item_ids)
        user_rows = np.ascontiguousarray(np.broadcast_to(users, (rows, users.shape[1])))
        return Prepared(
            inputs=(user_rows, np.ascontiguousarray(items)),
            rows=rows,
            meta=(request.user_id, item_ids, dropped),
        )

    def example_rows(self, rows: int) -> tuple[np.ndarray, ...]:
        return (
            np.zeros((rows, len(self.config.user_features)), dtype=np.float32),
            np.zeros((rows, len(self.config.item_features)), dtype=np.float32),
        )

    def render(self, prepared: Prepared, output: np.ndarray) -> dict[str, Any]:
        """Scores in request order and the ranking, best first.

        A NaN or infinite score (features holding NaN, broken weights) is
        answered as ``null`` and ranked last: each item's score is independent,
        so one broken item must not fail the others, and JSON has no NaN. The
        server counts such values (``edgefeed_worker_nonfinite_outputs``). The
        order is total: finite scores descending, ties and nulls in request order.
        """
        user_id, item_ids, dropped = prepared.meta
        scores: list[float | None] = [
            float(score) if math.isfinite(score) else None for score in output.tolist()
        ]
        ranked = sorted(
            zip(item_ids, scores, strict=True),
            key=lambda pair: (pair[1] is None, -pair[1] if pair[1] is not None else 0.0),
        )
        return {
            "model": self.name,
            "version": self.version,
            "user_id": user_id,
            "scores": scores,
            "ranking": [{"item_id": item, "score": score} for item, score in ranked],
            "dropped": dropped,
        }

    def describe(self) -> dict[str, Any]:
        cfg = self.config
        return {
            **super().describe(),
            "features": {
                cfg.user_entity: list(cfg.user_features),
                cfg.item_entity: list(cfg.item_features),
            },
        }

    def log_layout(self) -> LogLayout:
        """The user's and the items' ids and features, one log row per scored item."""
        from workers.featurelog import LoggedEntity, LogLayout

        cfg = self.config
        schemas = {schema.entity: schema for schema in cfg.schemas()}
        schema_of = getattr(self.features, "schema", None)
        entities = []
        for index, (entity, column, features) in enumerate(
            (
                (cfg.user_entity, "user_id", cfg.user_features),
                (cfg.item_entity, "item_id", cfg.item_features),
            )
        ):
            schema = (schema_of(entity) if schema_of is not None else None) or schemas[entity]
            entities.append(
                LoggedEntity(entity, column, features, index, schema.version, schema.personal)
            )
        return LogLayout(tuple(entities), _logged_ids)

    async def aclose(self) -> None:
        await self.features.aclose()
