"""Feature computation: an entity's state, updated by change messages, and its vector.

The state of one entity (kept in a Faust table, so a restarted worker recovers
it from the changelog) holds the rows that feed it, each stamped with its
source position. Applying a message is idempotent and order-insensitive: a row
is replaced only by a later position, deleted rows stay as position-stamped
tombstones until they leave every window, and the vector is a pure function of
the state. Redelivered and reordered messages therefore leave the same state
and the same vector. A snapshot read (op ``r``: the initial snapshot, or an
incremental one that backfills history while streaming goes on) is an upsert
under the same position check, and a read of a row the state already holds
with the same values is a no-op, so a backfill neither loses nor double-counts.

Aggregates are incremental (pipeline.windows): each state carries, in memory
only, an index of running accumulators per window, so a vector costs the same
however many rows its windows hold.

Windows are read as of the read time: a sliding window read at t covers the
event times (t - size, t], a tumbling one the bucket holding t (up to t). A
vector therefore changes as time passes, without a new event: an inactive
user's ``views_30m`` decays to 0, ``purchases_today`` is 0 after midnight. The
worker writes each vector with its schedule (:meth:`EntityEngine.write_op`):
the vector in force at the write and the next :data:`SCHEDULE_SLOTS` vectors it
takes on, each from the read time it takes over (a row entering or leaving a
window); the lookup client picks the one in force at its read time, and the
worker writes the vector again, with the next part of its schedule, when the
schedule runs out (``until``). The values at every read time are a function of
the rows alone, so replays compute the same ones.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from types import MappingProxyType
from typing import Any, Literal, TypeVar

from connectors.settings import TableSettings
from edge_cache import Delete, Feature, FeatureSchema, Position, Schedule, Upsert
from pipeline.aggregates import Aggregate, Reader
from pipeline.exceptions import PoisonEventError
from pipeline.messages import MAX_TIME_MS, RegionalChange
from pipeline.rows import DEL as _DEL
from pipeline.rows import LSN as _LSN
from pipeline.rows import SEQ as _SEQ
from pipeline.rows import VALS as _VALS
from pipeline.rows import T as _T
from pipeline.settings import AggregateFeature, EntitySettings
from pipeline.windows import GroupSpec, TableIndex, WindowKey, WindowSpec

__all__ = [
    "CHUNK_MS",
    "SCHEDULE_SLOTS",
    "EntityEngine",
    "EntityState",
    "FeatureEngine",
    "chunk_of",
    "event_time_ms",
]

_U32 = 2**32 - 1
_S = TypeVar("_S", bound=dict[str, Any])


MAX_TEXT_CHARS = 8192  # a text value kept in a state (where filters, distinct values)
# Vectors scheduled ahead in each value of an entity type with windows: more slots
# mean fewer renewals of an inactive entity's value, and larger values.
SCHEDULE_SLOTS = 4
_F32_MAX = 3.4028234663852886e38
_INT_RANGE = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}
# The largest magnitude an aggregate's dtype holds (float64: any finite number).
_MAGNITUDE = {
    "float32": _F32_MAX,
    "float64": math.inf,
    "int32": float(_INT_RANGE["int32"][1]),
    "int64": float(_INT_RANGE["int64"][1]),
    "bool": math.inf,
}
_NON_FINITE_TEXT = frozenset(
    ("nan", "-nan", "+nan", "inf", "+inf", "-inf", "infinity", "+infinity", "-infinity")
)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}... ({len(text)} characters)"


def event_time_ms(value: Any, fallback_ms: int) -> int:
    """A Debezium time value in milliseconds since the epoch.

    ISO strings (``timestamptz`` as ZonedTimestamp), and integers in
    microseconds (``timestamp`` as MicroTimestamp), milliseconds or seconds,
    told apart by magnitude. None gives ``fallback_ms``.

    Raises:
        PoisonEventError: not a time, or outside years 1970-9999.
    """
    if value is None:
        return fallback_ms
    if isinstance(value, bool):
        raise PoisonEventError("wrong-type", f"time value {value!r} is not a time")
    if isinstance(value, int | float):
        if not math.isfinite(value):
            raise PoisonEventError("wrong-type", f"time value {value!r} is not a time")
        magnitude = abs(value)
        if magnitude >= 1e14:
            ms = int(value // 1000)
        elif magnitude >= 1e11:
            ms = int(value)
        else:
            ms = int(value * 1000)
    elif isinstance(value, str) and len(value) <= 64:
        try:
            parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            raise PoisonEventError(
                "wrong-type", f"time value {_shown(value)} is not ISO 8601"
            ) from None
        ms = int(parsed.timestamp() * 1000)
    else:
        raise PoisonEventError("wrong-type", f"time value {_shown(value)} is not a time")
    if not 0 <= ms <= MAX_TIME_MS:
        raise PoisonEventError(
            "out-of-range",
            f"time value {_shown(value)} is outside 1970-01-01..9999-12-31 "
            "(microseconds, milliseconds or seconds since the epoch, or ISO 8601)",
        )
    return ms


class NonFinite(Exception):
    """A NaN or infinite number: stored as missing (one rule for numbers and strings)."""


def _number(value: Any) -> float:
    if isinstance(value, str):
        if value.strip().lower() in _NON_FINITE_TEXT:
            raise NonFinite(value)
        if len(value) > 64:
            raise ValueError(value)
    number = float(value)
    if not math.isfinite(number):
        raise NonFinite(value)
    return number


def _coerce(value: Any, dtype: str, where: str) -> Any:
    """``value`` converted to ``dtype``, checked against its range.

    Raises:
        NonFinite: NaN or an infinity (the caller stores a missing value).
        PoisonEventError: not convertible, or out of the dtype's range.
    """
    if value is None:
        return None
    try:
        if dtype in ("float32", "float64"):
            if isinstance(value, bool):
                return float(value)
            number = _number(value)
            if dtype == "float32" and abs(number) > _F32_MAX:
                raise PoisonEventError(
                    "out-of-range", f"{where}: value {_shown(value)} is out of float32 range"
                )
            return number
        if dtype in _INT_RANGE:
            if isinstance(value, bool):
                return int(value)
            if isinstance(value, float) or (isinstance(value, str) and not value.isdigit()):
                number = _number(value)
                if not number.is_integer():
                    raise ValueError(value)
                value = int(number)
            elif isinstance(value, str) and len(value) > 64:
                raise ValueError(value)
            integer = int(value)
            low, high = _INT_RANGE[dtype]
            if not low <= integer <= high:
                raise PoisonEventError(
                    "out-of-range", f"{where}: value {_shown(value)} is out of {dtype} range"
                )
            return integer
        if dtype == "bool":
            if isinstance(value, bool):
                return value
            if value in (0, 1, "true", "false", "t", "f"):
                return value in (1, "true", "t")
            raise ValueError(value)
    except PoisonEventError:
        raise
    except (TypeError, ValueError, OverflowError):
        pass
    raise PoisonEventError("wrong-type", f"{where}: value {_shown(value)} is not a valid {dtype}")


def _plain(value: Any, where: str) -> Any:
    """A value of a column kept as it comes (where filters, distinct values): a bounded
    string, a 64-bit integer, a finite number, a bool or null.

    Raises:
        NonFinite: NaN or an infinity.
        PoisonEventError: anything else (objects, lists, huge numbers, long text).
    """
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        if len(value) > MAX_TEXT_CHARS:
            raise PoisonEventError(
                "too-large",
                f"{where}: text of {len(value)} characters is over the {MAX_TEXT_CHARS} a "
                "feature column may hold",
            )
        return value
    if isinstance(value, int):
        low, high = _INT_RANGE["int64"]
        if not low <= value <= high:
            raise PoisonEventError(
                "out-of-range", f"{where}: value {_shown(value)} is out of int64 range"
            )
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise NonFinite(value)
        return value
    raise PoisonEventError("wrong-type", f"{where}: value {_shown(value)} is not a scalar")


def _fits(dtype: str, value: Any) -> bool:
    """True if the cache can store ``value`` as ``dtype`` (a vector value that cannot,
    an aggregate overflowing its dtype, is stored as missing instead)."""
    if value is None or dtype == "bool":
        return True
    if isinstance(value, bool):
        return False
    if dtype in _INT_RANGE:
        low, high = _INT_RANGE[dtype]
        return isinstance(value, int) and low <= value <= high
    if not isinstance(value, int | float):
        return False
    try:
        number = float(value)
    except OverflowError:
        return False
    return math.isfinite(number) and (dtype != "float32" or abs(number) <= _F32_MAX)


CHUNK_MS = 10_000  # rows go to the changelog in chunks of this much event time


def chunk_of(event_ms: int) -> int:
    """The changelog chunk of a row with this event time."""
    return event_ms // CHUNK_MS


class EntityState(dict[str, Any]):
    """An entity's state, and in memory only: its aggregate index (table ->
    TableIndex, built from the rows when first needed), the row chunks changed
    since the state last went to the changelog (``(table, chunk)``), and whether
    it was just read back from the local store (``loaded``: its first vector's
    index is dropped once read, see :meth:`EntityEngine.schedule`)."""

    __slots__ = ("changed", "index", "loaded")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.index: dict[str, TableIndex] | None = None
        self.changed: set[tuple[str, int]] = set()
        self.loaded = False

    def take_changes(self) -> set[tuple[str, int]]:
        """The row chunks changed since the last call."""
        changed, self.changed = self.changed, set()
        return changed


@dataclass(frozen=True, slots=True)
class _AggregatePlan:
    kind: Aggregate
    table: str
    window: WindowKey | None
    where: tuple[tuple[str, Any], ...]
    column: str
    names: tuple[str, ...]
    read: Reader  # kind's read bound to the above, resolved once


def _plan(
    kind: Aggregate,
    table: str,
    window: WindowKey | None,
    where: tuple[tuple[str, Any], ...],
    column: str,
    names: tuple[str, ...],
) -> _AggregatePlan:
    return _AggregatePlan(
        kind, table, window, where, column, names, kind.reader(window, where, column, len(names))
    )


_NO_ROWS: Mapping[str, list[Any]] = MappingProxyType({})

# Where EntityEngine._aggregates_at leaves the windows it read.
_Then = Literal["newest", "first", "last", "drop"]


@dataclass(frozen=True, slots=True)
class _TableNeeds:
    columns: tuple[str, ...]
    time_column: str | None
    retention_ms: int | None  # None: no window bounds it (latest/last_n only)
    keep_last: int  # rows always kept (latest: 1, last_n: n)
    dtypes: dict[str, str]  # column -> dtype it must convert to
    # Column -> (the largest magnitude, the dtype that sets it): a number an aggregate
    # reads is refused on arrival beyond the widest dtype of the aggregates reading
    # it (it could only make their values missing for as long as it stays in a window).
    limits: dict[str, tuple[float, str]]


class EntityEngine:
    """State updates and the vector of one entity type."""

    def __init__(self, entity: EntitySettings, own_tables: Sequence[str] = ()) -> None:
        self.settings = entity
        # A personal entity exists while its own row does (a user's row in users):
        # deleting that row erases the entity, and rows that feed it without it
        # (events of a user whose row is gone or not seen yet) are kept but not
        # served. Empty: the entity exists while any row feeds it.
        self.own_tables = (
            tuple(t for t in own_tables if t in entity.tables) if entity.personal else ()
        )
        self.non_finite = 0  # NaN/infinite values stored as missing (a metric reads it)
        features: list[Feature] = [Feature(f.name, f.dtype) for f in entity.latest]
        for aggregate in entity.aggregates:
            features.extend(Feature(n, aggregate.effective_dtype) for n in aggregate.feature_names)
        self.slots = SCHEDULE_SLOTS if any(a.window for a in entity.aggregates) else 0
        self.schema = FeatureSchema(
            entity.name,
            tuple(features),
            version=entity.version,
            personal=entity.personal,
            slots=self.slots,
        )
        self._by_table: dict[str, list[AggregateFeature]] = {}
        self._where: dict[str, tuple[tuple[str, Any], ...]] = {}
        # table -> its windows (by key), each with the groups (where filters) it needs.
        self._windows: dict[str, dict[WindowKey | None, WindowSpec]] = {}
        for aggregate in entity.aggregates:
            self._by_table.setdefault(aggregate.table, []).append(aggregate)
            where = tuple(sorted(aggregate.where.items()))
            self._where[aggregate.name] = where
            key = aggregate.window.key if aggregate.window else None
            by_key = self._windows.setdefault(aggregate.table, {})
            group = by_key.setdefault(key, WindowSpec(key)).groups.setdefault(
                where, GroupSpec(where)
            )
            aggregate.kind.require(group, aggregate.column or "")
        self._dtypes = {feature.name: feature.dtype for feature in self.schema.features}
        # What reading each aggregate needs, resolved once (not per vector).
        self._reads = [
            _plan(
                a.kind,
                a.table,
                a.window.key if a.window else None,
                self._where[a.name],
                a.column or "",
                tuple(a.feature_names),
            )
            for a in entity.aggregates
        ]
        # (table, window) -> its plans: a schedule's later read times read only the
        # windows whose rows changed.
        self._reads_of: dict[tuple[str, WindowKey | None], list[_AggregatePlan]] = {}
        for plan in self._reads:
            self._reads_of.setdefault((plan.table, plan.window), []).append(plan)
        self.needs: dict[str, _TableNeeds] = {}
        for table in entity.tables:
            columns: set[str] = set()
            dtypes: dict[str, str] = {}
            limits: dict[str, tuple[float, str]] = {}
            windows: list[int] = []
            keep_last = 0
            for latest in entity.latest:
                if latest.table == table:
                    columns.add(latest.column)
                    dtypes[latest.column] = latest.dtype
                    keep_last = max(keep_last, 1)
            for agg in entity.aggregates:
                if agg.table != table:
                    continue
                columns.update(agg.where)
                if agg.column:
                    columns.add(agg.column)
                    dtype = agg.kind.column_dtype(agg)
                    if dtype == "float64":  # numbers win over a ranked feature's dtype
                        dtypes[agg.column] = dtype
                    elif dtype is not None:
                        dtypes.setdefault(agg.column, dtype)
                    if agg.kind.numeric:
                        widest = (_MAGNITUDE[agg.effective_dtype], agg.effective_dtype)
                        limits[agg.column] = max(limits.get(agg.column, widest), widest)
                if agg.window is not None:
                    # A zone's day can last 25 hours: its bucket can start an hour earlier.
                    slack = 3_600_000 if agg.window.time_zone != "UTC" else 0
                    windows.append(agg.window.size_ms + slack)
                keep_last = max(keep_last, agg.kind.keep_last(agg))
            time_column = entity.time_columns.get(table)
            if time_column:
                columns.add(time_column)
            self.needs[table] = _TableNeeds(
                tuple(sorted(columns)),
                time_column,
                max(windows) if windows else None,
                keep_last,
                dtypes,
                limits,
            )

    # -- state updates -----------------------------------------------------------------------

    def apply(
        self, state: dict[str, Any] | None, change: RegionalChange | Mapping[str, Any]
    ) -> tuple[EntityState, bool]:
        """Apply one regional change (or its wire form, decoded here).

        Returns:
            ``(new_state, changed)``. ``changed`` is False for duplicates and
            changes older than what the state holds (nothing to write).

        Raises:
            PoisonEventError: a value has the wrong type for its feature.
        """
        if not isinstance(change, RegionalChange):
            change = RegionalChange.from_wire(dict(change))
        if state is None:
            state = EntityState(rows={}, lsn=0, rev=0, ts=0, gone=None)
        elif not isinstance(state, EntityState):
            state = EntityState(state)  # recovered from the changelog: index it when needed
        op, lsn, seq = change.op, change.lsn, change.seq
        position = (lsn, seq)
        gone = state.get("gone")
        if op == "x":
            if gone is not None and tuple(gone) >= position:
                return state, False
            # The entity is removed as of this position: its rows changed later (a
            # reused id, or a removal that arrives late) stay.
            survivors = {
                table: {pk: e for pk, e in rows.items() if (e[_LSN], e[_SEQ]) > position}
                for table, rows in state["rows"].items()
            }
            removed = EntityState(
                rows={t: r for t, r in survivors.items() if r},
                lsn=state["lsn"],
                rev=state["rev"],
                ts=state["ts"],
                gone=[lsn, seq],
            )
            if state.get("marks"):
                removed["marks"] = state["marks"]
            removed.changed = state.changed | {
                (table, chunk_of(e[_T]))
                for table, rows in state["rows"].items()
                for e in rows.values()
            }
            return self._stamp(removed, lsn, change.commit_ms), True
        if gone is not None and tuple(gone) >= position:
            return state, False  # older than the entity's removal (gone stays: it guards)
        table = change.table
        needs = self.needs.get(table)
        if needs is None:
            return state, False
        rows: dict[str, list[Any]] = state["rows"].setdefault(table, {})
        pk = change.pk
        current = rows.get(pk)
        if current is not None and (current[_LSN], current[_SEQ]) >= position:
            return state, False
        # An index that is not built yet (a state just read from the local store) is
        # built from the rows when a vector is read, once, with this change in them.
        index = state.index.get(table) if state.index is not None else None
        if op == "d":
            event_ms = current[_T] if current is not None else change.commit_ms
            rows[pk] = [lsn, seq, event_ms, 1, {}]
        else:
            row = change.row or {}
            values = {}
            for column in needs.columns:
                value = row.get(column)
                dtype = needs.dtypes.get(column)
                try:
                    if dtype is not None:
                        value = _coerce(value, dtype, f"{table}.{column}")
                    elif column != needs.time_column:
                        value = _plain(value, f"{table}.{column}")
                except NonFinite:
                    value = None
                    self.non_finite += 1
                limit = needs.limits.get(column)
                if limit is not None and value is not None and abs(value) > limit[0]:
                    raise PoisonEventError(
                        "out-of-range",
                        f"{table}.{column}: value {_shown(row.get(column))} is beyond what "
                        f"its aggregates hold ({limit[1]}, up to {limit[0]:.4g}); declare "
                        "their dtype float64 to take it",
                    )
                values[column] = value
            event_ms = event_time_ms(
                row.get(needs.time_column) if needs.time_column else None, change.commit_ms
            )
            if (
                op == "r"
                and current is not None
                and not current[_DEL]
                and current[_VALS] == values
                and (needs.time_column is None or current[_T] == event_ms)
            ):
                # A snapshot re-read of a row the state already holds (a backfill
                # while streaming goes on): a no-op. Replacing it would only move a
                # row without a time column to the read's time, out of its windows.
                # Only a vector last written under an older feature-set version is
                # written again (``edgefeed features apply`` snapshots to rebuild).
                if state.get("v") == self.schema.version:
                    return state, False
                return self._stamp(state, state["lsn"], change.commit_ms), True
            rows[pk] = [lsn, seq, event_ms, 0, values]
        if index is not None:
            index.replace(pk, current, rows[pk], rows)
        state.changed.add((table, chunk_of(rows[pk][_T])))
        if current is not None:
            state.changed.add((table, chunk_of(current[_T])))
        return self._stamp(state, lsn, change.commit_ms), True

    def truncate(self, state: dict[str, Any], change: RegionalChange | Mapping[str, Any]) -> bool:
        """Forget every row of the truncated table; True if the state changed."""
        if not isinstance(change, RegionalChange):
            data = dict(change)
            change = RegionalChange.from_wire({"op": "t", "seq": 0, **data})
        table = change.table
        rows = state["rows"].get(table)
        if not rows:
            return False
        # Rows changed after the truncate (a stale truncate arriving late) stay.
        position = change.position
        cut = {pk: e for pk, e in rows.items() if (e[_LSN], e[_SEQ]) < position}
        if not cut:
            return False
        kept = {pk: e for pk, e in rows.items() if pk not in cut}
        if kept:
            state["rows"][table] = kept
        else:
            del state["rows"][table]
        if isinstance(state, EntityState):
            state.changed.update((table, chunk_of(e[_T])) for e in cut.values())
        if isinstance(state, EntityState) and state.index is not None:
            state.index.pop(table, None)
            if table in self._windows:
                state.index[table] = TableIndex(list(self._windows[table].values()), kept)
        self._stamp(state, change.lsn, change.commit_ms)
        return True

    def _stamp(self, state: _S, lsn: int, ts: int) -> _S:
        state["lsn"] = max(int(state["lsn"]), lsn)
        state["rev"] = (int(state["rev"]) + 1) & _U32
        state["ts"] = max(int(state["ts"]), int(ts))
        state["v"] = self.schema.version  # the feature-set version its next vector carries
        return state

    def _index(self, state: EntityState, at_ms: int | None = None) -> dict[str, TableIndex]:
        """The state's aggregate index, built from its rows if it has none yet (with
        ``at_ms``: standing at that read time, where it is read first, instead of
        filled at the newest event and moved there)."""
        if state.index is None:
            state.index = {
                table: TableIndex(list(windows.values()), state["rows"].get(table, {}), at_ms)
                for table, windows in self._windows.items()
            }
        return state.index

    def prune(self, state: dict[str, Any]) -> None:
        """Drop rows that no window, latest value or last-n can use any more.

        Amortised: a table is cut only once it has doubled since its last cut.
        """
        marks: dict[str, int] = state.setdefault("marks", {})
        for table, rows in state["rows"].items():
            needs = self.needs.get(table)
            if needs is None or needs.retention_ms is None or len(rows) <= needs.keep_last:
                continue
            if len(rows) < marks.get(table, 0):
                continue
            ref = max(entry[_T] for entry in rows.values())
            newest = sorted(
                rows.items(), key=lambda kv: (kv[1][_T], kv[1][_LSN], kv[1][_SEQ]), reverse=True
            )
            keep = {pk for pk, _ in newest[: needs.keep_last]}
            for agg in self._by_table.get(table, []):
                if agg.window is None and agg.kind.keep_last(agg):  # its n newest matching rows
                    keep.update(self._newest_matching(agg, newest))
            horizon = ref - needs.retention_ms
            cut = [pk for pk, entry in newest if entry[_T] < horizon and pk not in keep]
            if isinstance(state, EntityState):
                state.changed.update((table, chunk_of(rows[pk][_T])) for pk in cut)
            if cut and isinstance(state, EntityState) and state.index is not None:
                standing = state.index.get(table)
                if standing is not None and standing.at is not None and standing.at < ref:
                    standing.restore(
                        rows
                    )  # a read time before the newest event: cut rows may be in
            for pk in cut:
                del rows[pk]
            marks[table] = 2 * len(rows)
            if cut and isinstance(state, EntityState) and state.index is not None:
                index = state.index.get(table)
                if index is not None:
                    index.forget(rows)

    def _newest_matching(
        self, agg: AggregateFeature, newest: list[tuple[str, list[Any]]]
    ) -> list[str]:
        where, column, n = self._where[agg.name], agg.column or "", agg.n or 0
        picked: list[str] = []
        for pk, entry in newest:
            if len(picked) >= n:
                break
            values = entry[_VALS]
            if entry[_DEL] or values.get(column) is None:
                continue
            if all(values.get(k) == v for k, v in where):
                picked.append(pk)
        return picked

    # -- the vector ---------------------------------------------------------------------------

    def vector(self, state: Mapping[str, Any], at_ms: int | None = None) -> dict[str, Any]:
        """Feature name -> value (None: missing) for the entity's state, with windows
        read at ``at_ms`` (None: as of the entity's newest event in each table)."""
        values = self._latest(state)
        if self.settings.aggregates:
            values.update(self._aggregates(state, at_ms))
        return self._checked(values)

    def vectors_at(self, state: EntityState, times_ms: Sequence[int]) -> list[dict[str, Any]]:
        """The vector read at each of ``times_ms`` (ascending), as the lookup client gets
        it from the value the worker writes at that time: the windows move forward
        through the times and stay at the first (a later call moves them on from there
        over the rows between only, as the worker's next schedule does)."""
        values = self._checked(self._latest(state))
        if not self.slots:
            aggregates = self._aggregates(state, None)
            return [values | aggregates for _ in times_ms]
        return [values | a for a in self._aggregates_at(state, list(times_ms), then="first")]

    def schedule(
        self, state: Mapping[str, Any], now_ms: int
    ) -> tuple[dict[str, Any], Schedule | None]:
        """The vector in force at ``now_ms`` and the ones it takes on later (at most
        :data:`SCHEDULE_SLOTS`; ``until_us`` is where the schedule stops being known).
        """
        if not isinstance(state, EntityState):
            state = EntityState(state)  # recovered from the changelog: index it once
        values = self._latest(state)
        if not self.slots:
            values.update(self._aggregates(state, None))
            return self._checked(values), None
        # A state the cache has just read back from the local store is mostly
        # evicted before its next change (a region larger than the budget): the
        # index built for this vector is dropped once read instead of moved back to
        # ``now_ms`` (~10% of a missed entity's vector). A state changed again while
        # still in memory builds its index once more, and keeps it from then on.
        then: _Then = "drop" if state.index is None and state.loaded else "last"
        state.loaded = False
        indexes = self._index(state, now_ms)
        # Each window's own change times: at a read time of the schedule, only the
        # windows whose rows change then need to move (the others' rows stay).
        moves = {
            table: index.window_changes_after(now_ms, self.slots + 1)
            for table, index in indexes.items()
        }
        times: set[int] = set()
        for changes in moves.values():
            for window_times in changes.values():
                times.update(window_times)
        points = sorted(times)[: self.slots + 1]
        # The windows move forward through the read times, each step only over the rows
        # between two, and stay at the last: the next schedule moves them from there.
        self._checked(values)
        # The latest values are the same at every read time: the aggregates alone tell
        # whether a read time takes on a new vector.
        read = self._aggregates_at(state, [now_ms, *points[: self.slots]], moves=moves, then=then)
        base = values | read[0]
        patches: list[tuple[int, dict[str, Any]]] = []
        previous = read[0]
        for at, aggregates in zip(points, read[1:], strict=False):
            if aggregates != previous:
                patches.append((at * 1000, values | aggregates))
                previous = aggregates
        until = points[self.slots] * 1000 if len(points) > self.slots else None
        return base, Schedule(tuple(patches), until)

    def _latest(self, state: Mapping[str, Any]) -> dict[str, Any]:
        values: dict[str, Any] = {}
        for latest in self.settings.latest:
            live = [e for e in state["rows"].get(latest.table, {}).values() if not e[_DEL]]
            if live:
                newest = max(live, key=lambda e: (e[_LSN], e[_SEQ]))
                values[latest.name] = newest[_VALS].get(latest.column)
            else:
                values[latest.name] = None
        return values

    def _aggregates(self, state: Mapping[str, Any], at_ms: int | None) -> dict[str, Any]:
        if at_ms is None:
            indexes = self._index(state if isinstance(state, EntityState) else EntityState(state))
            for table, index in indexes.items():
                if index.at is not None:  # standing at a read time: back to the newest event
                    index.restore(state["rows"].get(table, {}))
            return self._read_aggregates(indexes, state["rows"])
        return self._aggregates_at(state, [at_ms])[0]

    def _aggregates_at(
        self,
        state: Mapping[str, Any],
        times: list[int],
        *,
        moves: Mapping[str, Mapping[WindowKey | None, set[int]]] | None = None,
        then: _Then = "newest",
    ) -> list[dict[str, Any]]:
        """The aggregates with windows read at each of ``times``: after the first, only
        the aggregates of windows whose rows changed are read again.

        Args:
            moves: Table -> window -> the read times after ``times[0]`` at which its
                rows change, every one up to ``times[-1]``
                (:meth:`TableIndex.window_changes_after`): after the first time, a
                window moves only at its own.
            then: Where the windows go afterwards: back to the newest event
                (``newest``); to ``times[0]`` (``first``: a later call starts near
                there, and moving is cheap when little lies between); nowhere
                (``last``: the next schedule moves them from the last read time to
                its own in one move, and a state evicted before its next change
                never moves them back); or the state's index dropped (``drop``: the
                next vector builds it again from the rows).
        """
        indexes = self._index(state if isinstance(state, EntityState) else EntityState(state))
        all_rows = state["rows"]
        out: list[dict[str, Any]] = []
        # Table -> read time -> the windows that move then.
        moving: dict[str, dict[int, list[WindowKey | None]]] = {}
        for table, changes in (moves or {}).items():
            at_time = moving[table] = {}
            for key, window_times in changes.items():
                for at in window_times:
                    at_time.setdefault(at, []).append(key)
        try:
            for at_ms in times:
                changed: list[tuple[str, WindowKey | None]] = []
                for table, index in indexes.items():
                    only = None
                    if moves is not None and out:
                        only = moving[table].get(at_ms, ())
                    for key in index.view(at_ms, all_rows.get(table, _NO_ROWS), only):
                        changed.append((table, key))
                if not out:
                    out.append(self._checked(self._read_aggregates(indexes, all_rows)))
                elif not changed:
                    out.append(out[-1])  # callers copy what they keep
                else:
                    values = dict(out[-1])
                    values.update(self._checked(self._read_aggregates(indexes, all_rows, changed)))
                    out.append(values)
        finally:
            if then == "drop" and isinstance(state, EntityState):
                state.index = None
            elif then != "last":
                for table, index in indexes.items():
                    if then == "first" and out:
                        index.view(times[0], all_rows.get(table, {}))
                    else:
                        index.restore(all_rows.get(table, {}))
        return out

    def _read_aggregates(
        self,
        indexes: Mapping[str, TableIndex],
        all_rows: Mapping[str, Any],
        only: Iterable[tuple[str, WindowKey | None]] | None = None,
    ) -> dict[str, Any]:
        """The aggregates as the windows of ``indexes`` stand (``only``: of these windows)."""
        values: dict[str, Any] = {}
        plans = (
            self._reads
            if only is None
            else [plan for key in only for plan in self._reads_of.get(key, ())]
        )
        for plan in plans:
            try:
                computed = plan.read(indexes[plan.table], all_rows.get(plan.table, _NO_ROWS))
            except OverflowError:  # an exact sum beyond any float
                computed = [None] * len(plan.names)
            values.update(zip(plan.names, computed, strict=True))
        return values

    def _checked(self, values: dict[str, Any]) -> dict[str, Any]:
        """``values`` with what its feature's dtype cannot hold set missing."""
        dtypes = self._dtypes
        for name, value in values.items():
            if value is None:
                continue
            # The common cases first, as _fits decides them (it is called per value
            # of every vector of a schedule).
            kind = type(value)
            if kind is int:
                if dtypes[name] == "int64" and -(2**63) <= value < 2**63:
                    continue
            elif kind is float:
                dtype = dtypes[name]
                if dtype == "float64":
                    if math.isfinite(value):
                        continue
                elif dtype == "float32" and -_F32_MAX <= value <= _F32_MAX:  # NaN: False
                    continue
            if not _fits(dtypes[name], value):
                values[name] = None
        return values

    def served(self, state: Mapping[str, Any]) -> bool:
        """Whether the cache holds a vector for the state (False: the write is a delete):
        a removed entity with no live row left, or a personal entity whose own row is
        gone or not seen yet, is not served."""
        if state.get("gone") is not None and not any(
            not e[_DEL] for rows in state["rows"].values() for e in rows.values()
        ):
            return False
        return not self.own_tables or any(
            not e[_DEL] for table in self.own_tables for e in state["rows"].get(table, {}).values()
        )

    def write_op(
        self, entity_id: Any, state: Mapping[str, Any], now_ms: int | None = None
    ) -> Upsert | Delete:
        """The cache write for the state: its vector and schedule as of ``now_ms``
        (default: the wall clock), or a delete once the entity is gone."""
        position = Position(int(state["lsn"]), int(state["rev"]))
        commit_s = int(state["ts"]) / 1000.0
        if not self.served(state):
            return Delete(self.schema.entity, entity_id, position, commit_s)
        if now_ms is None:
            now_ms = int(time.time() * 1000)
        values, schedule = self.schedule(state, now_ms)
        return Upsert(self.schema.entity, entity_id, values, position, commit_s, schedule=schedule)


class FeatureEngine:
    """The engines of every entity type."""

    def __init__(
        self,
        entities: Iterable[EntitySettings],
        tables: Mapping[str, TableSettings] | None = None,
    ) -> None:
        """Args:
        tables: The captured tables: with them, a personal entity is served only
            while its own row exists (its own table: the one keyed by its id).
        """
        tables = tables or {}
        self.entities = {
            e.name: EntityEngine(
                e,
                [t for t, column in e.tables.items() if t in tables and tables[t].key == [column]],
            )
            for e in entities
        }

    @property
    def schemas(self) -> list[FeatureSchema]:
        return [engine.schema for engine in self.entities.values()]

    def engine(self, entity: str) -> EntityEngine:
        try:
            return self.entities[entity]
        except KeyError:
            raise PoisonEventError(
                "unknown-entity",
                f"entity type {entity!r} not declared; declared: {', '.join(self.entities)}",
            ) from None
