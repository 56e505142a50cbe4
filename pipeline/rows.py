"""The row entry: how one source row sits in an entity's state and changelog.

A row entry is a five-element list ``[lsn, seq, event_ms, deleted, values]``.
It is a list rather than an object because a state holds thousands of them and
every checkpoint sends them through orjson; this module is the one place that
knows the layout (the feature engine, the window index and the state store
import the indices from here).
"""

from __future__ import annotations

from typing import Any

__all__ = ["DEL", "LSN", "SEQ", "VALS", "RowEntry", "T", "position", "row_entry", "stamp"]

LSN, SEQ, T, DEL, VALS = range(5)
"""Indices of a row entry: source position (WAL LSN, order within it), event time in
milliseconds, 1 for a deleted row (a tombstone kept until it leaves every window),
and the row's used column values."""

RowEntry = list[Any]


def row_entry(lsn: int, seq: int, event_ms: int, deleted: bool, values: dict[str, Any]) -> RowEntry:
    """A new row entry."""
    return [lsn, seq, event_ms, 1 if deleted else 0, values]


def position(entry: RowEntry) -> tuple[int, int]:
    """The source position of the row's last change: ``(lsn, seq)``."""
    return (entry[LSN], entry[SEQ])


def stamp(entry: RowEntry) -> tuple[int, int, int]:
    """Time order of rows: ``(event_ms, lsn, seq)``."""
    return (entry[T], entry[LSN], entry[SEQ])
