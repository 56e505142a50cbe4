"""The router's book of entity homes: residency as an attribute of the entity.

A personal entity (a user) has one home region, the one its own row names (the
``home_region_column`` of the entity's own table). The router records it here,
and routes the entity's other personal rows (its events) by it, not by the
region each of those rows names: a later change to an old events row that
still says ``eu-west`` cannot bring a user who moved to ``us-east`` back into
``eu-west``, and a move is noticed even when the update carries no old row.

The book is a mapping ``entity:id`` -> a small record, kept by the router app in
a Faust table (changelog topic ``<router group>-homes-changelog``), so a
restarted router knows every home it learnt. The record holds no row data:

- ``region``: the home region, or None while only rows of other tables were
  seen (the entity's own row not yet);
- ``at``: the source position ``[lsn, seq]`` of the own row that set it (an
  older own row, a replay, never moves the entity back);
- ``provisional``: region -> the newest position of the rows sent there
  before the home was known (routed by their own region); once the home is
  learnt, those regions are told to forget the entity as of that position.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Home", "HomeBook", "Position"]

Position = tuple[int, int]  # (lsn, seq): a source position


@dataclass(slots=True)
class Home:
    """What the router knows of one entity's home."""

    region: str | None
    at: Position = (0, 0)
    provisional: dict[str, Position] = field(default_factory=dict)

    def to_record(self) -> dict[str, Any]:
        """The record as the changelog stores it (JSON)."""
        return {
            "region": self.region,
            "at": list(self.at),
            "provisional": {region: list(at) for region, at in self.provisional.items()},
        }

    @classmethod
    def from_record(cls, record: Any) -> Home:
        """The home from its changelog record."""
        at = record.get("at") or (0, 0)
        provisional = record.get("provisional") or {}
        return cls(
            region=record.get("region"),
            at=(int(at[0]), int(at[1])),
            provisional={region: (int(p[0]), int(p[1])) for region, p in provisional.items()},
        )


class HomeBook:
    """Entity key -> :class:`Home`, over a mapping that persists the records.

    Changes are held back until :meth:`flush`: the router writes them to the
    changelog only once the regional messages they decided (an eviction) are
    delivered, so a router that dies in between routes the change again, with
    the old home, and sends the eviction again.

    Args:
        records: Where the records live: a dict in tests and in a recomputation,
            the router's Faust table (through a changelog writer) in the app.
    """

    def __init__(self, records: MutableMapping[str, Any] | None = None) -> None:
        self.records: MutableMapping[str, Any] = records if records is not None else {}
        self.pending: dict[str, dict[str, Any]] = {}
        self._undo: list[tuple[str, dict[str, Any] | None]] = []  # since begin()

    def get(self, key: str) -> Home | None:
        """The entity's home, if the router has seen any of its personal rows."""
        record = self.pending.get(key)
        if record is None:
            record = self.records.get(key)
        return None if record is None else Home.from_record(record)

    def begin(self) -> None:
        """Start routing one change: :meth:`rollback` undoes what it records."""
        self._undo.clear()

    def rollback(self) -> None:
        """Undo the records of the change being routed (it was dead-lettered: the
        moves it decided were never sent)."""
        for key, before in reversed(self._undo):
            if before is None:
                self.pending.pop(key, None)
            else:
                self.pending[key] = before
        self._undo.clear()

    def put(self, key: str, home: Home) -> None:
        """Record the entity's home (kept until :meth:`flush`)."""
        self._undo.append((key, self.pending.get(key)))
        self.pending[key] = home.to_record()

    def flush(self) -> int:
        """Write the held-back records; returns how many."""
        pending, self.pending = self.pending, {}
        for key, record in pending.items():
            self.records[key] = record
        return len(pending)
