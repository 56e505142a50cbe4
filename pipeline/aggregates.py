"""The aggregates a feature can declare, one class each: adding an aggregate means
adding one class here and listing it in :data:`AGGREGATES`.

Each class says what its declaration needs (a column, ``n``, a window), the
stored dtype of its features, what the column's values must convert to, what
the window index must accumulate for it (:class:`~pipeline.windows.GroupSpec`),
and how to read its features' values from that index.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pipeline.windows import EXACT_SCALE, GroupSpec, TableIndex, WindowKey, top_values

if TYPE_CHECKING:
    from pipeline.settings import AggregateFeature
    from pipeline.windows import _Group

Reader = Callable[[TableIndex, Mapping[str, list[Any]]], list[Any]]
"""One declared aggregate's read bound to its window, filter and column: the index of
its table and the table's rows -> its features' values (:meth:`Aggregate.reader`)."""

__all__ = ["AGGREGATES", "Aggregate", "AggregateRead", "FeatureDtype", "aggregate_kind"]

FeatureDtype = Literal["float32", "float64", "int32", "int64", "bool"]


@dataclass(frozen=True, slots=True)
class AggregateRead:
    """What reading one declared aggregate from an entity's window index needs."""

    index: TableIndex
    rows: Mapping[str, list[Any]]
    window: WindowKey | None
    where: tuple[tuple[str, Any], ...]
    column: str
    n: int


class Aggregate(ABC):
    """One kind of aggregate (``agg:`` in the settings)."""

    name: ClassVar[str]
    needs_column: ClassVar[bool] = True
    takes_n: ClassVar[bool] = False  # one feature per rank: <name>.1 .. <name>.<n>
    needs_window: ClassVar[bool] = True
    default_dtype: ClassVar[FeatureDtype] = "float32"
    numeric: ClassVar[bool] = False  # the column's values must be numbers (float64)

    def column_dtype(self, feature: AggregateFeature) -> FeatureDtype | None:
        """The dtype the aggregated column's values are converted to (None: as they come)."""
        return "float64" if self.numeric else None

    def keep_last(self, feature: AggregateFeature) -> int:
        """Rows the state must keep whatever their age (last_n: its n newest)."""
        return 0

    def require(self, group: GroupSpec, column: str) -> None:  # noqa: B027 - most need nothing
        """Tell the window group what to accumulate for this aggregate (count needs
        nothing beyond the group's row count)."""

    @abstractmethod
    def read(self, at: AggregateRead) -> list[Any]:
        """The values of the aggregate's features (one, or ``n``)."""

    def reader(
        self, window: WindowKey | None, where: tuple[tuple[str, Any], ...], column: str, n: int
    ) -> Reader:
        """:meth:`read` bound to one declaration, resolved once: a vector reads every
        aggregate several times per cache write (its schedule)."""

        def read(index: TableIndex, rows: Mapping[str, list[Any]]) -> list[Any]:
            return self.read(AggregateRead(index, rows, window, where, column, n))

        return read


class _GroupAggregate(Aggregate):
    """An aggregate read from its window group's accumulators alone."""

    @abstractmethod
    def value(self, group: _Group, column: str, n: int) -> list[Any]:
        """The values of the aggregate's features from its group's accumulators."""

    def read(self, at: AggregateRead) -> list[Any]:
        return self.value(at.index.group(at.window, at.where), at.column, at.n)

    def reader(
        self, window: WindowKey | None, where: tuple[tuple[str, Any], ...], column: str, n: int
    ) -> Reader:
        value = self.value

        def read(index: TableIndex, rows: Mapping[str, list[Any]]) -> list[Any]:
            return value(index.windows[window].groups[where], column, n)

        return read


def _padded(values: list[Any], n: int) -> list[Any]:
    return values + [None] * (n - len(values))


class Count(_GroupAggregate):
    name = "count"
    needs_column = False
    default_dtype = "int64"

    def value(self, group: _Group, column: str, n: int) -> list[Any]:
        return [group.count]


class Sum(_GroupAggregate):
    name = "sum"
    numeric = True

    def require(self, group: GroupSpec, column: str) -> None:
        group.sums.add(column)

    def value(self, group: _Group, column: str, n: int) -> list[Any]:
        return [group.sums[column] / EXACT_SCALE]


class Mean(Sum):
    name = "mean"

    def value(self, group: _Group, column: str, n: int) -> list[Any]:
        present = group.present[column]
        return [group.sums[column] / (present * EXACT_SCALE) if present else None]


class Min(_GroupAggregate):
    name = "min"
    numeric = True

    def require(self, group: GroupSpec, column: str) -> None:
        group.sorted.add(column)

    def value(self, group: _Group, column: str, n: int) -> list[Any]:
        ordered = group.values[column]
        return [ordered[0] if ordered else None]


class Max(Min):
    name = "max"

    def value(self, group: _Group, column: str, n: int) -> list[Any]:
        ordered = group.values[column]
        return [ordered[-1] if ordered else None]


class DistinctCount(_GroupAggregate):
    name = "distinct_count"
    default_dtype = "int64"

    def require(self, group: GroupSpec, column: str) -> None:
        group.distinct.add(column)

    def value(self, group: _Group, column: str, n: int) -> list[Any]:
        return [len(group.counters[column])]


class _Ranked(Aggregate):
    takes_n = True
    default_dtype = "int64"

    def column_dtype(self, feature: AggregateFeature) -> FeatureDtype | None:
        dtype = feature.effective_dtype
        return None if dtype == "bool" else dtype


class LastN(_Ranked):
    """The ``n`` newest values, newest first; the only aggregate that may be unwindowed."""

    name = "last_n"
    needs_window = False

    def keep_last(self, feature: AggregateFeature) -> int:
        return feature.n or 0

    def read(self, at: AggregateRead) -> list[Any]:
        picked = at.index.newest(at.window, at.where, at.column, at.n, at.rows)
        return _padded(picked, at.n)

    def reader(
        self, window: WindowKey | None, where: tuple[tuple[str, Any], ...], column: str, n: int
    ) -> Reader:
        def read(index: TableIndex, rows: Mapping[str, list[Any]]) -> list[Any]:
            return _padded(index.newest(window, where, column, n, rows), n)

        return read


class TopK(_Ranked, _GroupAggregate):
    """The ``n`` most frequent values, most frequent first."""

    name = "top_k"

    def require(self, group: GroupSpec, column: str) -> None:
        group.distinct.add(column)
        group.stamped.add(column)

    def value(self, group: _Group, column: str, n: int) -> list[Any]:
        return _padded(top_values(group, column, n), n)


AGGREGATES: dict[str, Aggregate] = {
    kind.name: kind() for kind in (Count, Sum, Mean, Min, Max, DistinctCount, LastN, TopK)
}


def aggregate_kind(name: str) -> Aggregate:
    """The aggregate called ``name``.

    Raises:
        ValueError: no such aggregate; the message lists the known ones.
    """
    try:
        return AGGREGATES[name]
    except KeyError:
        raise ValueError(f"aggregate {name!r} is not one of: {', '.join(AGGREGATES)}") from None
