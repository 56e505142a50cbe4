"""The writer: idempotent, ordered writes of feature vectors into one region's cache.

Every write carries its source position (:class:`~edge_cache.layout.Position`,
e.g. a PostgreSQL LSN plus the change's order in its transaction). A Lua
script, loaded once and run with EVALSHA, stores a value only when its position
is later than the stored one, so redelivered and reordered change events leave
the same state. A delete stores a position-stamped tombstone (with a TTL) in
place of the vector, so a late older upsert cannot resurrect the entity.

Batches go in one pipelined round trip. The logic lives in :class:`WriterCore`
(no I/O); :class:`FeatureWriter` and :class:`AsyncFeatureWriter` only move
bytes, so the sync and async faces cannot drift apart.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from importlib import resources
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.exceptions import NoScriptError, ResponseError

from edge_cache._redis import close_client
from edge_cache.exceptions import (
    ConfigError,
    CorruptValueError,
    ForeignValueError,
    SchemaError,
    UnknownEntityError,
)
from edge_cache.layout import (
    QUARANTINE_REASON_BYTES,
    FreshnessRecord,
    KeyLayout,
    Position,
    RecordLayout,
    Schedule,
    encode_tombstone,
    to_micros,
)
from edge_cache.schema import FeatureSchema
from edge_cache.settings import RegionSettings

__all__ = [
    "AsyncFeatureWriter",
    "Delete",
    "FeatureWriter",
    "Upsert",
    "WriteOp",
    "WriterCore",
]

WRITE_SCRIPT = resources.files("edge_cache").joinpath("lua/write.lua").read_text(encoding="utf-8")
WRITE_SCRIPT_SHA = hashlib.sha1(WRITE_SCRIPT.encode(), usedforsecurity=False).hexdigest()
DEFAULT_TOMBSTONE_TTL_S = 7 * 24 * 3600.0


@dataclass(frozen=True, slots=True)
class Upsert:
    """Store an entity's whole vector (features not in ``values`` become missing).

    Attributes:
        entity: Entity type.
        id: Entity id.
        values: Feature name -> value (None: missing).
        position: Source position; the write is applied only if later than the stored one.
        commit_time: Source commit time (aware datetime or epoch seconds).
        ttl_s: Optional expiry of the vector, in seconds.
        schedule: The vectors it takes on later without a new event (windows read
            as of the read time); only for a schema with slots.
    """

    entity: str
    id: str | int
    values: Mapping[str, Any]
    position: Position
    commit_time: datetime | float
    ttl_s: float | None = None
    schedule: Schedule | None = None


@dataclass(frozen=True, slots=True)
class Delete:
    """Remove an entity's vector (replaced by a tombstone at ``position``)."""

    entity: str
    id: str | int
    position: Position
    commit_time: datetime | float


WriteOp = Upsert | Delete


