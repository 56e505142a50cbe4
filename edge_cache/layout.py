"""The key layout and the binary value format, shared by the writer and the reader.

This module is the single owner of how features live in Redis; the writer and
the lookup client both use it, nothing else builds keys or parses values.

Keys
    ``{namespace}:{{{entity}:{id}}}``, e.g. ``ef:{user:42}``. The whole
    ``entity:id`` is the Redis Cluster hash tag, so every key of one entity
    (today one: its vector; its tombstone reuses the same key) lives in one
    slot. Schema registry entries are ``{namespace}:schema:{entity}:{version}``.

Values (little-endian unless noted, packed, fixed size per schema version)::

    offset size field
    0      2    magic "EF"
    2      1    format version (1)
    3      1    flags (bit 0: tombstone)
    4      2    schema version
    6      2    number of features N in the writer's schema
    8      4    schema fingerprint
    12     8    source position: LSN        (big-endian, so the Lua check can
    20     4    source position: order in   compare it with struct.unpack)
                the transaction
    24     8    source commit time, microseconds since the epoch
    32     8    cache write time, microseconds since the epoch
    40     ...  feature values in schema order, each in its dtype
    end-ceil(N/8) validity bitmap, bit i set when feature i has a value

A schema with ``slots`` K > 0 (an entity type whose windows are read as of the
read time) appends its schedule to every value, and its values carry flag bit 1
(scheduled)::

    8            until: microseconds; the schedule is known up to here
                 (INT64_MAX: complete, nothing changes without a new event)
    8*K          from: when each scheduled vector takes over (ascending;
                 INT64_MAX for an unused slot)
    K*body       the scheduled vectors, each laid out as the values and
                 bitmap above

The values after the header are the vector in force from the write on; a read at
time t uses the last scheduled vector whose ``from`` is at or before t. A read
at or after ``until`` gets the last one, which the writer renews by then
(``edgefeed`` workers do: the same position written again with a later write
time replaces a scheduled value).

A tombstone is the 40-byte header alone with the tombstone flag: deleting an
entity overwrites its vector with a position-stamped tombstone (with a TTL), so
a late, older upsert cannot resurrect it.

Freshness records
    ``{namespace}:freshness:{entity}``, a HASH with the decimal fields
    ``commit_us``, ``write_us`` and ``lsn`` of the newest vector the pipeline wrote
    for the entity type (:class:`FreshnessRecord`).
"""

from __future__ import annotations

import math
import struct
import time
from bisect import bisect_right
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

import numpy as np

from edge_cache.exceptions import (
    CorruptValueError,
    InvalidValueError,
    SchemaError,
    SchemaVersionError,
)
from edge_cache.schema import Dtype, FeatureSchema

__all__ = [
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "QUARANTINE_REASON_BYTES",
    "Decoded",
    "FreshnessRecord",
    "KeyLayout",
    "Position",
    "RecordLayout",
    "RecordReader",
    "Schedule",
    "encode_tombstone",
    "header_times",
    "to_micros",
]

MAGIC: Final = b"EF"
FORMAT_VERSION: Final = 1
FLAG_TOMBSTONE: Final = 1
FLAG_SCHEDULED: Final = 2
NEVER_US: Final = 2**63 - 1  # an unused slot's ``from``; a complete schedule's ``until``
HEADER_SIZE: Final = 40
POSITION_OFFSET: Final = 12  # the Lua script reads bytes 13..24 (1-based)

_HEADER_FIELDS: list[tuple[str, str]] = [
    ("magic", "S2"),
    ("format", "u1"),
    ("flags", "u1"),
    ("schema_version", "<u2"),
    ("n_features", "<u2"),
    ("fingerprint", "<u4"),
    ("lsn", ">u8"),
    ("seq", ">u4"),
    ("commit_us", "<i8"),
    ("write_us", "<i8"),
]
_HEADER = struct.Struct("<2sBBHHI")  # the part before the position
_POSITION = struct.Struct(">QI")
_TIMES = struct.Struct("<qq")

_NUMPY: dict[Dtype, str] = {
    "float32": "<f4",
    "float64": "<f8",
    "int32": "<i4",
    "int64": "<i8",
    "bool": "u1",
}
_INT_RANGE: dict[Dtype, tuple[int, int]] = {
    "int32": (-(2**31), 2**31 - 1),
    "int64": (-(2**63), 2**63 - 1),
}
_U64 = 2**64 - 1
_U32 = 2**32 - 1


