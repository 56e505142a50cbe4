"""How current each region's cache is, read from the region's Redis.

Two sources, both written by the pipeline:

- ``ef:freshness:<entity>``: a hash the pipeline updates after each batch
  with ``commit_us`` (source commit time of the newest vector written),
  ``write_us`` (when it was written) and ``lsn``.
- a sample of the vectors themselves (``ef:{<entity>:<id>}``), whose 40-byte
  header carries their own source commit and write times: this catches a
  region whose freshness hash moves while most of its entities do not.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from edge_cache.layout import HEADER_SIZE, MAGIC, KeyLayout
from monitoring.exceptions import SourceUnavailableError

__all__ = [
    "FRESHNESS_PREFIX",
    "VECTOR_PATTERN",
    "EntityTimes",
    "RegionTimes",
    "read_region",
    "vector_times",
]

_LAYOUT = KeyLayout()
FRESHNESS_PREFIX = _LAYOUT.freshness_key("")  # ef:freshness:
VECTOR_PATTERN = f"{_LAYOUT.prefix('*')}*"  # ef:{*:*
# edge_cache.layout's header: after the source position, at bytes 24..40, the
# source commit time and the cache write time (little-endian int64, µs).
_TIMES_OFFSET = 24
_TIMES = struct.Struct("<qq")


def vector_times(value: bytes) -> tuple[int, int] | None:
    """``(commit_us, write_us)`` from a cached vector's header; None if not a vector.

    The header layout is edge_cache.layout's (magic ``EF`` at 0, the two
    little-endian int64 times at 24 and 32); only the header is read, so the
    monitor needs no feature schema and works across schema versions.
    """
    if len(value) < HEADER_SIZE or value[: len(MAGIC)] != MAGIC:
        return None
    commit_us, write_us = _TIMES.unpack_from(value, _TIMES_OFFSET)
    return int(commit_us), int(write_us)


def entity_of_key(key: str) -> str | None:
    """``users`` from ``ef:{users:42}``; None for other keys."""
    if not key.startswith("ef:{") or not key.endswith("}"):
        return None
    entity, sep, _ = key[4:-1].partition(":")
    return entity if sep and entity else None


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


def _int(value: bytes | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None


async def read_region(
    region: str, redis_url: str, *, sample_size: int = 20, timeout_s: float = 5.0
) -> RegionTimes:
    """Read the freshness hashes and a sample of vectors of one region.

    Raises:
        SourceUnavailableError: the region's Redis could not be reached.
    """
    import redis.asyncio as aioredis
    from redis.exceptions import RedisError

    client = aioredis.Redis.from_url(
        redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
    )
    try:
        hashes: dict[str, Mapping[Any, Any]] = {}
        async for raw_key in client.scan_iter(match=f"{FRESHNESS_PREFIX}*", count=500):
            key = raw_key.decode("utf-8", "replace")
            hashes[key[len(FRESHNESS_PREFIX) :]] = await client.hgetall(raw_key)
        sample_keys: list[bytes] = []
        if sample_size > 0:
            async for raw_key in client.scan_iter(match=VECTOR_PATTERN, count=500):
                sample_keys.append(raw_key)
                if len(sample_keys) >= sample_size:
                    break
        sampled: dict[str, list[int]] = {}
        if sample_keys:
            async with client.pipeline(transaction=False) as pipe:
                for raw_key in sample_keys:
                    pipe.getrange(raw_key, 0, HEADER_SIZE - 1)
                heads = await pipe.execute()
            for raw_key, head in zip(sample_keys, heads, strict=True):
                entity = entity_of_key(raw_key.decode("utf-8", "replace"))
                times = vector_times(head) if isinstance(head, bytes) else None
                if entity is not None and times is not None:
                    sampled.setdefault(entity, []).append(times[0])
    except (RedisError, OSError) as exc:
        raise SourceUnavailableError(
            f"redis:{region}",
            f"cannot read region {region!r}'s cache ({type(exc).__name__}); is its Redis up?",
        ) from None
    finally:
        await client.aclose()
    entities = []
    for entity in sorted(set(hashes) | set(sampled)):
        fields = hashes.get(entity, {})
        lsn = fields.get(b"lsn")
        entities.append(
            EntityTimes(
                entity=entity,
                commit_us=_int(fields.get(b"commit_us")),
                write_us=_int(fields.get(b"write_us")),
                lsn=lsn.decode("utf-8", "replace") if lsn is not None else None,
                sample_commit_us=tuple(sorted(sampled.get(entity, ()))),
            )
        )
    return RegionTimes(region, tuple(entities))
