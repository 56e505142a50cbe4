"""Reading how current a region's cache is: the freshness records the writer keeps
and the times in a sample of the vectors' headers (both in :mod:`edge_cache.layout`'s
format; nothing outside edge_cache parses them)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import redis.asyncio as aioredis

from edge_cache.exceptions import CorruptValueError
from edge_cache.layout import HEADER_SIZE, FreshnessRecord, KeyLayout, header_times

__all__ = ["QUARANTINE_SAMPLE", "FreshnessSnapshot", "read_freshness"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FreshnessSnapshot:
    """What one region's cache says about how current it is.

    Attributes:
        records: Entity type -> its freshness record (malformed records are left out,
            and logged).
        sampled_commit_us: Entity type -> source commit times (µs) of a sample of its
            vectors, sorted: catches a region whose records move while its vectors do not.
        quarantined: How many entities the pipeline cannot write (their vectors are
            stale until the cause is fixed).
        quarantine_sample: Up to ``QUARANTINE_SAMPLE`` of them, ``<entity>:<id>`` -> why.
        rebuilding: Entity types whose history is being rebuilt from the source
            (pipeline.history): their windows are short until it ends.
    """

    records: dict[str, FreshnessRecord]
    sampled_commit_us: dict[str, tuple[int, ...]]
    quarantined: int = 0
    quarantine_sample: tuple[tuple[str, str], ...] = ()
    rebuilding: tuple[str, ...] = ()


QUARANTINE_SAMPLE = 5


async def read_freshness(
    client: aioredis.Redis, layout: KeyLayout | None = None, *, sample_size: int = 20
) -> FreshnessSnapshot:
    """Read every freshness record and the headers of up to ``sample_size`` vectors.

    Raises:
        redis.exceptions.RedisError, OSError: the region's Redis could not be read.
    """
    layout = layout or KeyLayout()
    records: dict[str, FreshnessRecord] = {}
    async for raw_key in client.scan_iter(match=layout.freshness_pattern(), count=500):
        entity = layout.entity_of_freshness_key(raw_key.decode("utf-8", "replace"))
        if entity is None:
            continue
        try:
            records[entity] = FreshnessRecord.decode(entity, await client.hgetall(raw_key))
        except CorruptValueError as exc:
            log.warning("%s", exc)
    sample: list[bytes] = []
    if sample_size > 0:
        async for raw_key in client.scan_iter(match=layout.entity_pattern(), count=500):
            sample.append(raw_key)
            if len(sample) >= sample_size:
                break
    sampled: dict[str, list[int]] = {}
    if sample:
        async with client.pipeline(transaction=False) as pipe:
            for raw_key in sample:
                pipe.getrange(raw_key, 0, HEADER_SIZE - 1)
            heads = await pipe.execute(raise_on_error=False)
        for raw_key, head in zip(sample, heads, strict=True):
            entity = layout.entity_of(raw_key.decode("utf-8", "replace"))
            times = header_times(head) if isinstance(head, bytes) else None
            if entity is not None and times is not None:
                sampled.setdefault(entity, []).append(times[0])
    quarantine_key = layout.quarantine_key()
    quarantined = int(await client.hlen(quarantine_key))
    listed: list[tuple[str, str]] = []
    if quarantined:
        _cursor, page = await client.hscan(quarantine_key, 0, count=QUARANTINE_SAMPLE)
        pairs = page.items() if isinstance(page, dict) else ()
        listed = sorted((_text(entity), _text(reason)) for entity, reason in pairs)
        listed = listed[:QUARANTINE_SAMPLE]
    fields = await client.hgetall(layout.rebuild_key())
    rebuilding = sorted(layout.rebuilding_entities(fields))
    return FreshnessSnapshot(
        records,
        {entity: tuple(sorted(times)) for entity, times in sampled.items()},
        quarantined,
        tuple(listed),
        tuple(rebuilding),
    )


def _text(raw: bytes | str) -> str:
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