@dataclass(frozen=True, slots=True, order=True)
class Position:
    """Where a change comes from in the source's log; later positions win.

    Attributes:
        lsn: Log position of the source transaction (PostgreSQL LSN as an int).
        seq: Order of the change within the transaction.
    """

    lsn: int
    seq: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.lsn, int) or not 0 <= self.lsn <= _U64:
            raise InvalidValueError(f"position lsn {self.lsn!r} must be an int in 0..2**64-1")
        if not isinstance(self.seq, int) or not 0 <= self.seq <= _U32:
            raise InvalidValueError(f"position seq {self.seq!r} must be an int in 0..2**32-1")

    @classmethod
    def from_pg_lsn(cls, lsn: str, seq: int = 0) -> Position:
        """Parse PostgreSQL's ``XXXXXXXX/XXXXXXXX`` LSN text.

        Raises:
            InvalidValueError: not an LSN.
        """
        high, sep, low = lsn.partition("/")
        try:
            if not sep:
                raise ValueError(lsn)
            return cls((int(high, 16) << 32) | int(low, 16), seq)
        except ValueError:
            raise InvalidValueError(
                f"{lsn!r} is not a PostgreSQL LSN; expected hex 'XXXXXXXX/XXXXXXXX' "
                "like '16/B374D848'"
            ) from None

    def pack(self) -> bytes:
        """The 12 big-endian bytes stored at :data:`POSITION_OFFSET`."""
        return _POSITION.pack(self.lsn, self.seq)


def to_micros(value: datetime | float | int) -> int:
    """Microseconds since the epoch from an aware datetime or epoch seconds.

    Raises:
        InvalidValueError: a naive datetime or a non-finite number.
    """
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise InvalidValueError(
                f"timestamp {value.isoformat()} has no time zone; pass an aware datetime "
                "(datetime.now(timezone.utc)) or epoch seconds"
            )
        return round(value.timestamp() * 1_000_000)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidValueError(f"timestamp {value!r} must be an aware datetime or epoch seconds")
    return round(value * 1_000_000)


@dataclass(frozen=True, slots=True)
class KeyLayout:
    """Builds the Redis keys of entities and schema registry entries.

    Attributes:
        namespace: Prefix of every key, so several deployments can share a Redis.
    """

    namespace: str = "ef"

    def __post_init__(self) -> None:
        if not self.namespace or any(c in self.namespace for c in "{}: \n"):
            raise SchemaError(
                f"key namespace {self.namespace!r} must be non-empty without '{{', '}}', ':' "
                "or spaces"
            )

    def prefix(self, entity: str) -> str:
        """Everything of an entity key before the id (``ef:{user:``)."""
        return f"{self.namespace}:{{{entity}:"

    def key(self, entity: str, entity_id: str | int) -> str:
        """The key of one entity's vector (``ef:{user:42}``)."""
        return f"{self.namespace}:{{{entity}:{_id_text(entity_id)}}}"

    def keys(self, entity: str, ids: Sequence[str | int]) -> list[str]:
        """Keys of many entities of one type, in order."""
        prefix = self.prefix(entity)
        # the common case, checked in bulk: ids that are all non-empty str / plain int
        if set(map(type, ids)) <= _PLAIN_ID_TYPES and "" not in ids:
            return [f"{prefix}{entity_id}}}" for entity_id in ids]
        return [f"{prefix}{_id_text(entity_id)}}}" for entity_id in ids]

    def schema_key(self, entity: str, version: int) -> str:
        """The registry key of one schema version (``ef:schema:user:2``)."""
        return f"{self.namespace}:schema:{entity}:{version}"

    def declaration_key(self, entity: str, version: int) -> str:
        """What a schema version was declared as (``ef:schemadecl:user:2``): the
        pipeline's entity declaration, registered by ``edgefeed features apply``."""
        return f"{self.namespace}:schemadecl:{entity}:{version}"

    def backfill_key(self, entity: str, version: int) -> str:
        """The tables a version still has to snapshot (``ef:backfill:user:2``): JSON
        list, ``[]`` once signalled."""
        return f"{self.namespace}:backfill:{entity}:{version}"

    def writer_marker_pattern(self) -> str:
        """A SCAN pattern matching every writer marker (``ef:writer:*``)."""
        return f"{self.namespace}:writer:*"

    def writer_marker_key(self, writer: str) -> str:
        """A key one writer process keeps alive (with an expiry it refreshes) to notice
        that the cache lost its data: gone while the writer lives means the Redis was
        emptied or restarted without persistence (``ef:writer:<id>``)."""
        return f"{self.namespace}:writer:{writer}"

    def entity_pattern(self) -> str:
        """A SCAN pattern matching every entity key (``ef:{*:*``)."""
        return f"{self.namespace}:{{*:*"

    def entity_of(self, key: str) -> str | None:
        """The entity type of an entity key (``user`` from ``ef:{user:42}``); None for
        any other key."""
        head = f"{self.namespace}:{{"
        if not key.startswith(head) or not key.endswith("}"):
            return None
        entity, sep, _ = key[len(head) : -1].partition(":")
        return entity if sep and entity else None

    def freshness_pattern(self) -> str:
        """A SCAN pattern matching every freshness record (``ef:freshness:*``)."""
        return self.freshness_key("*")

    def entity_of_freshness_key(self, key: str) -> str | None:
        """The entity type of a freshness key; None for any other key."""
        head = self.freshness_key("")
        return key[len(head) :] or None if key.startswith(head) else None

    def quarantine_key(self) -> str:
        """The HASH where the pipeline lists the entities whose vectors it cannot write
        (quarantined): ``<entity>:<id>`` -> the reason, at most
        :data:`QUARANTINE_REASON_BYTES` bytes (``ef:quarantine``)."""
        return f"{self.namespace}:quarantine"

    def rebuild_key(self) -> str:
        """The HASH where the pipeline lists the history rebuilds in progress
        (pipeline.history): ``<entity>|<partition>`` -> JSON ``{id, table, at_ms}``;
        an entity type is rebuilding while any field names it (``ef:rebuilding``)."""
        return f"{self.namespace}:rebuilding"

    @staticmethod
    def rebuilding_entities(fields: Iterable[bytes | str]) -> frozenset[str]:
        """The entity types a :meth:`rebuild_key` hash lists, from its field names."""
        return frozenset(
            (f.decode("utf-8", "replace") if isinstance(f, bytes) else str(f)).partition("|")[0]
            for f in fields
        )

    def freshness_key(self, entity: str) -> str:
        """The HASH where the pipeline records, per entity type, the source commit
        time (``commit_us``), write time (``write_us``) and ``lsn`` of the newest
        vector written (``ef:freshness:user``)."""
        return f"{self.namespace}:freshness:{entity}"


