"""How current each region's cache is, read from the region's Redis.

Two sources, both written by the pipeline through :mod:`edge_cache`, and read
through :func:`edge_cache.freshness.read_freshness` (edge_cache owns their
layout; this module parses nothing):

- the freshness record of each entity type (:class:`edge_cache.layout.FreshnessRecord`):
  source commit time and write time of the newest vector written, and its ``lsn``;
- a sample of the vectors themselves, whose headers carry their own source commit
  and write times: this catches a region whose freshness record moves while most of
  its entities do not.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from monitoring.exceptions import SourceUnavailableError

__all__ = ["EntityTimes", "RegionTimes", "read_region"]


@dataclass(frozen=True, slots=True)
class EntityTimes:
    """What one region's Redis says about one entity (times in µs since the epoch)."""

    entity: str
    commit_us: int | None
    write_us: int | None
    lsn: str | None
    sample_commit_us: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class RegionTimes:
    region: str
    entities: tuple[EntityTimes, ...]
    quarantined: int = 0  # entities the pipeline cannot write
    quarantine_sample: tuple[tuple[str, str], ...] = ()  # (entity:id, why), a few
    rebuilding: tuple[str, ...] = ()  # entity types whose history is being rebuilt


async def read_region(
    region: str,
    redis_url: str,
    *,
    sample_size: int = 20,
    timeout_s: float = 5.0,
    redis_options: Mapping[str, Any] | None = None,
) -> RegionTimes:
    """Read the freshness records and a sample of vectors of one region.

    Raises:
        SourceUnavailableError: the region's Redis could not be reached.
    """
    import redis.asyncio as aioredis
    from redis.exceptions import RedisError

    from edge_cache.freshness import read_freshness

    client = aioredis.Redis.from_url(
        redis_url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        **(redis_options or {}),
    )
    try:
        snapshot = await read_freshness(client, sample_size=sample_size)
    except (RedisError, OSError) as exc:
        raise SourceUnavailableError(
            f"redis:{region}",
            f"cannot read region {region!r}'s cache ({type(exc).__name__}); is its Redis up?",
        ) from None
    finally:
        await client.aclose()
    entities = []
    for entity in sorted(set(snapshot.records) | set(snapshot.sampled_commit_us)):
        record = snapshot.records.get(entity)
        entities.append(
            EntityTimes(
                entity=entity,
                commit_us=record.commit_us if record is not None else None,
                write_us=record.write_us if record is not None else None,
                lsn=str(record.lsn) if record is not None else None,
                sample_commit_us=snapshot.sampled_commit_us.get(entity, ()),
            )
        )
    return RegionTimes(
        region,
        tuple(entities),
        snapshot.quarantined,
        snapshot.quarantine_sample,
        snapshot.rebuilding,
    )
