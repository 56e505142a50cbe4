"""The router's logic: which regions, and which entities, each change goes to.

Data residency: a change of a table with a ``home_region_column`` (personal
data) goes only to one home region; a change of any other table (shared data:
items, prices) goes to every region. One message per (entity, id) is produced,
keyed ``entity:id``, so each regional partition owns whole entities.

The home region of a *homed* entity (one whose own table is personal: a user) is
an attribute of the entity, kept in the router's book (pipeline.homes) from its
own row; the entity's other personal rows (events) are routed by it, and count
for the entity only while the region they name agrees (docs/pipeline.md,
"Residency"). Entities without a personal own table (items) take each personal
row in the region that row names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from connectors.settings import TableSettings
from pipeline.envelope import Change
from pipeline.exceptions import PoisonEventError
from pipeline.homes import Home, HomeBook, Position
from pipeline.messages import RegionalChange, check_entity_id
from pipeline.settings import EntitySettings

__all__ = ["HELD_ROWS", "RegionMessage", "Router", "row_key"]


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


HELD_ROWS = 1000  # rows per entity the router keeps that named another region than its home


@dataclass(frozen=True, slots=True)
class _Feed:
    entity: str
    id_column: str
    own: bool  # the entity's own table: its id is the table's key
    homed: bool  # the entity's home is its own row's (kept in the book)


class Router:
    """Routes decoded changes to regional messages.

    Args:
        entities: The declared entity types.
        tables: The captured tables (from the sources), by ``schema.table``.
        regions: Region names.
        homes: The book of entity homes (a fresh, unpersisted one if None).
    """

    def __init__(
        self,
        entities: Iterable[EntitySettings],
        tables: Mapping[str, TableSettings],
        regions: Sequence[str],
        homes: HomeBook | None = None,
    ) -> None:
        self.tables = dict(tables)
        self.regions = tuple(regions)
        self.homes = homes if homes is not None else HomeBook()
        # Entity key -> pk -> (region, change): the newest version of each personal
        # row that named another region than its entity's home, so it counted
        # nowhere. Should the entity move to that region, the row counts there:
        # it is sent then (the Debezium topics are not ordered with one another, so
        # an event written after a move may be read before it). In memory only, and
        # at most HELD_ROWS rows per entity.
        self.held: dict[str, dict[str, tuple[str, RegionalChange]]] = {}
        self.feeds: dict[str, list[_Feed]] = {}
        entities = list(entities)
        # Entities whose own table is personal: their home is their own row's.
        homed = {
            entity.name
            for entity in entities
            for table, id_column in entity.tables.items()
            if self.tables[table].key == [id_column]
            and self.tables[table].home_region_column is not None
        }
        self.home_tables = sorted(
            table
            for entity in entities
            for table, id_column in entity.tables.items()
            if entity.name in homed and self.tables[table].key == [id_column]
        )
        for entity in entities:
            for table, id_column in entity.tables.items():
                declared = self.tables[table]
                own = declared.key == [id_column]
                personal = declared.home_region_column is not None
                feed = _Feed(entity.name, id_column, own, entity.name in homed and personal)
                self.feeds.setdefault(table, []).append(feed)

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

        What it records in the book of homes, :meth:`HomeBook.rollback` undoes (a
        change that fails here, or later, is dead-lettered and decides nothing).

        Raises:
            PoisonEventError: the row lacks a key or home region, or names an unknown region.
        """
        self.homes.begin()
        try:
            return self._route(change)
        except BaseException:
            self.homes.rollback()
            raise

    def dead_letter_region(self, change: Change) -> str | None:
        """The one region a dead-lettered personal row may go to, or None.

        For an entity whose home the book holds (a user's), that home, whatever
        region the row names: a forged or corrupt row naming another region must
        not carry the user's data there. Else the region the row names, if it is
        a known region. None when that leaves no single known region (the row
        names none or an unknown one, or its entities live apart): the caller
        then keeps only a pointer to the source record.
        """
        table = self.tables.get(change.table)
        column = None if table is None else table.home_region_column
        if column is None:
            return None
        regions: set[str] = set()
        for row in (change.after, change.before):
            named = row.get(column) if isinstance(row, Mapping) else None
            if isinstance(named, str) and named in self.regions:
                regions.add(named)
        row = change.before if change.op == "d" else change.after
        homes: set[str] = set()
        for feed in self.feeds.get(change.table, []) if isinstance(row, Mapping) else []:
            entity_id = row.get(feed.id_column) if isinstance(row, Mapping) else None
            if not feed.homed or entity_id is None:
                continue
            known = self.homes.get(f"{feed.entity}:{entity_id}")
            if known is not None and known.region is not None:
                homes.add(known.region)
        candidates = homes or regions
        return next(iter(candidates)) if len(candidates) == 1 else None

    def _route(self, change: Change) -> list[RegionMessage]:
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
        tagged = before_tagged = ""
        if column is not None:
            # The region the row names, and the one its old version named (if other).
            tagged = self._home(table, column, row, "new" if change.after is not None else "old")
            before_tagged = tagged
            if change.op == "u" and change.before is not None:
                before_home = change.before.get(column)
                if before_home is not None and before_home != tagged:
                    before_tagged = self._home(table, column, change.before, "old")
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
            if column is None:  # shared data: every region
                messages.extend(RegionMessage(region, body) for region in self.regions)
            elif feed.homed and feed.own:
                messages.extend(self._route_own_row(body, tagged, before_tagged))
            elif feed.homed:
                messages.extend(self._route_personal_row(body, tagged, before_tagged))
            else:
                # An entity that is not itself personal (an item) takes each personal
                # row in the region the row names.
                messages.append(RegionMessage(tagged, body))
                if before_tagged != tagged:  # the row moved: its old region forgets it
                    messages.append(RegionMessage(before_tagged, _removal(body, "d")))
        return messages

    def _route_own_row(
        self, body: RegionalChange, tagged: str, before_tagged: str
    ) -> list[RegionMessage]:
        """A homed entity's own row (a user's): it sets the entity's home."""
        key = f"{body.entity}:{body.entity_id}"
        position = body.position
        known = self.homes.get(key)
        if known is not None and known.region is not None and known.at > position:
            # Older than the row that set the home (a replay, or a late delivery):
            # it goes where the entity lives, which keeps the newer version, and
            # never moves the entity back.
            return [RegionMessage(known.region, body)]
        messages = [RegionMessage(tagged, body)]
        # Every other region that may hold the entity forgets it: the one the old
        # row named, the one the book knew (a move whose update lacks the old row),
        # and those its rows went to before its home was known (as of the newest
        # position sent there, so none of those rows survive the removal).
        forget: dict[str, Position] = {}
        if before_tagged != tagged:
            forget[before_tagged] = position
        if known is not None:
            if known.region is not None and known.region != tagged:
                forget[known.region] = position
            for region, at in known.provisional.items():
                if region != tagged:
                    forget[region] = max(at, forget.get(region, position))
        for region, at in forget.items():
            messages.append(RegionMessage(region, _removal(body, "x", at)))
        moved = known is None or known.region != tagged
        held = self.held.pop(key, None) if moved else None
        if held and body.op != "x":
            # The entity's rows that name its (new) home count there now.
            messages.extend(
                RegionMessage(tagged, row) for region, row in held.values() if region == tagged
            )
        if known is None or known.region != tagged or known.provisional:
            self.homes.put(key, Home(tagged, position))
        return messages

    def _route_personal_row(
        self, body: RegionalChange, tagged: str, before_tagged: str
    ) -> list[RegionMessage]:
        """Another personal row (an event) of a homed entity: routed by the entity's home."""
        key = f"{body.entity}:{body.entity_id}"
        known = self.homes.get(key)
        if known is None or known.region is None:
            # The entity's own row is not known yet (its topic is behind, or it has
            # none): the row's own region, remembered so that region forgets the
            # entity once its home is known elsewhere.
            home = known if known is not None else Home(None)
            messages = [RegionMessage(tagged, body)]
            regions = [tagged]
            if before_tagged != tagged:
                messages.append(RegionMessage(before_tagged, _removal(body, "d")))
                regions.append(before_tagged)
            for region in regions:
                home.provisional[region] = max(body.position, home.provisional.get(region, (0, 0)))
            self.homes.put(key, home)
            return messages
        held = self.held.get(key)
        if held is not None and held.pop(body.pk, None) is not None and not held:
            del self.held[key]
        if body.op == "d" or tagged == known.region:
            return [RegionMessage(known.region, body)]
        # The row names another region than its entity's home (an old event of a
        # user who moved, or a row re-tagged alone): it does not count for the
        # entity, and its data goes nowhere; the home drops any version it held.
        rows = self.held.setdefault(key, {})
        if len(rows) < HELD_ROWS and _encodable(body):
            rows[body.pk] = (tagged, body)
        return [RegionMessage(known.region, _removal(body, "d"))]


def _encodable(body: RegionalChange) -> bool:
    try:
        body.encode()
    except PoisonEventError:
        return False  # dead-lettered by the router; never sent later either
    return True


def _removal(body: RegionalChange, op: Any, at: Position | None = None) -> RegionalChange:
    """The removal of ``body``'s row (``d``) or whole entity (``x``), without row data."""
    lsn, seq = at if at is not None else body.position
    return RegionalChange(
        table=body.table,
        op=op,
        lsn=lsn,
        seq=seq,
        commit_ms=body.commit_ms,
        entity=body.entity,
        entity_id=body.entity_id,
        pk=body.pk,
    )
