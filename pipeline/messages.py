"""The regional change: the one wire contract between the router and the regional
workers, and the pack format that carries it.

The router turns each Debezium change into one :class:`RegionalChange` per
entity it feeds and region it may live in; a regional worker decodes them again
here, and nowhere else. On the wire a change is a compact JSON object (short
keys: it crosses between regions, and a region reads thousands a second)::

    {"t": "public.events", "op": "c", "lsn": 123, "seq": 0, "ts": 1764000000000,
     "e": "user", "id": 7, "pk": "1001", "row": {...}}

and a regional message (a *pack*) is a JSON array of such objects, in source
order, at most :data:`PACK_BYTES` long; a single object is accepted too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import orjson

from pipeline.exceptions import PoisonEventError

__all__ = [
    "MAX_CHANGE_BYTES",
    "PACK_BYTES",
    "ChangeOp",
    "RegionalChange",
    "decode_pack",
    "encode_packs",
]

ChangeOp = Literal["c", "u", "r", "d", "x", "t", "h"]
"""c/u/r: a row written (insert, update, snapshot read); d: a row deleted; x: the
whole entity removed (its own row deleted, or it moved to another region); t: the
table truncated (sent to every partition of every region, no entity); h: a history
rebuild of the table begins or ends (pipeline.history; every partition, no entity,
``row`` holds ``state``, ``id`` and ``entities``)."""

_OPS: frozenset[str] = frozenset(get_args(ChangeOp))
_ROW_OPS = frozenset(("c", "u", "r"))
_TABLE_OPS = frozenset(("t", "h"))  # sent to every partition, for no entity
_I64 = 2**63 - 1
MAX_TIME_MS = 253_402_300_799_999  # 9999-12-31T23:59:59.999Z: what the cache can stamp
_MAX_ID_CHARS = 512
PACK_BYTES = 256 * 1024
MAX_CHANGE_BYTES = 512 * 1024  # one change alone; brokers refuse messages over ~1 MB


def _position(data: Mapping[str, Any], name: str, high: int = _I64) -> int:
    value = data.get(name)
    if type(value) is not int or not 0 <= value <= high:
        raise PoisonEventError(
            "undecodable",
            f"change field {name!r} must be an integer from 0 to {high}, got {_shown(value)}",
        )
    return value


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_entity_id(value: Any) -> str | int:
    """An entity id as the cache keys it: a non-empty string or a 64-bit integer.

    Raises:
        PoisonEventError: anything else (a float, a bool, an object, "", a huge integer).
    """
    if type(value) is int and -_I64 - 1 <= value <= _I64:
        return value
    if type(value) is str and 0 < len(value) <= _MAX_ID_CHARS:
        return value
    raise PoisonEventError(
        "bad-id",
        f"entity id {_shown(value)} must be a non-empty string (at most {_MAX_ID_CHARS} "
        "characters) or a 64-bit integer",
    )


@dataclass(frozen=True, slots=True)
class RegionalChange:
    """One change bound for one region, for one entity (or, for ``t``, a whole table).

    Attributes:
        table: ``schema.table`` the change is from.
        op: See :data:`ChangeOp`.
        lsn: Source position (PostgreSQL WAL LSN).
        seq: Order among changes sharing an LSN (snapshot rows).
        commit_ms: Source commit time, milliseconds since the epoch.
        entity: Entity type (empty for a truncate).
        entity_id: The entity's id (None for a truncate).
        pk: The source row's key columns joined by ``|`` (empty for x and t).
        row: The new row for c/u/r, else None.
    """

    table: str
    op: ChangeOp
    lsn: int
    seq: int
    commit_ms: int
    entity: str = ""
    entity_id: str | int | None = None
    pk: str = ""
    row: dict[str, Any] | None = None

    @property
    def key(self) -> str | None:
        """``entity:id``: the Kafka key that decides the regional partition (None for a
        truncate, which goes to every partition)."""
        return None if self.op in _TABLE_OPS else f"{self.entity}:{self.entity_id}"

    @property
    def position(self) -> tuple[int, int]:
        return (self.lsn, self.seq)

    def to_wire(self) -> dict[str, Any]:
        """The JSON object sent on the regional topic."""
        body: dict[str, Any] = {
            "t": self.table,
            "op": self.op,
            "lsn": self.lsn,
            "seq": self.seq,
            "ts": self.commit_ms,
        }
        if self.op == "h":
            body["row"] = self.row
        elif self.op != "t":
            body.update(e=self.entity, id=self.entity_id, pk=self.pk, row=self.row)
        return body

    def encode(self) -> bytes:
        """The change as JSON bytes.

        Raises:
            PoisonEventError: a value JSON cannot carry (an integer over 64 bits, ...).
        """
        try:
            body = orjson.dumps(self.to_wire())
        except TypeError as exc:  # orjson.JSONEncodeError is a TypeError
            raise PoisonEventError(
                "unencodable", f"{self.table}: the change cannot be encoded as JSON: {exc}"
            ) from None
        if len(body) > MAX_CHANGE_BYTES:
            raise PoisonEventError(
                "too-large",
                f"{self.table}: the change is {len(body)} bytes, over the {MAX_CHANGE_BYTES} a "
                "regional message may carry; exclude the large columns (exclude_columns)",
            )
        return body

    @classmethod
    def from_wire(cls, data: Any) -> RegionalChange:
        """Decode (and check) one change object from a pack.

        Raises:
            PoisonEventError: not a change object, or a field of the wrong type.
        """
        if type(data) is not dict:
            raise PoisonEventError(
                "undecodable", f"a change must be a JSON object, got {_shown(data)}"
            )
        op = data.get("op")
        if op not in _OPS:
            raise PoisonEventError(
                "undecodable", f"change op {_shown(op)} is not one of {', '.join(sorted(_OPS))}"
            )
        table = data.get("t")
        if type(table) is not str or not table:
            raise PoisonEventError("undecodable", f"change table {_shown(table)} must be a name")
        lsn, seq = _position(data, "lsn"), _position(data, "seq")
        ts = _position(data, "ts", MAX_TIME_MS)
        if op == "t":
            return cls(table, op, lsn, seq, ts)
        if op == "h":
            return cls(table, op, lsn, seq, ts, row=_history_row(table, data.get("row")))
        entity = data.get("e")
        if type(entity) is not str or not entity:
            raise PoisonEventError("undecodable", f"change entity {_shown(entity)} must be a name")
        entity_id = check_entity_id(data.get("id"))
        pk = data.get("pk")
        if type(pk) is not str or (op != "x" and not pk):
            raise PoisonEventError("missing-key", f"{table}: row key {_shown(pk)} must be a string")
        row = data.get("row")
        if op in _ROW_OPS:
            if type(row) is not dict:
                raise PoisonEventError("undecodable", f"{table}: op {op!r} needs a row object")
        else:
            row = None
        return cls(table, op, lsn, seq, ts, entity, entity_id, pk, row)


def _history_row(table: str, row: Any) -> dict[str, Any]:
    """The body of a history marker: ``state`` begin|end, ``id``, ``entities``."""
    if (
        type(row) is not dict
        or row.get("state") not in ("begin", "end")
        or type(row.get("id")) is not str
        or not 0 < len(row["id"]) <= _MAX_ID_CHARS
        or type(row.get("entities")) is not list
        or not all(type(e) is str and 0 < len(e) <= _MAX_ID_CHARS for e in row["entities"])
    ):
        raise PoisonEventError(
            "undecodable",
            f"{table}: a history marker needs a row with state 'begin' or 'end', an id "
            f"and a list of entity names, got {_shown(row)}",
        )
    return {"state": row["state"], "id": row["id"], "entities": list(row["entities"])}


def encode_packs(bodies: Sequence[bytes], limit: int = PACK_BYTES) -> list[bytes]:
    """Regional messages carrying the encoded changes, in order: JSON arrays of at most
    ``limit`` bytes (one change alone may exceed it).

    The router sends one message per region and partition per batch instead of one per
    change: per-message costs (Faust's send and delivery, the broker's per-record work)
    are then paid per batch.
    """
    packs: list[bytes] = []
    current: list[bytes] = []
    size = 2
    for body in bodies:
        if current and size + len(body) + 1 > limit:
            packs.append(b"[" + b",".join(current) + b"]")
            current, size = [], 2
        current.append(body)
        size += len(body) + 1
    if current:
        packs.append(b"[" + b",".join(current) + b"]")
    return packs


def decode_pack(value: bytes) -> tuple[list[Any], bool]:
    """The change objects of one regional message, still undecoded (each is checked by
    :meth:`RegionalChange.from_wire`, so that one bad change does not cost the rest),
    and whether the message was a pack (an array) rather than a single change.

    Raises:
        PoisonEventError: the message is not JSON.
    """
    try:
        decoded = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        raise PoisonEventError("undecodable", f"regional message is not JSON: {exc}") from None
    if isinstance(decoded, list):
        return decoded, True
    return [decoded], False