_PLAIN_ID_TYPES = frozenset({str, int})

QUARANTINE_REASON_BYTES = 500  # a quarantine reason is cut to this many bytes


def _id_text(entity_id: str | int) -> str:
    if isinstance(entity_id, str):
        if entity_id:
            return entity_id
    elif isinstance(entity_id, int | np.integer) and not isinstance(entity_id, bool | np.bool_):
        return str(int(entity_id))
    raise InvalidValueError(f"entity id {entity_id!r} must be a non-empty str or an int")


def encode_tombstone(position: Position, commit_us: int, write_us: int) -> bytes:
    """The 40-byte tombstone that replaces a deleted entity's vector."""
    return (
        _HEADER.pack(MAGIC, FORMAT_VERSION, FLAG_TOMBSTONE, 0, 0, 0)
        + position.pack()
        + _TIMES.pack(commit_us, write_us)
    )


def header_times(value: bytes) -> tuple[int, int] | None:
    """``(commit_us, write_us)`` from a cached value's header (a vector's or a
    tombstone's; the first :data:`HEADER_SIZE` bytes suffice, any schema version);
    None when ``value`` is not an edgefeed value."""
    if len(value) < HEADER_SIZE or value[: len(MAGIC)] != MAGIC:
        return None
    commit_us, write_us = _TIMES.unpack_from(value, POSITION_OFFSET + _POSITION.size)
    return int(commit_us), int(write_us)


_FRESHNESS_FIELDS = ("commit_us", "write_us", "lsn")


@dataclass(frozen=True, slots=True)
class FreshnessRecord:
    """How current one entity type is in a region's cache, written by the pipeline
    once per batch (:meth:`edge_cache.AsyncFeatureWriter.write` with ``freshness``).

    Attributes:
        entity: Entity type.
        commit_us: Source commit time of the newest vector written (µs since the epoch).
        write_us: When it was written to the cache (µs since the epoch).
        lsn: Source log position of that vector.
    """

    entity: str
    commit_us: int
    write_us: int
    lsn: int

    def encode(self) -> dict[str, int]:
        """The HASH fields stored at :meth:`KeyLayout.freshness_key`."""
        return {"commit_us": self.commit_us, "write_us": self.write_us, "lsn": self.lsn}

    @classmethod
    def decode(cls, entity: str, fields: Mapping[Any, Any]) -> FreshnessRecord:
        """Parse the HASH fields read back (bytes or str keys and values).

        Raises:
            CorruptValueError: a field is missing or not an integer.
        """
        values: dict[str, int] = {}
        for name in _FRESHNESS_FIELDS:
            raw = fields.get(name.encode(), fields.get(name))
            try:
                text = raw.decode("ascii") if isinstance(raw, bytes) else raw
                if not isinstance(text, str) or not text.lstrip("-").isdigit():
                    raise ValueError(text)
                values[name] = int(text)
            except (UnicodeDecodeError, ValueError):
                raise CorruptValueError(
                    f"freshness record of {entity!r} has field {name}={raw!r}, not an integer; "
                    "only the edgefeed writer may write freshness records"
                ) from None
        return cls(entity, values["commit_us"], values["write_us"], values["lsn"])


