"""The router's logic: which regions, and which entities, each change goes to.

Data residency: a change of a table with a ``home_region_column`` (personal
data) goes only to the row's home region; a change of any other table (shared
data: items, prices) goes to every region. One message per (entity, id) is
produced, keyed ``entity:id``, so each regional partition owns whole entities.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from connectors.settings import TableSettings
from pipeline.envelope import Change
from pipeline.exceptions import PoisonEventError
from pipeline.messages import RegionalChange, check_entity_id
from pipeline.settings import EntitySettings

__all__ = ["RegionMessage", "Router", "row_key"]


@dataclass(frozen=True, slots=True)
class RegionMessage:
    """One change for one region's change topic.

    Attributes:
        region: Target region.
        change: The change (pipeline.messages: the wire contract).
    """

    region: str
    change: RegionalChange

    @property
    def key(self) -> str | None:
        """``entity:id``, or None for a truncate (sent to every partition)."""
        return self.change.key

    @property
    def value(self) -> dict[str, Any]:
        """The change as it goes on the wire."""
        return self.change.to_wire()


def row_key(row: Mapping[str, Any], columns: Sequence[str], table: str) -> str:
    """The row's key columns joined by ``|``.

    Raises:
        PoisonEventError: a key column is missing or null.
    """
    parts = []
    for column in columns:
        value = row.get(column)
        if value is None:
            raise PoisonEventError(
                "missing-key", f"{table}: key column {column!r} is missing or null in the row"
            )
        parts.append(str(value))
    return "|".join(parts)


@dataclass(frozen=True, slots=True)
class _Feed:
    entity: str
    id_column: str
    own: bool  # the entity's own table: its id is the table's key


class Router:
    """Routes decoded changes to regional messages.

    Args:
        entities: The declared entity types.
        tables: The captured tables (from the sources), by ``schema.table``.
        regions: Region names.
    """

    def __init__(
        self,
        entities: Iterable[EntitySettings],
        tables: Mapping[str, TableSettings],
        regions: Sequence[str],
    ) -> None:
        self.tables = dict(tables)
        self.regions = tuple(regions)
        self.feeds: dict[str, list[_Feed]] = {}
        for entity in entities:
            for table, id_column in entity.tables.items():
                declared = self.tables[table]
                own = declared.key == [id_column]
                self.feeds.setdefault(table, []).append(_Feed(entity.name, id_column, own))

    def routes(self, table: str) -> bool:
        """True if changes of ``table`` feed some entity (others are ignored)."""
        return table in self.feeds

    def _home(
        self, table: TableSettings, column: str, row: Mapping[str, Any] | None, what: str
    ) -> str:
        value = None if row is None else row.get(column)
        if value is None or value == "":
            # A delete under the default replica identity carries only the key; Debezium
            # fills the other columns of its old row with empty values.
            raise PoisonEventError(
                "missing-home-region",
                f"{table.name}: the {what} row has no {column!r} (its home region); for "
                f"updates and deletes set replica_identity: full on {table.name}",
            )
        if value not in self.regions:
            raise PoisonEventError(
                "unknown-region",
                f"{table.name}: home region {value!r} not in regions: {', '.join(self.regions)}",
            )
        return str(value)

    def route(self, change: Change) -> list[RegionMessage]:
        """The regional messages for one change (empty for tables nobody reads).

        Raises:
            PoisonEventError: the row lacks a key or home region, or names an unknown region.
        """
        feeds = self.feeds.get(change.table)
        if feeds is None:
            return []
        table = self.tables[change.table]
        if change.op == "t":
            truncate = RegionalChange(change.table, "t", change.lsn, change.seq, change.commit_ms)
            return [RegionMessage(region, truncate) for region in self.regions]
        row = change.row
        if row is None:
            raise PoisonEventError("undecodable", f"{change.table}: op {change.op!r} without a row")
        pk = row_key(row, table.key, change.table)
        column = table.home_region_column
        personal = column is not None
        if column is not None:
            home = self._home(table, column, row, "new" if change.after is not None else "old")
            old_home = home
            if change.op == "u" and change.before is not None:
                before_home = change.before.get(column)
                if before_home is not None and before_home != home:
                    old_home = self._home(table, column, change.before, "old")
            targets = [home]
        else:
            home = old_home = ""
            targets = list(self.regions)
        messages: list[RegionMessage] = []
        for feed in feeds:
            source_row = change.before if change.op == "d" else change.after
            entity_id = (source_row or {}).get(feed.id_column)
            if entity_id is None:
                raise PoisonEventError(
                    "missing-key",
                    f"{change.table}: column {feed.id_column!r} (the {feed.entity} id) is "
                    f"missing or null; for deletes set replica_identity: full on {change.table}",
                )
            # Deleting the entity's own row (a user) removes the whole entity.
            op: Any = "x" if change.op == "d" and feed.own else change.op
            body = RegionalChange(
                table=change.table,
                op=op,
                lsn=change.lsn,
                seq=change.seq,
                commit_ms=change.commit_ms,
                entity=feed.entity,
                entity_id=check_entity_id(entity_id),
                pk=pk,
                row=change.after if change.op != "d" else None,
            )
            for region in targets:
                messages.append(RegionMessage(region, body))
            if personal and old_home != home:
                # The entity moved: its old region must forget it (the row, or the
                # whole entity when this is the entity's own row).
                evict = RegionalChange(
                    table=change.table,
                    op="x" if feed.own else "d",
                    lsn=change.lsn,
                    seq=change.seq,
                    commit_ms=change.commit_ms,
                    entity=feed.entity,
                    entity_id=body.entity_id,
                    pk=pk,
                )
                messages.append(RegionMessage(old_home, evict))
        return messages
