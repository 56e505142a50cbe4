"""How a regional worker's entity states sit in its Faust table (and changelog).

One record per entity and one per chunk of its rows (rows whose event times fall
in the same CHUNK_MS span), so that a checkpoint writes what changed (the entity
record and, mostly, its newest chunk) and never a hot entity's thousands of rows
again:

- ``entity:id`` -> the entity's position and bookkeeping (``lsn``, ``rev``,
  ``ts``, ``gone``, ``marks``), without its rows;
- ``entity:id<US>table<US>chunk`` -> ``{pk: row entry}`` (``<US>`` is ``\\x1f``);
- ``<US>checkpoint<US>partition`` -> when the partition's last checkpoint ended;
- ``<US>fence<US>partition`` -> ``{"epoch": n}``: a new owner of the partition.

The worker keeps its working states in memory (EntityState objects) and writes
them here at checkpoints; after a recovery it rebuilds them from here.

**Owner epochs (the rebalance race).** A worker that stalls past its session
timeout is put out of the group and its partitions go to another worker, which
recovers their states from the changelog and goes on. The old owner, once it
runs again, may still finish a checkpoint (or the checkpoint Faust's revoke
signal asks for): its records land after the new owner's, and the next
recovery would take the old owner's states, older than what the cache holds.
Each owner therefore writes under an epoch, one more than any epoch its
recovery read on that partition, sent as the ``edgefeed-epoch`` header of every
record, and opens its ownership with a fence record; a recovery ignores the
records of a partition whose epoch is below the highest it has read there
(:class:`ChangelogFence`). What the old owner had processed is not lost: its
offsets were never committed (its commit fails once it is out of the group),
so the new owner processes those messages again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, MutableMapping
from typing import Any

from pipeline.features import CHUNK_MS, EntityState, chunk_of
from pipeline.rows import T as _T

__all__ = [
    "EPOCH_HEADER",
    "ROW_SEP",
    "ChangelogFence",
    "checkpoint_key",
    "fence_key",
    "rebuild_states",
    "state_from_records",
    "state_from_tables",
    "store_state",
]

ROW_SEP = "\x1f"
EPOCH_HEADER = "edgefeed-epoch"  # the owner epoch a changelog record was written under


def checkpoint_key(partition: int) -> str:
    """The key of the record that closes a checkpoint on a changelog partition."""
    return f"{ROW_SEP}checkpoint{ROW_SEP}{partition}"


def fence_key(partition: int) -> str:
    """The key of the record that opens an owner's epoch on a changelog partition."""
    return f"{ROW_SEP}fence{ROW_SEP}{partition}"


class ChangelogFence:
    """Which changelog records a recovery keeps: per partition, those written under
    the highest owner epoch read so far (records without an epoch, written before
    epochs existed, are kept)."""

    def __init__(self) -> None:
        self.top: dict[int, int] = {}

    def admit(self, partition: int, epoch: int | None) -> bool:
        """Whether a record of ``partition`` written under ``epoch`` counts (read in
        the partition's order)."""
        if epoch is None:
            return True
        top = self.top.get(partition, 0)
        if epoch < top:
            return False  # an earlier owner's record, written after a newer owner began
        self.top[partition] = epoch
        return True

    def keep(self, partitions: Iterable[int]) -> None:
        """Forget the partitions a recovery left this worker without: their records
        are dropped from the table too, and read again from the start if they return."""
        kept = set(partitions)
        for partition in [p for p in self.top if p not in kept]:
            del self.top[partition]

    def next_epoch(self, partition: int) -> int:
        """The epoch a new owner of ``partition`` writes under (and records as read)."""
        epoch = self.top.get(partition, 0) + 1
        self.top[partition] = epoch
        return epoch


def store_state(table: MutableMapping[str, Any], key: str, state: EntityState) -> int:
    """Write the entity record and the row chunks changed since the last call; returns
    the number of records written."""
    table[key] = {k: v for k, v in state.items() if k != "rows"}
    written = 1
    rows = state["rows"]
    for name, chunk in state.take_changes():
        chunk_key = f"{key}{ROW_SEP}{name}{ROW_SEP}{chunk}"
        low, high = chunk * CHUNK_MS, (chunk + 1) * CHUNK_MS
        entries = {pk: e for pk, e in rows.get(name, {}).items() if low <= e[_T] < high}
        if entries:
            table[chunk_key] = entries
            written += 1
        elif chunk_key in table:
            del table[chunk_key]
            written += 1
    return written


def rebuild_states(
    records: Iterable[tuple[str, Any]], owned: Callable[[str], bool]
) -> dict[str, EntityState]:
    """The working states from the table's records, for the entities ``owned`` says
    are this worker's (by entity key)."""
    entity_records: dict[str, Any] = {}
    rows_of: dict[str, list[tuple[str, str, list[Any]]]] = {}
    for stored_key, value in records:
        key, sep, rest = stored_key.partition(ROW_SEP)
        if not key or not owned(key):  # not an entity's: a checkpoint's closing record
            continue
        if sep:
            name, _, _chunk = rest.partition(ROW_SEP)
            rows_of.setdefault(key, []).extend((name, pk, e) for pk, e in value.items())
            continue
        entity_records[key] = value
    states: dict[str, EntityState] = {}
    for key in [*entity_records, *(k for k in rows_of if k not in entity_records)]:
        state = state_from_records(entity_records.get(key), rows_of.get(key, ()))
        if state is not None:
            states[key] = state
    return states


def state_from_records(
    record: Any, rows: Iterable[tuple[str, str, list[Any]]]
) -> EntityState | None:
    """One entity's working state from its entity record (None: missing) and its
    rows as ``(table, pk, entry)`` from its chunk records; None when it has neither."""
    tables: dict[str, dict[str, list[Any]]] = {}
    for name, pk, entry in rows:
        tables.setdefault(name, {})[pk] = entry
    return state_from_tables(record, tables)


def state_from_tables(record: Any, tables: dict[str, dict[str, list[Any]]]) -> EntityState | None:
    """:func:`state_from_records` with the chunk records' rows merged per table
    (table -> pk -> entry: what the local store reads back); ``tables`` is taken."""
    if record is not None:
        state = EntityState(record)
        # A state written whole (rows included, before per-row records): its rows go
        # out as row records at the next checkpoint.
        found = state["rows"] = {t: dict(r) for t, r in (state.get("rows") or {}).items()}
        if found:
            state.changed.update((t, chunk_of(e[_T])) for t, r in found.items() for e in r.values())
            for name, entries in tables.items():
                found.setdefault(name, {}).update(entries)
        else:
            state["rows"] = tables
    elif any(tables.values()):  # rows without their entity record: a cut-short checkpoint
        top = max(int(entry[0]) for entries in tables.values() for entry in entries.values())
        state = EntityState(rows=tables, lsn=top, rev=0, ts=0, gone=None)
    else:
        return None
    return state