@dataclass(frozen=True, slots=True)
class _Run:
    field: str
    dtype: Dtype
    start: int
    count: int


def _runs(schema: FeatureSchema) -> list[_Run]:
    runs: list[_Run] = []
    for position, feature in enumerate(schema.features):
        if runs and runs[-1].dtype == feature.dtype:
            last = runs[-1]
            runs[-1] = _Run(last.field, last.dtype, last.start, last.count + 1)
        else:
            runs.append(_Run(f"r{len(runs)}", feature.dtype, position, 1))
    return runs


@dataclass(frozen=True, slots=True)
class Schedule:
    """The vectors an entity's value takes on later, without a new event (its windows
    at later read times).

    Attributes:
        patches: ``(from_us, values)``: from ``from_us`` on (microseconds since the
            epoch, ascending) the vector is ``values`` (a whole vector).
        until_us: The schedule is known up to this time (None: complete; nothing
            changes after the last patch until a new event).
    """

    patches: tuple[tuple[int, Mapping[str, Any]], ...] = ()
    until_us: int | None = None


@dataclass(frozen=True, slots=True)
class RecordLayout:
    """The fixed-size record of one schema version, as a NumPy structured dtype.

    Consecutive features of the same dtype form one sub-array field (``r0``,
    ``r1``...), so an all-float32 schema decodes as one ``float32[N]`` block. A
    schema with slots adds ``until_us``, ``from_us`` and ``patch`` (the scheduled
    vectors, each a record of the body fields) to ``dtype``; what a read returns
    is ``compact``, the header and the one vector in force (``dtype`` itself
    without slots).
    """

    schema: FeatureSchema
    dtype: np.dtype[Any] = field(init=False)
    body: np.dtype[Any] = field(init=False)
    runs: tuple[_Run, ...] = field(init=False)
    itemsize: int = field(init=False)
    payload_size: int = field(init=False)
    valid_size: int = field(init=False)
    body_size: int = field(init=False)
    slots: int = field(init=False)
    compact: np.dtype[Any] = field(init=False)
    compact_size: int = field(init=False)
    _slot: tuple[tuple[str, int], ...] = field(init=False, repr=False)
    # in_force's gather: a value's header and body as opaque items, and what each slot
    # taken adds to the offset of the body in force (see in_force)
    _head_body: np.dtype[Any] = field(init=False, repr=False)
    _body_item: np.dtype[Any] = field(init=False, repr=False)
    _steps: np.ndarray[Any, np.dtype[np.intp]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        runs = tuple(_runs(self.schema))
        n = len(self.schema.features)
        valid_size = (n + 7) // 8
        body_fields: list[Any] = [(run.field, _NUMPY[run.dtype], (run.count,)) for run in runs]
        body_fields.append(("valid", "u1", (valid_size,)))
        body = np.dtype(body_fields)
        fields: list[Any] = list(_HEADER_FIELDS) + body_fields
        slots = self.schema.slots
        if slots:
            fields += [("until_us", "<i8"), ("from_us", "<i8", (slots,)), ("patch", body, (slots,))]
        dtype = np.dtype(fields)
        compact = np.dtype(list(_HEADER_FIELDS) + body_fields)
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "compact", compact)
        object.__setattr__(self, "compact_size", compact.itemsize)
        body_item = np.dtype((np.void, body.itemsize))
        object.__setattr__(self, "_body_item", body_item)
        object.__setattr__(
            self, "_head_body", np.dtype([("head", (np.void, HEADER_SIZE)), ("body", body_item)])
        )
        # the first slot taken moves the body from the vector written to patch 0, each
        # further one by a body: offset = header + taken-mask @ steps
        steps = [body.itemsize + 8 + 8 * slots] + [body.itemsize] * (slots - 1)
        object.__setattr__(self, "_steps", np.asarray(steps[:slots], dtype=np.intp))
        object.__setattr__(self, "body", body)
        object.__setattr__(self, "runs", runs)
        object.__setattr__(self, "itemsize", dtype.itemsize)
        object.__setattr__(self, "valid_size", valid_size)
        object.__setattr__(self, "body_size", body.itemsize)
        object.__setattr__(self, "payload_size", body.itemsize - valid_size)
        object.__setattr__(self, "slots", slots)
        slot = []
        for run in runs:
            slot += [(run.field, i) for i in range(run.count)]
        object.__setattr__(self, "_slot", tuple(slot))

    @property
    def flags(self) -> int:
        """The header flags of this layout's values."""
        return FLAG_SCHEDULED if self.slots else 0

    def encode(
        self,
        values: Mapping[str, Any],
        position: Position,
        commit_us: int,
        write_us: int,
        schedule: Schedule | None = None,
    ) -> bytes:
        """One entity's vector as bytes. Features absent from ``values``, None or NaN
        are missing.

        Args:
            schedule: The vectors it takes on later (a schema with slots; more
                patches than slots shorten the schedule: ``until`` becomes the
                first patch left out).

        Raises:
            InvalidValueError: an unknown feature name or a value that does not fit
                its dtype, or a schedule for a schema without slots.
        """
        schema = self.schema
        record = np.zeros((), dtype=self.dtype)
        record["magic"] = MAGIC
        record["format"] = FORMAT_VERSION
        record["flags"] = self.flags
        record["schema_version"] = schema.version
        record["n_features"] = len(schema.features)
        record["fingerprint"] = schema.fingerprint
        record["lsn"] = position.lsn
        record["seq"] = position.seq
        record["commit_us"] = commit_us
        record["write_us"] = write_us
        self._fill(record, values)
        if self.slots:
            patches = schedule.patches if schedule is not None else ()
            until = schedule.until_us if schedule is not None else None
            if len(patches) > self.slots:
                until = patches[self.slots][0]
                patches = patches[: self.slots]
            record["until_us"] = NEVER_US if until is None else until
            froms = np.full(self.slots, NEVER_US, dtype=np.int64)
            previous = -NEVER_US
            for index, (from_us, patch) in enumerate(patches):
                if from_us <= previous:
                    raise InvalidValueError(
                        f"scheduled vectors of {schema.entity!r} must take over at increasing "
                        f"times; {from_us} follows {previous}"
                    )
                previous = from_us
                froms[index] = from_us
                self._fill(record["patch"][index], patch)
            record["from_us"] = froms
        elif schedule is not None and schedule.patches:
            raise InvalidValueError(
                f"schema {schema.entity!r} v{schema.version} has no slots for scheduled vectors"
            )
        return record.tobytes()

    def _fill(self, record: np.ndarray[Any, Any], values: Mapping[str, Any]) -> None:
        schema = self.schema
        valid = bytearray(self.valid_size)
        for name, value in values.items():
            index = schema.position(name)
            if index is None:
                raise InvalidValueError(
                    f"feature {name!r} is not in schema {schema.entity!r} v{schema.version}; "
                    f"valid: {', '.join(schema.names)}"
                )
            if value is None:
                continue
            checked = _check(schema.features[index].dtype, name, value)
            if checked != checked:  # NaN: no value (readers treat a stored NaN alike)
                continue
            run_field, offset = self._slot[index]
            record[run_field][offset] = checked
            valid[index >> 3] |= 1 << (index & 7)
        record["valid"] = np.frombuffer(bytes(valid), dtype=np.uint8)

    def in_force(self, buffer: bytes, count: int, now_us: int | None) -> np.ndarray[Any, Any]:
        """``count`` values of this layout (checked, back to back in ``buffer``) as
        ``compact`` records, each holding the vector in force at ``now_us`` (None: the
        one written).

        Only the chosen bytes are copied, in a few NumPy calls whatever ``count``: the
        headers through a strided view, the bodies in force with one fancy index into
        a byte-granular view of ``buffer``; the schedule's other vectors are never
        decoded or copied.
        """
        if not self.slots:
            return np.frombuffer(buffer, dtype=self.dtype)
        size = self.itemsize
        out = np.empty(count, dtype=self.compact)
        parts = out.view(self._head_body)
        parts["head"] = np.ndarray((count,), parts.dtype["head"], buffer, 0, (size,))
        if now_us is None:
            parts["body"] = np.ndarray((count,), self._body_item, buffer, HEADER_SIZE, (size,))
            return out
        from_us = np.ndarray(
            (count, self.slots), "<i8", buffer, HEADER_SIZE + self.body_size + 8, (size, 8)
        )
        # ascending from_us: the slots taken are a prefix of each row, so the dot product
        # with the steps is the offset of the last one taken (0: the vector written)
        chosen = np.arange(HEADER_SIZE, count * size, size) + (from_us <= now_us) @ self._steps
        # element i: the body_size bytes from buffer[i] on (a view, no copy)
        at_byte = np.ndarray((len(buffer) - self.body_size + 1,), self._body_item, buffer, 0, (1,))
        parts["body"] = at_byte[chosen]
        return out

    def in_force_bytes(self, raw: bytes, now_us: int | None) -> bytes:
        """One value (of this layout, checked) as a ``compact`` record's bytes with the
        vector in force at ``now_us`` (None: the one written): for a few values,
        cheaper than NumPy."""
        if not self.slots:
            return raw
        taken = 0
        if now_us is not None:
            trailer = HEADER_SIZE + self.body_size
            taken = bisect_right(struct.unpack_from(f"<{self.slots}q", raw, trailer + 8), now_us)
        if not taken:
            return raw[: self.compact_size]
        start = HEADER_SIZE + self.body_size + 8 * (1 + self.slots) + (taken - 1) * self.body_size
        return raw[:HEADER_SIZE] + raw[start : start + self.body_size]

    def body_at(self, raw: bytes, now_us: int | None) -> bytes:
        """The body (values and bitmap) of one value in force at ``now_us`` (None: the
        one written)."""
        start = HEADER_SIZE
        if self.slots and now_us is not None:
            trailer = HEADER_SIZE + self.body_size
            froms = np.frombuffer(raw, dtype="<i8", count=self.slots, offset=trailer + 8)
            taken = int((froms <= now_us).sum())
            if taken:
                start = trailer + 8 + 8 * self.slots + (taken - 1) * self.body_size
        return raw[start : start + self.body_size]


