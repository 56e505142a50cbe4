"""Incremental windowed aggregates over one entity's rows of one table.

A vector used to be recomputed from every row in its windows each time the
entity changed: fine for an entity with a handful of rows, but a popular item
holds thousands of events in its hour, and every batch paid for all of them.
The index here keeps, per window and ``where`` filter, running accumulators
that a changed row adjusts (its old version retracted, its new one added), and
moves rows in and out as the window's end (the table's newest event time)
advances. A vector is then assembled from the accumulators in time independent
of the rows held.

The result is exactly what a full recomputation gives: counts and counters are
integers; sums and means are kept exactly (each float as an integer multiple
of 2**-1074) and rounded once when read, so adding and retracting values in any
order leaves no rounding residue. The index is derived data: it lives in memory
beside the state (never in the changelog) and is rebuilt from the rows after a
restart.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

from pipeline.rows import DEL as _DEL
from pipeline.rows import LSN as _LSN
from pipeline.rows import SEQ as _SEQ
from pipeline.rows import VALS as _VALS
from pipeline.rows import T as _T

__all__ = [
    "EXACT_SCALE",
    "GroupSpec",
    "TableIndex",
    "WindowKey",
    "WindowSpec",
    "exact",
    "top_values",
]

_FOREVER = (-(1 << 62), 1 << 62)
_MAX = 1 << 62  # sorts after any lsn/seq in an order key
_EPOCH = datetime(1970, 1, 1)
_TEXT = 1 << 30  # pk_rank of a key that is not a number: after every number
EXACT_SCALE = 1 << 1074  # every finite double is an integer multiple of 2**-1074


def pk_rank(pk: str) -> tuple[int, str]:
    """The order of row keys among rows of the same event time and source position
    (rows of one multi-row insert share a WAL position): numeric keys in numeric
    order, then other keys as text. Keeps "newest" rankings a function of the rows,
    as a recomputation from the source tables (which orders by key) sees them."""
    return (len(pk), pk) if pk.isdigit() else (_TEXT, pk)


def exact(value: float) -> int:
    """``value`` as an exact integer multiple of 2**-1074."""
    numerator, denominator = value.as_integer_ratio()
    return numerator * (EXACT_SCALE // denominator)


class GroupSpec:
    """What one (window, where filter) must accumulate; each aggregate adds its needs
    (pipeline.aggregates, ``Aggregate.require``)."""

    __slots__ = ("distinct", "sorted", "stamped", "sums", "where")

    def __init__(self, where: tuple[tuple[str, Any], ...]) -> None:
        self.where = where
        self.sums: set[str] = set()  # sum, mean
        self.sorted: set[str] = set()  # min, max
        self.distinct: set[str] = set()  # distinct_count, top_k
        self.stamped: set[str] = set()  # top_k: the newest row of each value


WindowKey = tuple[int, str, str]  # (size_ms, "sliding" | "tumbling", time zone)


class WindowSpec:
    """One window of a table: ``(size_ms, type, time_zone)`` or None (unbounded), and
    its groups.

    Read at time t, a sliding window holds the event times (t - size, t]; a tumbling
    one the bucket holding t, up to t. In integer milliseconds both are ``[low,
    high)`` intervals (:meth:`interval`).
    """

    __slots__ = ("_size", "_sliding", "_zone", "groups", "key")

    def __init__(self, key: WindowKey | None) -> None:
        self.key = key
        self.groups: dict[tuple[tuple[str, Any], ...], GroupSpec] = {}
        self._size = key[0] if key is not None else 0
        self._sliding = key is not None and key[1] == "sliding"
        self._zone = ZoneInfo(key[2]) if key is not None and key[2] != "UTC" else None

    def interval(self, ref: int | None) -> tuple[int, int]:
        """The event times ``[low, high)`` in the window when read at ``ref`` (ms)."""
        if self.key is None:
            return _FOREVER
        if ref is None:
            return (0, 0)
        if self._sliding:
            return (ref - self._size + 1, ref + 1)
        start, end = self.bucket(ref)
        return (start, min(end, ref + 1))

    def bucket(self, t: int) -> tuple[int, int]:
        """The tumbling bucket ``[start, end)`` holding ``t``: in UTC, multiples of the
        size; in another zone, local wall-clock buckets (a day starts at local
        midnight, so a day across a DST change lasts 23 or 25 hours)."""
        size = self._size
        if self._zone is None:
            start = t - t % size
            return (start, start + size)
        offset = datetime.fromtimestamp(t / 1000, self._zone).utcoffset()
        local = t + (int(offset.total_seconds() * 1000) if offset is not None else 0)
        local_start = local - local % size
        return (self._utc(local_start), self._utc(local_start + size))

    def _utc(self, local_ms: int) -> int:
        """Local wall-clock milliseconds (naive, since 1970-01-01) in UTC milliseconds."""
        wall = _EPOCH + timedelta(milliseconds=local_ms)
        return round(wall.replace(tzinfo=self._zone).timestamp() * 1000)

    def changes_after(
        self, order: Sequence[tuple[Any, ...]], after: int, n: int, entering: list[int]
    ) -> list[int]:
        """The first ``n`` read times after ``after`` at which this window's rows (``order``,
        sorted by event time) change: a row enters at its event time, and leaves
        ``size`` later (sliding) or when its bucket ends (tumbling).

        Args:
            entering: The event times of the first ``n`` rows after ``after`` (the same
                for every window of a table: :meth:`TableIndex.window_changes_after`
                finds them once).
        """
        if self.key is None:
            return []
        times = list(entering)
        if self._sliding:
            first = bisect_right(order, (after - self._size, _MAX))
            times += [key[0] + self._size for key in order[first : first + n]]
        else:
            index = bisect_left(order, (self.bucket(after)[0],))
            while index < len(order) and n > 0:
                end = self.bucket(order[index][0])[1]
                times.append(end)  # after ``after``: its bucket holds ``after`` or later
                n -= 1
                index = bisect_left(order, (end,), index)
        return times


_UNUSED: dict[str, Any] = {}  # see _Group.__init__


class _Group:
    __slots__ = ("count", "counters", "present", "spec", "stamps", "sums", "values")

    def __init__(self, spec: GroupSpec) -> None:
        # Built for every window of a state read back from the local store (a
        # quarter of the disk mode's apply path in benchmarks/scale.py at 30,000
        # users, most of it making containers): those a group's aggregates do not
        # need are one shared empty dict (most groups only count), never written,
        # since :meth:`update` writes only the columns of the group's spec.
        self.spec = spec
        self.count = 0
        if spec.sums:
            self.sums = dict.fromkeys(spec.sums, 0)
            self.present = dict.fromkeys(spec.sums, 0)
        else:
            self.sums = self.present = _UNUSED
        self.values: dict[str, list[float]] = (
            {c: [] for c in spec.sorted} if spec.sorted else _UNUSED
        )
        # Value -> rows holding it (a plain dict: a Counter costs a Python-level
        # __init__ per group, and a group is made per window of every state indexed).
        self.counters: dict[str, dict[Any, int]] = (
            {c: {} for c in spec.distinct} if spec.distinct else _UNUSED
        )
        self.stamps: dict[str, dict[Any, list[tuple[int, int, int, tuple[int, str]]]]] = (
            {c: {} for c in spec.stamped} if spec.stamped else _UNUSED
        )

    def take(
        self, keys: Sequence[tuple[Any, ...]], rows: Mapping[str, list[Any]], sign: int
    ) -> None:
        """Add (sign 1) or retract (sign -1) the live rows of ``keys`` (keys of
        :attr:`TableIndex.order`, in time order)."""
        spec = self.spec
        if not (spec.where or spec.sums or spec.sorted or spec.distinct or spec.stamped):
            self.count += sign * len(keys)  # a count of every row: nothing to look at
            return
        for key in keys:
            self.update(rows[key[4]], sign, key[4])

    def update(self, entry: list[Any], sign: int, pk: str) -> None:
        """Add (sign 1) or retract (sign -1) one live row."""
        values: Mapping[str, Any] = entry[_VALS]
        for column, wanted in self.spec.where:
            if values.get(column) != wanted:
                return
        self.count += sign
        for column in self.spec.sums:
            value = values.get(column)
            if value is not None:
                self.sums[column] += sign * exact(value)
                self.present[column] += sign
        for column in self.spec.sorted:
            value = values.get(column)
            if value is not None:
                ordered = self.values[column]
                if sign > 0:
                    insort(ordered, value)
                else:
                    del ordered[bisect_left(ordered, value)]
        for column in self.spec.distinct:
            value = values.get(column)
            if value is not None:
                counter = self.counters[column]
                count = counter.get(value, 0) + sign
                if count:
                    counter[value] = count
                else:
                    del counter[value]
        for column in self.spec.stamped:
            value = values.get(column)
            if value is not None:
                stamp = (entry[_T], entry[_LSN], entry[_SEQ], pk_rank(pk))
                stamps = self.stamps[column].setdefault(value, [])
                if sign > 0:
                    insort(stamps, stamp)
                else:
                    del stamps[bisect_left(stamps, stamp)]
                    if not stamps:
                        del self.stamps[column][value]


class _Window:
    __slots__ = ("groups", "high", "low", "spec")

    def __init__(self, spec: WindowSpec, low: int, high: int) -> None:
        self.spec = spec
        self.low, self.high = low, high
        self.groups = {where: _Group(group) for where, group in spec.groups.items()}

    def update(self, entry: list[Any], sign: int, pk: str) -> None:
        if self.low <= entry[_T] < self.high:
            for group in self.groups.values():
                group.update(entry, sign, pk)


class TableIndex:
    """The live rows of one table in time order, and the accumulators of its windows.

    Args:
        windows: The table's windows and what each must accumulate.
        rows: The table's rows in the state (pk -> entry); indexed as they are.
        at: The read time the windows stand at once built, as after :meth:`view`
            (None: the newest event).
    """

    __slots__ = ("at", "order", "ref", "windows")

    def __init__(
        self, windows: Sequence[WindowSpec], rows: Mapping[str, list[Any]], at: int | None = None
    ) -> None:
        self.ref: int | None = max([e[_T] for e in rows.values()], default=None)
        # The read time the windows stand at (:meth:`view`); None: the newest event.
        self.at: int | None = at
        stand = self.ref if at is None else at
        self.windows = {spec.key: _Window(spec, *spec.interval(stand)) for spec in windows}
        # (event time, lsn, seq, key rank, key): time order, ties by position, then key
        # (the key's rank as pk_rank gives it, inlined: a call per row cost more).
        self.order: list[tuple[int, int, int, tuple[int, str], str]] = [
            (e[_T], e[_LSN], e[_SEQ], (len(pk), pk) if pk.isdigit() else (_TEXT, pk), pk)
            for pk, e in rows.items()
            if not e[_DEL]
        ]
        self.order.sort()
        # Each window takes the rows of its interval, found by bisection (a state read
        # back from the local store is indexed on its first change: most of its rows
        # lie outside most windows). Each group still takes its rows in time order.
        order = self.order
        for window in self.windows.values():
            if window.low >= window.high or not window.groups:
                continue
            first = bisect_left(order, (window.low,))
            keys = order[first : bisect_left(order, (window.high,), first)]
            if keys:
                for group in window.groups.values():
                    group.take(keys, rows, 1)

    def replace(
        self, pk: str, old: list[Any] | None, new: list[Any], rows: Mapping[str, list[Any]]
    ) -> None:
        """Row ``pk`` changed from ``old`` to ``new`` (already in ``rows``)."""
        if old is not None and not old[_DEL]:
            key = (old[_T], old[_LSN], old[_SEQ], pk_rank(pk), pk)
            del self.order[bisect_left(self.order, key)]
            for window in self.windows.values():
                window.update(old, -1, pk)
        t = new[_T]
        if self.ref is None or t > self.ref:
            self._move(t, rows)
        elif old is not None and old[_T] == self.ref and t < self.ref:
            # The newest row moved back in time: the window end is the next newest.
            self._move(max(e[_T] for e in rows.values()), rows)
        if not new[_DEL]:
            insort(self.order, (t, new[_LSN], new[_SEQ], pk_rank(pk), pk))
            for window in self.windows.values():
                window.update(new, 1, pk)

    def forget(self, rows: Mapping[str, list[Any]]) -> None:
        """Rows outside every window left ``rows`` (pruned): drop them from the order."""
        self.order = [
            key
            for key in self.order
            if (entry := rows.get(key[4])) is not None and entry[_T] == key[0]
        ]

    def _move(self, ref: int, rows: Mapping[str, list[Any]]) -> None:
        """The newest event time became ``ref``: rows leave and enter the windows (unless
        they stand at a read time, where they stay)."""
        self.ref = ref
        if self.at is None:
            self._shift(ref, rows)

    def view(
        self,
        t: int,
        rows: Mapping[str, list[Any]],
        only: Iterable[WindowKey | None] | None = None,
    ) -> list[WindowKey | None]:
        """Set the windows as read at time ``t`` (they stay there, changes applied as
        of then, until the next view or :meth:`restore`); the keys of the windows
        whose rows changed.

        Args:
            only: Move these windows alone: the caller knows that no row enters or
                leaves the others between where they stand and ``t`` (their read time
                changes, their rows do not; a later move takes them on from where
                they stand, over the rows between only, which is the same).
        """
        self.at = t
        return self._shift(t, rows, only)

    def restore(self, rows: Mapping[str, list[Any]]) -> None:
        """Set the windows back as of the newest event."""
        self.at = None
        if self.ref is not None:
            self._shift(self.ref, rows)

    def changes_after(self, after: int, n: int) -> list[int]:
        """The first ``n`` read times after ``after`` at which any window changes."""
        times: set[int] = set()
        for changes in self.window_changes_after(after, n).values():
            times.update(changes)
        return sorted(times)[:n]

    def window_changes_after(self, after: int, n: int) -> dict[WindowKey | None, set[int]]:
        """Each window's read times after ``after`` at which its rows change: at least
        its first ``n`` (all of them up to the ``n``-th of the union, as
        :meth:`changes_after` takes them)."""
        order = self.order
        start = bisect_right(order, (after, _MAX))
        entering = [key[0] for key in order[start : start + n]]
        return {
            key: set(window.spec.changes_after(order, after, n, entering))
            for key, window in self.windows.items()
        }

    def _shift(
        self,
        ref: int,
        rows: Mapping[str, list[Any]],
        only: Iterable[WindowKey | None] | None = None,
    ) -> list[WindowKey | None]:
        changed: list[WindowKey | None] = []
        windows = self.windows
        for key in windows if only is None else only:
            window = windows[key]
            low, high = window.spec.interval(ref)
            a, b = window.low, window.high
            if low == a and high == b:
                continue
            if a >= b:  # nothing was in the window: fill it
                a = b = high
            # Rows leave [a, b) below ``low`` and from ``high`` up, then enter [low,
            # high) below ``a`` and from ``b`` up (each only where it is not empty).
            moved = 0
            end = min(b, low)
            if a < end:
                moved += self._each(a, end, rows, window, -1)
            start = max(a, high)
            if start < b:
                moved += self._each(start, b, rows, window, -1)
            end = min(high, a)
            if low < end:
                moved += self._each(low, end, rows, window, 1)
            start = max(low, b)
            if start < high:
                moved += self._each(start, high, rows, window, 1)
            window.low, window.high = low, high
            if moved:
                changed.append(key)
        return changed

    def _each(
        self, start: int, end: int, rows: Mapping[str, list[Any]], window: _Window, sign: int
    ) -> int:
        first = bisect_left(self.order, (start,))
        last = bisect_left(self.order, (end,), first)
        if last > first:
            keys = self.order[first:last]
            for group in window.groups.values():
                group.take(keys, rows, sign)
        return last - first

    # -- reading ------------------------------------------------------------------------------

    def group(self, window: WindowKey | None, where: tuple[tuple[str, Any], ...]) -> _Group:
        return self.windows[window].groups[where]

    def newest(
        self,
        window: WindowKey | None,
        where: tuple[tuple[str, Any], ...],
        column: str,
        n: int,
        rows: Mapping[str, list[Any]],
    ) -> list[Any]:
        """The ``column`` values of the ``n`` newest rows in the window matching ``where``."""
        span = self.windows[window]
        order = self.order
        first = bisect_left(order, (span.low,))
        index = bisect_left(order, (span.high,), first) - 1
        picked: list[Any] = []
        if n <= 0:
            return picked
        # Read at every time a schedule's window moves: no generator per row, and a
        # filter looked at only where there is one.
        while index >= first:
            values = rows[order[index][4]][_VALS]
            index -= 1
            if where and any(values.get(k) != v for k, v in where):
                continue
            value = values.get(column)
            if value is not None:
                picked.append(value)
                if len(picked) == n:
                    break
        return picked


def top_values(group: _Group, column: str, n: int) -> list[Any]:
    """Most frequent first; ties: the value whose newest row is newest (event time,
    source position, then row key: never equal for two values)."""
    counts = group.counters[column]
    stamps = group.stamps[column]
    ranked = sorted(counts, key=lambda value: (counts[value], stamps[value][-1]), reverse=True)
    return ranked[:n]
