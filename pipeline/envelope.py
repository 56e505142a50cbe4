"""Decoding Debezium change events (JSON, with or without an embedded schema)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeline.exceptions import PoisonEventError
from pipeline.messages import MAX_TIME_MS

__all__ = ["Change", "Op", "decode_change"]

Op = Literal["c", "u", "d", "r", "t"]
_U32 = 2**32 - 1


class _Source(BaseModel):
    model_config = ConfigDict(extra="ignore")

    ts_ms: int = Field(ge=0, le=MAX_TIME_MS)
    schema_: str = ""
    table: str = ""
    lsn: int | None = Field(default=None, ge=0, le=2**63 - 1)
    snapshot: str | bool | None = None

    def __init__(self, **data: Any) -> None:
        if "schema" in data:
            data["schema_"] = data.pop("schema")
        super().__init__(**data)


class _Envelope(BaseModel):
    model_config = ConfigDict(extra="ignore")

    op: Op
    before: dict[str, Any] | None = None
    after: dict[str, Any] | None = None
    source: _Source


@dataclass(frozen=True, slots=True)
class Change:
    """One row change, decoded from a Debezium envelope.

    Attributes:
        table: ``schema.table``.
        op: c (insert), u (update), d (delete), r (snapshot read), t (truncate).
        before: The old row (updates need REPLICA IDENTITY FULL for all columns).
        after: The new row (None for deletes and truncates).
        lsn: The change's position in PostgreSQL's WAL.
        seq: Order among changes that share an LSN (snapshot rows).
        commit_ms: The source commit time, milliseconds since the epoch.
        snapshot: Debezium's ``source.snapshot`` for snapshot reads: ``"incremental"``
            for a row of an ad-hoc incremental snapshot (``edgefeed connectors
            snapshot``), ``"true"``/``"first"``/``"last"`` for the initial
            snapshot; None for streamed changes.
    """

    table: str
    op: Op
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    lsn: int
    seq: int
    commit_ms: int
    snapshot: str | None = None

    @property
    def row(self) -> dict[str, Any] | None:
        """The row as it is now (after), or as it was for deletes (before)."""
        return self.after if self.after is not None else self.before


def decode_change(value: bytes, *, offset: int = 0) -> Change | None:
    """Decode one Debezium message value.

    Args:
        value: The Kafka message value (JSON; an embedded schema is accepted).
        offset: The message's offset, used to order snapshot rows (which share an LSN).

    Returns:
        The change, or None for a tombstone (an empty value after a delete).

    Raises:
        PoisonEventError: the value is not a Debezium change event.
    """
    if not value:
        return None
    try:
        data = pydantic_core.from_json(value)
    except ValueError as exc:
        raise PoisonEventError("undecodable", f"not JSON: {exc}") from None
    if isinstance(data, dict) and "payload" in data and "schema" in data:
        data = data["payload"]
        if data is None:
            return None
    if not isinstance(data, dict):
        raise PoisonEventError("undecodable", "not a Debezium envelope (not a JSON object)")
    try:
        envelope = _Envelope.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:5]
        )
        raise PoisonEventError("undecodable", f"not a Debezium envelope: {problems}") from None
    source = envelope.source
    if not source.table:
        raise PoisonEventError("undecodable", "Debezium envelope without source.table")
    if envelope.op in ("c", "r", "u") and envelope.after is None:
        raise PoisonEventError("undecodable", f"op {envelope.op!r} without an 'after' row")
    if envelope.op == "d" and envelope.before is None:
        raise PoisonEventError("undecodable", "delete without a 'before' row")
    snapshot = envelope.op == "r" or source.snapshot in (True, "true", "last", "first")
    return Change(
        table=f"{source.schema_ or 'public'}.{source.table}",
        op=envelope.op,
        before=envelope.before,
        after=envelope.after,
        lsn=source.lsn or 0,
        seq=(offset & _U32) if snapshot else 0,
        commit_ms=source.ts_ms,
        snapshot=_snapshot_kind(source.snapshot),
    )


def _snapshot_kind(value: str | bool | None) -> str | None:
    """``source.snapshot`` as one string, None when the change was streamed."""
    if value is None or value is False or value == "false":
        return None
    return "true" if value is True else str(value)