def _check(dtype: Dtype, name: str, value: Any) -> Any:
    if dtype == "bool":
        if isinstance(value, bool | np.bool_):
            return bool(value)
        raise InvalidValueError(f"feature {name!r} is bool; got {value!r}")
    if isinstance(value, bool | np.bool_):
        raise InvalidValueError(f"feature {name!r} is {dtype}; got the bool {value!r}")
    if dtype in _INT_RANGE:
        if not isinstance(value, int | np.integer):
            raise InvalidValueError(f"feature {name!r} is {dtype}; got {value!r}")
        low, high = _INT_RANGE[dtype]
        if not low <= int(value) <= high:
            raise InvalidValueError(f"feature {name!r} value {value!r} is out of {dtype} range")
        return int(value)
    if not isinstance(value, int | float | np.integer | np.floating):
        raise InvalidValueError(f"feature {name!r} is {dtype}; got {value!r}")
    number = float(value)
    if dtype == "float32" and math.isfinite(number) and abs(number) > 3.4028234663852886e38:
        raise InvalidValueError(f"feature {name!r} value {value!r} is out of float32 range")
    return number


@dataclass(frozen=True, slots=True)
class Decoded:
    """Values of one lookup decoded into the reader's record layout.

    Attributes:
        records: One record per found entity, in the reader's ``compact`` layout
            (header and the vector in force at the read time; no schedule).
        rows: For each record, the index of its id in the request.
        deleted: Indices of ids whose key holds a tombstone.
        needs: ``(version, fingerprint)`` of schema versions to fetch from the
            registry before decoding can finish; when not empty, ``records`` is empty.
        all_valid: Every feature of every record has a value.
        complete: Every requested id was found, and ``rows`` is ``0..n-1`` in order.
        corrupt: ``(index, reason)`` of ids whose value is not an edgefeed value
            (read as missing; the reason names the key).
    """

    records: np.ndarray[Any, Any]
    rows: np.ndarray[Any, np.dtype[np.intp]]
    deleted: tuple[int, ...] = ()
    needs: frozenset[tuple[int, int]] = frozenset()
    all_valid: bool = False
    complete: bool = False
    corrupt: tuple[tuple[int, str], ...] = ()


