"""Settings of the per-region edge caches."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["RegionSettings"]

_REGION_NAME = re.compile(r"^[a-z][a-z0-9-]{0,62}$")


class RegionSettings(BaseModel):
    """One serving region and its Redis edge cache.

    Attributes:
        name: Region name, lowercase letters, digits and dashes (``eu-west``).
        redis_url: ``redis://host:port/db`` of the region's cache.
        residency_zone: Data-residency zone (``eu``, ``us``, ``apac``). Personal
            data of an entity whose home region is here may be served only by
            regions of the same zone.
        failover: Regions to fall back to, in order, when this one is down.
        cluster: True when ``redis_url`` names one node of a Redis Cluster (the
            client discovers the others); False for a single server.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    redis_url: str
    residency_zone: str
    failover: list[str] = Field(default_factory=list)
    cluster: bool = False

    @field_validator("name")
    @classmethod
    def _name_shape(cls, value: str) -> str:
        if not _REGION_NAME.match(value):
            raise ValueError(
                f"region name {value!r} must be lowercase letters, digits and dashes, "
                "starting with a letter (e.g. 'eu-west')"
            )
        return value

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, value: str) -> str:
        if not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis_url {value!r} must start with redis://, rediss:// or unix://")
        return value