class WriterCore:
    """Encodes write operations and interprets the script's answers; no I/O."""

    def __init__(
        self,
        schemas: Iterable[FeatureSchema],
        *,
        layout: KeyLayout | None = None,
        tombstone_ttl_s: float = DEFAULT_TOMBSTONE_TTL_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.layout = layout or KeyLayout()
        self.records: dict[str, RecordLayout] = {}
        for schema in schemas:
            if schema.entity in self.records:
                raise ConfigError(f"two schemas given for entity type {schema.entity!r}")
            self.records[schema.entity] = RecordLayout(schema)
        if not self.records:
            raise ConfigError("a writer needs at least one FeatureSchema")
        if tombstone_ttl_s <= 0:
            raise ConfigError(
                f"tombstone_ttl_s={tombstone_ttl_s!r} must be positive: it bounds how long a "
                "deleted entity is protected against late, older upserts"
            )
        self.tombstone_ttl_ms = round(tombstone_ttl_s * 1000)
        self.clock = clock

    def record(self, entity: str) -> RecordLayout:
        try:
            return self.records[entity]
        except KeyError:
            raise UnknownEntityError(
                f"entity type {entity!r} has no schema in this writer; known: "
                f"{', '.join(sorted(self.records))}"
            ) from None

    def encode(self, op: WriteOp) -> tuple[str, bytes, int]:
        """``(key, value, ttl_ms)`` of one operation (ttl 0: no expiry)."""
        record = self.record(op.entity)
        key = self.layout.key(op.entity, op.id)
        commit_us = to_micros(op.commit_time)
        write_us = round(self.clock() * 1_000_000)
        if isinstance(op, Delete):
            return key, encode_tombstone(op.position, commit_us, write_us), self.tombstone_ttl_ms
        ttl_ms = 0
        if op.ttl_s is not None:
            if op.ttl_s <= 0:
                raise ConfigError(f"ttl_s={op.ttl_s!r} of {key!r} must be positive or None")
            ttl_ms = max(1, round(op.ttl_s * 1000))
        return key, record.encode(op.values, op.position, commit_us, write_us, op.schedule), ttl_ms

    def encode_all(self, ops: Sequence[WriteOp]) -> list[tuple[str, bytes, int]]:
        return [self.encode(op) for op in ops]

    def freshness(self, ops: Sequence[WriteOp]) -> list[FreshnessRecord]:
        """Per entity type of ``ops``, the record of its newest change (by source commit
        time, then LSN), stamped with the current write time."""
        newest: dict[str, tuple[int, int]] = {}
        for op in ops:
            mark = (to_micros(op.commit_time), op.position.lsn)
            current = newest.get(op.entity)
            if current is None or mark > current:
                newest[op.entity] = mark
        write_us = round(self.clock() * 1_000_000)
        return [
            FreshnessRecord(entity, commit_us, write_us, lsn)
            for entity, (commit_us, lsn) in newest.items()
        ]

    def freshness_writes(self, ops: Sequence[WriteOp]) -> list[tuple[str, dict[str, int]]]:
        """``(key, HASH fields)`` of the freshness records of ``ops``."""
        return [
            (self.layout.freshness_key(record.entity), record.encode())
            for record in self.freshness(ops)
        ]

    def outcome(self, keys: Sequence[str], answers: Sequence[Any]) -> list[bool]:
        """Turn the script's answers into applied flags.

        Raises:
            ForeignValueError: a key held a value that is not edgefeed's, or another
                Redis type (the other keys' answers are not read: the caller writes
                them again alone, which changes nothing for those already written).
            CorruptValueError: a freshness record could not be written.
        """
        for answer in answers[len(keys) :]:  # the freshness records' HSETs
            if isinstance(answer, Exception):
                raise CorruptValueError(
                    f"a freshness record could not be written ({answer}); only the edgefeed "
                    "writer may write under the freshness keys"
                )
        applied: list[bool] = []
        for key, answer in zip(keys, answers[: len(keys)], strict=True):
            if isinstance(answer, Exception):
                if str(answer).startswith("WRONGTYPE"):
                    raise ForeignValueError(
                        f"key {key!r} holds another Redis type, not an edgefeed value; the "
                        "write was refused. Another application is using this key namespace"
                    )
                raise answer
            verdict = int(answer[0]) if isinstance(answer, list) else int(answer)
            if verdict < 0:
                raise ForeignValueError(
                    f"key {key!r} holds a value that is not an edgefeed value; the write was "
                    "refused. Another application is using this key namespace"
                )
            applied.append(verdict == 1)
        return applied

    def schema_documents(self) -> list[tuple[str, str, FeatureSchema]]:
        return [
            (
                self.layout.schema_key(r.schema.entity, r.schema.version),
                r.schema.to_json(),
                r.schema,
            )
            for r in self.records.values()
        ]

    @staticmethod
    def check_published(key: str, schema: FeatureSchema, stored: bytes | str | None) -> None:
        """Raise when the registry holds a different schema under the same version."""
        if stored is None:
            return
        other = FeatureSchema.from_json(stored)
        if other.fingerprint != schema.fingerprint or other.personal != schema.personal:
            raise SchemaError(
                f"{key!r} already holds a different schema for {schema.entity!r} version "
                f"{schema.version} ({', '.join(other.names)}); a changed feature list needs a "
                "new version (FeatureSchema.evolve)"
            )


def queue(
    pipe: Any, encoded: list[tuple[str, bytes, int]], fresh: list[tuple[str, dict[str, int]]]
) -> None:
    """Queue a batch on a (sync or async) pipeline: the script call per vector, then the
    freshness records."""
    for key, value, ttl_ms in encoded:
        pipe.execute_command("EVALSHA", WRITE_SCRIPT_SHA, 1, key, value, ttl_ms)
    for key, fields in fresh:
        pipe.hset(key, mapping=fields)


def _has_noscript(answers: Sequence[Any]) -> bool:
    return any(isinstance(a, NoScriptError) for a in answers)


def _client_options(timeout_s: float) -> dict[str, Any]:
    return {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}


class FeatureWriter:
    """Writes feature vectors into one region's Redis (single server or cluster).

    Args:
        client: A ``redis.Redis`` or ``redis.cluster.RedisCluster`` (bytes responses).
        schemas: The schemas of the entity types this writer writes.
        layout: Key layout (namespace); must match the readers'.
        tombstone_ttl_s: How long a delete's tombstone guards against late upserts.
        clock: Wall clock for the write time stored with each value.
    """

    def __init__(
        self,
        client: redis.Redis | redis.RedisCluster,
        schemas: Iterable[FeatureSchema],
        *,
        layout: KeyLayout | None = None,
        tombstone_ttl_s: float = DEFAULT_TOMBSTONE_TTL_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.core = WriterCore(schemas, layout=layout, tombstone_ttl_s=tombstone_ttl_s, clock=clock)
        self.client = client

    @classmethod
    def from_region(
        cls,
        region: RegionSettings,
        schemas: Iterable[FeatureSchema],
        *,
        timeout_s: float = 5.0,
        **options: Any,
    ) -> FeatureWriter:
        """A writer for the region's cache, built from its settings."""
        if region.cluster:
            client: redis.Redis | redis.RedisCluster = redis.RedisCluster.from_url(
                region.redis_url, **_client_options(timeout_s), **region.redis_options("writer")
            )
        else:
            client = redis.Redis.from_url(
                region.redis_url, **_client_options(timeout_s), **region.redis_options("writer")
            )
        return cls(client, schemas, **options)

    def publish_schemas(self) -> None:
        """Store each schema in the cache's registry so readers of other versions can
        check compatibility. Idempotent.

        Raises:
            SchemaError: the registry holds a different schema under the same version.
        """
        for key, document, schema in self.core.schema_documents():
            if not self.client.set(key, document, nx=True):
                self.core.check_published(key, schema, self.client.get(key))

    def upsert(
        self,
        entity: str,
        entity_id: str | int,
        values: Mapping[str, Any],
        position: Position,
        commit_time: datetime | float,
        *,
        ttl_s: float | None = None,
    ) -> bool:
        """Store one vector; True if written, False if a later position is already stored."""
        return self.write([Upsert(entity, entity_id, values, position, commit_time, ttl_s)])[0]

    def delete(
        self, entity: str, entity_id: str | int, position: Position, commit_time: datetime | float
    ) -> bool:
        """Delete one entity; True if applied, False if a later position is already stored."""
        return self.write([Delete(entity, entity_id, position, commit_time)])[0]

    def write(self, ops: Sequence[WriteOp], *, freshness: bool = False) -> list[bool]:
        """Apply a batch in one pipelined round trip; per op, whether it was applied.

        Ops on the same key are applied in order. Retrying a batch is safe.

        Args:
            ops: The batch.
            freshness: Also record, in the same round trip, each entity type's
                :class:`~edge_cache.layout.FreshnessRecord` (its newest change in ``ops``).
        """
        if not ops:
            return []
        encoded = self.core.encode_all(ops)
        fresh = self.core.freshness_writes(ops) if freshness else []
        answers = self._run(encoded, fresh)
        if _has_noscript(answers):
            self.client.script_load(WRITE_SCRIPT)
            answers = self._run(encoded, fresh)
        return self.core.outcome([key for key, _, _ in encoded], answers)

    def _run(
        self, encoded: list[tuple[str, bytes, int]], fresh: list[tuple[str, dict[str, int]]]
    ) -> list[Any]:
        pipe = self.client.pipeline(transaction=False)
        queue(pipe, encoded, fresh)
        try:
            return list(pipe.execute(raise_on_error=False))
        except NoScriptError as exc:  # cluster pipelines raise instead of returning
            return [exc]
        except ResponseError as exc:
            if "NOSCRIPT" in str(exc):
                return [NoScriptError(str(exc))]
            raise

    def close(self) -> None:
        """Close the writer's connections."""
        close_client(self.client)

    def __enter__(self) -> FeatureWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncFeatureWriter:
    """The asyncio face of :class:`FeatureWriter` (same arguments, same behaviour)."""

    def __init__(
        self,
        client: aioredis.Redis | aioredis.RedisCluster,
        schemas: Iterable[FeatureSchema],
        *,
        layout: KeyLayout | None = None,
        tombstone_ttl_s: float = DEFAULT_TOMBSTONE_TTL_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.core = WriterCore(schemas, layout=layout, tombstone_ttl_s=tombstone_ttl_s, clock=clock)
        self.client = client

    @classmethod
    def from_region(
        cls,
        region: RegionSettings,
        schemas: Iterable[FeatureSchema],
        *,
        timeout_s: float = 5.0,
        **options: Any,
    ) -> AsyncFeatureWriter:
        """A writer for the region's cache, built from its settings."""
        if region.cluster:
            client: aioredis.Redis | aioredis.RedisCluster = aioredis.RedisCluster.from_url(
                region.redis_url, **_client_options(timeout_s), **region.redis_options("writer")
            )
        else:
            client = aioredis.Redis.from_url(
                region.redis_url, **_client_options(timeout_s), **region.redis_options("writer")
            )
        return cls(client, schemas, **options)

    async def publish_schemas(self) -> None:
        """See :meth:`FeatureWriter.publish_schemas`."""
        for key, document, schema in self.core.schema_documents():
            if not await self.client.set(key, document, nx=True):
                self.core.check_published(key, schema, await self.client.get(key))

    async def upsert(
        self,
        entity: str,
        entity_id: str | int,
        values: Mapping[str, Any],
        position: Position,
        commit_time: datetime | float,
        *,
        ttl_s: float | None = None,
    ) -> bool:
        """See :meth:`FeatureWriter.upsert`."""
        return (
            await self.write([Upsert(entity, entity_id, values, position, commit_time, ttl_s)])
        )[0]

    async def delete(
        self, entity: str, entity_id: str | int, position: Position, commit_time: datetime | float
    ) -> bool:
        """See :meth:`FeatureWriter.delete`."""
        return (await self.write([Delete(entity, entity_id, position, commit_time)]))[0]

    async def write(self, ops: Sequence[WriteOp], *, freshness: bool = False) -> list[bool]:
        """See :meth:`FeatureWriter.write`: with ``freshness=True`` the batch's freshness
        records go in the same pipelined round trip (what the pipeline does per batch)."""
        if not ops:
            return []
        encoded = self.core.encode_all(ops)
        fresh = self.core.freshness_writes(ops) if freshness else []
        answers = await self._run(encoded, fresh)
        if _has_noscript(answers):
            await self.client.script_load(WRITE_SCRIPT)
            answers = await self._run(encoded, fresh)
        return self.core.outcome([key for key, _, _ in encoded], answers)

    async def mark_quarantined(
        self, quarantined: Mapping[str, str], released: Sequence[str] = ()
    ) -> None:
        """List entities (``<entity>:<id>`` -> why) whose vectors the pipeline cannot
        write, and take ``released`` ones off the list (:meth:`KeyLayout.quarantine_key`),
        in one round trip; monitoring reads the list with
        :func:`edge_cache.freshness.read_freshness`."""
        key = self.core.layout.quarantine_key()
        pipe = self.client.pipeline(transaction=False)
        if released:
            pipe.hdel(key, *released)
        if quarantined:
            cut = {
                entity: reason.encode("utf-8")[:QUARANTINE_REASON_BYTES]
                for entity, reason in quarantined.items()
            }
            pipe.hset(key, mapping=cut)  # type: ignore[arg-type]
        await pipe.execute()

    async def _run(
        self, encoded: list[tuple[str, bytes, int]], fresh: list[tuple[str, dict[str, int]]]
    ) -> list[Any]:
        pipe = self.client.pipeline(transaction=False)
        queue(pipe, encoded, fresh)
        try:
            return list(await pipe.execute(raise_on_error=False))
        except NoScriptError as exc:
            return [exc]
        except ResponseError as exc:
            if "NOSCRIPT" in str(exc):
                return [NoScriptError(str(exc))]
            raise

    async def close(self) -> None:
        await self.client.aclose()

    async def __aenter__(self) -> AsyncFeatureWriter:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