class RecordReader:
    """Decodes cached values into the layout of the reader's schema version.

    Values of the reader's own version are decoded in one vectorised
    ``numpy.frombuffer``. A value of another version is read only when the
    writer's schema, fetched once from the registry, is an append-only
    evolution or ancestor of the reader's: a newer value gives the features the
    reader knows, an older one leaves the later features missing. Anything else
    is refused with :class:`SchemaVersionError`, never misread.
    """

    def __init__(self, schema: FeatureSchema, layout: KeyLayout) -> None:
        self.schema = schema
        self.layout = layout
        self.record = RecordLayout(schema)
        self._empty = np.zeros(0, dtype=self.record.compact)
        self._prefix = _HEADER.pack(
            MAGIC,
            FORMAT_VERSION,
            self.record.flags,
            schema.version,
            len(schema.features),
            schema.fingerprint,
        )
        n = len(schema.features)
        full = bytearray(b"\xff" * self.record.valid_size)
        if n % 8:
            full[-1] = (1 << (n % 8)) - 1
        self._full_valid = bytes(full)
        self._full_valid_array = np.frombuffer(self._full_valid, dtype=np.uint8)
        # the fixed 12 header bytes as one opaque item, for a vectorised check
        self._head_dtype = np.dtype((np.void, len(self._prefix)))
        self._head = np.frombuffer(self._prefix, dtype=self._head_dtype)[0]
        # (version, fingerprint) -> the writer's RecordLayout, or the error to raise
        self._known: dict[tuple[int, int], RecordLayout | SchemaVersionError] = {
            (schema.version, schema.fingerprint): self.record
        }

    def learn(self, version: int, fingerprint: int, document: bytes | str | None) -> None:
        """Record what the registry says about a foreign schema version."""
        key = (version, fingerprint)
        me = self.schema
        where = f"schema registry key {self.layout.schema_key(me.entity, version)!r}"
        if document is None:
            self._known[key] = SchemaVersionError(
                f"a value of {me.entity!r} was written with schema version {version}, which is "
                f"not published ({where} is missing) and this client knows version {me.version}: "
                "refusing to read it; publish the writer's schema (FeatureWriter.publish_schemas)"
            )
            return
        try:
            other = FeatureSchema.from_json(document)
        except SchemaError as exc:
            self._known[key] = SchemaVersionError(f"{where} is unreadable: {exc}")
            return
        if other.fingerprint != fingerprint or other.version != version:
            self._known[key] = SchemaVersionError(
                f"a value of {me.entity!r} claims schema version {version} with fingerprint "
                f"{fingerprint:#010x} but {where} holds fingerprint {other.fingerprint:#010x}: "
                "two different schemas were deployed under one version; bump the version"
            )
        elif me.is_prefix_of(other) or other.is_prefix_of(me):
            self._known[key] = RecordLayout(other)
        else:
            self._known[key] = SchemaVersionError(
                f"a value of {me.entity!r} was written with schema version {version} "
                f"({', '.join(other.names)}), which is not an append-only evolution of this "
                f"client's version {me.version} ({', '.join(me.names)}): refusing to misread it"
            )

    def decode(
        self, raws: Sequence[bytes | None], ids: Sequence[Any], now_us: int | None = None
    ) -> Decoded:
        """Decode the values fetched for ``ids`` (None where the key is absent), each
        scheduled value as in force at ``now_us`` (None: as written).

        A value that is not in the edgefeed format is listed in ``Decoded.corrupt``
        (that id reads as missing), never raised: one bad value must not fail a call.

        Raises:
            SchemaVersionError: a value's schema version cannot be read safely.
        """
        record = self.record
        size = record.itemsize
        if len(raws) > 8:
            bulk = self._decode_bulk(raws, size, now_us)
            if bulk is not None:
                return bulk
        prefix = self._prefix
        full = self._full_valid
        scheduled = record.slots > 0
        parts: list[bytes] = []
        rows: list[int] = []
        odd: list[int] = []
        all_valid = True
        for index, raw in enumerate(raws):
            if raw is None:
                continue
            # the 12 header bytes before the position are fixed for a value of our version
            if len(raw) == size and raw.startswith(prefix):
                if scheduled:
                    raw = record.in_force_bytes(raw, now_us)
                parts.append(raw)
                rows.append(index)
                if all_valid and not raw.endswith(full):
                    all_valid = False
            else:
                odd.append(index)
        if not odd:
            if not parts:
                return Decoded(self._empty, np.zeros(0, dtype=np.intp))
            buffer = parts[0] if len(parts) == 1 else b"".join(parts)
            records = np.frombuffer(buffer, dtype=record.compact)
            return Decoded(
                records,
                np.arange(len(rows), dtype=np.intp)
                if len(rows) == len(raws)
                else np.asarray(rows, dtype=np.intp),
                all_valid=all_valid,
                complete=len(rows) == len(raws),
            )
        records = np.frombuffer(b"".join(parts), dtype=record.compact) if parts else self._empty
        return self._decode_odd(raws, ids, records, rows, odd, now_us)

    def _decode_bulk(
        self, raws: Sequence[bytes | None], size: int, now_us: int | None
    ) -> Decoded | None:
        """Many values, all of our version: checked and decoded with NumPy, no per-value
        Python. None when anything is unusual (the per-value path handles it)."""
        if None in raws:
            rows = [i for i, raw in enumerate(raws) if raw is not None]
            if not rows:
                return None
            present: Sequence[bytes] = [raws[i] for i in rows]  # type: ignore[misc]
        else:
            rows = []
            present = raws  # type: ignore[assignment]
        if set(map(len, present)) != {size}:
            return None
        buffer = b"".join(present)
        count = len(present)
        heads = np.ndarray((count,), self._head_dtype, buffer, 0, (size,))
        if not (heads == self._head).all():
            return None
        records = self.record.in_force(buffer, count, now_us)
        all_valid = bool((records["valid"] == self._full_valid_array).all())
        if rows:
            return Decoded(records, np.asarray(rows, dtype=np.intp), all_valid=all_valid)
        return Decoded(
            records, np.arange(len(raws), dtype=np.intp), all_valid=all_valid, complete=True
        )

    def _decode_odd(
        self,
        raws: Sequence[bytes | None],
        ids: Sequence[Any],
        records: np.ndarray[Any, Any],
        rows: list[int],
        odd: list[int],
        now_us: int | None,
    ) -> Decoded:
        me = self.schema
        extra: list[bytes] = []
        deleted: list[int] = []
        corrupt: list[tuple[int, str]] = []
        needs: set[tuple[int, int]] = set()
        for index in odd:
            raw = raws[index]
            if raw is None:  # odd holds only present values; this narrows the type
                continue
            key = self.layout.key(me.entity, ids[index])
            if len(raw) < HEADER_SIZE:
                corrupt.append(
                    (index, f"value at {key!r} is {len(raw)} bytes, not an edgefeed value")
                )
                continue
            magic, fmt, flags, version, n_features, fingerprint = _HEADER.unpack_from(raw)
            if magic != MAGIC or fmt != FORMAT_VERSION:
                corrupt.append(
                    (
                        index,
                        f"value at {key!r} is not an edgefeed value (magic {magic!r}, format "
                        f"{fmt}); is another application writing under this key namespace?",
                    )
                )
                continue
            if flags & FLAG_TOMBSTONE:
                deleted.append(index)
                continue
            known = self._known.get((version, fingerprint))
            if known is None:
                if version == me.version:
                    raise SchemaVersionError(
                        f"value at {key!r} claims schema version {version} of {me.entity!r} with "
                        f"fingerprint {fingerprint:#010x}, but this client's version {version} has "
                        f"fingerprint {me.fingerprint:#010x}: two different schemas share one "
                        "version; bump the version when features change"
                    )
                needs.add((version, fingerprint))
                continue
            if isinstance(known, SchemaVersionError):
                raise known
            if len(raw) != known.itemsize or n_features != len(known.schema.features):
                corrupt.append(
                    (
                        index,
                        f"value at {key!r} is {len(raw)} bytes with {n_features} features; "
                        f"schema version {version} of {me.entity!r} needs {known.itemsize} "
                        f"bytes with {len(known.schema.features)}",
                    )
                )
                continue
            extra.append(self._translate(raw, known, now_us))
            rows.append(index)
        if needs:
            return Decoded(self._empty, np.zeros(0, dtype=np.intp), (), frozenset(needs))
        if extra:
            more = np.frombuffer(b"".join(extra), dtype=self.record.compact)
            records = np.concatenate([records, more]) if len(records) else more
        return Decoded(
            records, np.asarray(rows, dtype=np.intp), tuple(deleted), corrupt=tuple(corrupt)
        )

    def _translate(self, raw: bytes, writer: RecordLayout, now_us: int | None) -> bytes:
        """A value of a compatible version as a ``compact`` record of the reader's layout,
        with the writer's vector in force at ``now_us`` (None: the one written; for a
        reader without slots, an older deployment that passes no read time: now)."""
        mine = self.record
        me = self.schema
        header = (
            _HEADER.pack(
                MAGIC, FORMAT_VERSION, mine.flags, me.version, len(me.features), me.fingerprint
            )
            + raw[POSITION_OFFSET:HEADER_SIZE]
        )
        if now_us is None and not mine.slots:
            now_us = time.time_ns() // 1000
        return header + self._body(writer.body_at(raw, now_us), writer)

    def _body(self, body: bytes, writer: RecordLayout) -> bytes:
        """One body (values and bitmap) of ``writer``'s layout in the reader's."""
        mine = self.record
        me = self.schema
        their_valid = body[writer.payload_size : writer.body_size]
        if mine.payload_size <= writer.payload_size:  # writer is newer: keep the prefix
            payload = body[: mine.payload_size]
            valid = bytearray(their_valid[: mine.valid_size])
            spare = mine.valid_size * 8 - len(me.features)
            if spare and valid:
                valid[-1] &= 0xFF >> spare
        else:  # writer is older: the features it did not have are missing
            payload = body[: writer.payload_size]
            payload += bytes(mine.payload_size - writer.payload_size)
            valid = bytearray(their_valid) + bytearray(mine.valid_size - writer.valid_size)
        return payload + bytes(valid)
