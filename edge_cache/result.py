"""The result of a lookup, as NumPy, dicts or a pyarrow Table.

The primary form is a dense ``rows x features`` NumPy matrix (missing values
are NaN, with a boolean ``present`` mask); dicts and Arrow keep each feature's
own dtype, so values round-trip exactly from the writer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from edge_cache.layout import Decoded, RecordLayout

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["FeatureVectors", "Projection"]

_NAT = np.iinfo(np.int64).min
_MICROS = np.dtype("datetime64[us]")
_MASKS: dict[tuple[bool, tuple[int, ...]], np.ndarray[Any, np.dtype[np.bool_]]] = {}


def _shared_mask(value: bool, shape: tuple[int, ...]) -> np.ndarray[Any, np.dtype[np.bool_]]:
    """A shared, read-only mask of ``value`` (the common cases: everything found,
    nothing withheld as stale), so that a lookup allocates none."""
    key = (value, shape)
    mask = _MASKS.get(key)
    if mask is None:
        if len(_MASKS) > 512:
            _MASKS.clear()
        mask = np.full(shape, value, dtype=np.bool_)
        mask.flags.writeable = False
        _MASKS[key] = mask
    return mask


_EXACT_IN_FLOAT32 = frozenset({"float32", "bool"})
# byte value -> its 8 bits, least significant first (the validity bitmap's order)
_BITS = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little").view(
    np.bool_
)


@dataclass(frozen=True, slots=True)
class Projection:
    """A chosen list of features of one schema, resolved to record positions once.

    Attributes:
        layout: The reader's record layout.
        names: Selected feature names, in output order.
        positions: Their storage positions.
        matrix_dtype: ``float32`` when every selected feature is float32 or bool
            (exact in float32), else ``float64``.
    """

    layout: RecordLayout
    names: tuple[str, ...]
    positions: np.ndarray[Any, np.dtype[np.intp]]
    matrix_dtype: np.dtype[Any] = field(init=False)
    _plan: tuple[tuple[str, np.ndarray[Any, Any], np.ndarray[Any, Any]], ...] = field(
        init=False, repr=False
    )
    _whole: str | None = field(init=False, repr=False)
    _columns: tuple[tuple[str, int, str], ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        features = self.layout.schema.features
        dtypes = [features[p].dtype for p in self.positions]
        exact32 = all(d in _EXACT_IN_FLOAT32 for d in dtypes)
        object.__setattr__(self, "matrix_dtype", np.dtype(np.float32 if exact32 else np.float64))
        run_of: dict[int, tuple[str, int]] = {}
        for run in self.layout.runs:
            for offset in range(run.count):
                run_of[run.start + offset] = (run.field, offset)
        plan: dict[str, tuple[list[int], list[int]]] = {}
        for column, position in enumerate(self.positions):
            run_field, offset = run_of[int(position)]
            cols, offs = plan.setdefault(run_field, ([], []))
            cols.append(column)
            offs.append(offset)
        object.__setattr__(
            self,
            "_plan",
            tuple(
                (f, np.asarray(c, np.intp), np.asarray(o, np.intp)) for f, (c, o) in plan.items()
            ),
        )
        whole = None
        runs = self.layout.runs
        if len(runs) == 1 and list(self.positions) == list(range(runs[0].count)):
            whole = runs[0].field
        object.__setattr__(self, "_whole", whole)
        object.__setattr__(
            self,
            "_columns",
            tuple((*run_of[int(p)], features[int(p)].dtype) for p in self.positions),
        )

    def matrix(self, records: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """The selected features of ``records`` as a new ``len x k`` matrix."""
        if self._whole is not None:
            return records[self._whole].astype(self.matrix_dtype, copy=True)
        out = np.empty((len(records), len(self.names)), dtype=self.matrix_dtype)
        # A float32 signalling NaN (only a corrupt value holds one: writers store NaN as
        # missing) warns when widened to float64; it reads as missing like any NaN.
        with np.errstate(invalid="ignore"):
            for run_field, cols, offs in self._plan:
                out[:, cols] = records[run_field][:, offs]
        return out

    def valid(self, records: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.bool_]]:
        """Which selected features of ``records`` have a value (``len x k`` bool)."""
        bits: np.ndarray[Any, np.dtype[np.bool_]] = _BITS[records["valid"]]
        return bits.reshape(len(records), -1)[:, self.positions]

    def column(self, records: np.ndarray[Any, Any], index: int) -> np.ndarray[Any, Any]:
        """Selected feature ``index`` of ``records`` in its own dtype."""
        run_field, offset, dtype = self._columns[index]
        values = records[run_field][:, offset]
        return values.astype(np.bool_) if dtype == "bool" else values

    def dtype_of(self, index: int) -> str:
        return self._columns[index][2]


@dataclass(frozen=True, slots=True)
class FeatureVectors:
    """Feature vectors of some entities of one type, as read from one region.

    Rows follow the requested ids; columns follow the requested features.

    Attributes:
        entity: Entity type.
        ids: The requested ids, in order.
        features: The returned feature names, in order.
        region: The region that served the call (differs from the client's home
            region after a failover).
        values: ``rows x features`` matrix, NaN where no value was served.
            float32 when every feature is float32/bool, else float64.
        present: Same shape, True where ``values`` holds a served value.
        found: Per row, True when the entity had a vector within the staleness bound.
        stale: Per row, True when a vector exists but is older than ``max_staleness``
            (its values are withheld). Like ``found`` and ``present``, it may be a
            shared read-only array.
        commit_time: Per row, source commit time (``datetime64[us]``, UTC; NaT if absent).
        write_time: Per row, cache write time (``datetime64[us]``, UTC; NaT if absent).
        corrupt: ``(row, reason)`` of each id whose cached value could not be read
            (not an edgefeed value, or a key of another Redis type): such a row reads
            as missing (``found`` False), and the reason names the key.
        near_hits: How many rows were answered by the in-process near cache (found or
            known absent).
        rebuilding: The region is rebuilding this entity type's history from the
            source (pipeline.history): windowed values may be short until it ends. A
            call with ``max_staleness`` withholds them (every row ``stale``).
    """

    entity: str
    ids: tuple[Any, ...]
    features: tuple[str, ...]
    region: str
    values: np.ndarray[Any, Any]
    present: np.ndarray[Any, np.dtype[np.bool_]]
    found: np.ndarray[Any, np.dtype[np.bool_]]
    stale: np.ndarray[Any, np.dtype[np.bool_]]
    commit_time: np.ndarray[Any, np.dtype[np.datetime64]]
    write_time: np.ndarray[Any, np.dtype[np.datetime64]]
    near_hits: int
    _records: np.ndarray[Any, Any] = field(repr=False)
    _rows: np.ndarray[Any, np.dtype[np.intp]] = field(repr=False)
    _projection: Projection = field(repr=False)
    corrupt: tuple[tuple[int, str], ...] = ()
    rebuilding: bool = False

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def mask(self) -> np.ndarray[Any, np.dtype[np.bool_]]:
        """True where a value is missing (NumPy masked-array convention)."""
        return ~self.present

    def to_numpy(self) -> np.ndarray[Any, Any]:
        """The ``rows x features`` matrix (NaN where missing; see :attr:`present`)."""
        return self.values

    def to_masked(self) -> np.ma.MaskedArray[Any, Any]:
        """The matrix as a NumPy masked array."""
        return np.ma.MaskedArray(self.values, mask=~self.present)

    def _typed(self, index: int) -> np.ndarray[Any, Any]:
        return self._projection.column(self._records, index)

    def to_dicts(self) -> list[dict[str, Any]]:
        """One dict per requested id: feature name -> value in its dtype, None if missing."""
        empty = dict.fromkeys(self.features)
        out = [dict(empty) for _ in self.ids]
        if not len(self._rows):
            return out
        present = self.present
        columns = [self._typed(j).tolist() for j in range(len(self.features))]
        for k, row in enumerate(self._rows.tolist()):
            target = out[row]
            mask_row = present[row]
            for j, name in enumerate(self.features):
                if mask_row[j]:
                    target[name] = columns[j][k]
        return out

    def to_arrow(self) -> pa.Table:
        """A pyarrow Table: ``entity_id``, one typed column per feature (null where
        missing), ``commit_time``, ``write_time`` (UTC timestamps) and ``stale``.
        The serving region and entity type are in the schema metadata."""
        import pyarrow as pa

        n = len(self.ids)
        rows = self._rows
        columns: dict[str, Any] = {"entity_id": _id_array(pa, self.ids)}
        for j, name in enumerate(self.features):
            typed = self._typed(j)
            full = np.zeros(n, dtype=typed.dtype)
            full[rows] = typed
            columns[name] = pa.array(full, mask=~self.present[:, j])
        ts = pa.timestamp("us", tz="UTC")
        missing_time = self.commit_time.view(np.int64) == _NAT
        columns["commit_time"] = pa.array(self.commit_time.view(np.int64), ts, mask=missing_time)
        columns["write_time"] = pa.array(self.write_time.view(np.int64), ts, mask=missing_time)
        columns["stale"] = pa.array(self.stale)
        table = pa.table(columns)
        return table.replace_schema_metadata(
            {"edgefeed.region": self.region, "edgefeed.entity": self.entity}
        )


def _id_array(pa: Any, ids: Sequence[Any]) -> Any:
    if all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return pa.array(list(ids), pa.int64())
    return pa.array([str(i) for i in ids], pa.string())


def build_vectors(
    *,
    entity: str,
    ids: tuple[Any, ...],
    region: str,
    projection: Projection,
    decoded: Decoded,
    now_us: int,
    max_staleness_us: int | None,
    near_hits: int,
    corrupt: tuple[tuple[int, str], ...] = (),
    rebuilding: bool = False,
) -> FeatureVectors:
    """Assemble a :class:`FeatureVectors` from decoded records (shared by both client faces)."""
    n = len(ids)
    k = len(projection.names)
    records = decoded.records
    rows = decoded.rows
    complete = decoded.complete
    stale = _shared_mask(False, (n,))
    if complete:
        commit = records["commit_us"].astype(np.int64)
        write = records["write_us"].astype(np.int64)
    else:
        commit = np.full(n, _NAT, dtype=np.int64)
        write = np.full(n, _NAT, dtype=np.int64)
        if len(rows):
            commit[rows] = records["commit_us"]
            write[rows] = records["write_us"]
    if max_staleness_us is not None and len(rows):
        if rebuilding:  # known short: no vector of the type is within a staleness bound
            too_old = np.ones(len(rows), dtype=np.bool_)
        else:
            too_old = (now_us - records["commit_us"]) > max_staleness_us
        if np.count_nonzero(too_old):
            stale = np.zeros(n, dtype=np.bool_)
            stale[rows[too_old]] = True
            fresh = ~too_old
            records = records[fresh]
            rows = rows[fresh]
            complete = False
    if complete:
        found = _shared_mask(True, (n,))
        values = projection.matrix(records)
        if decoded.all_valid:
            present = _shared_mask(True, (n, k))
        else:
            present = projection.valid(records)
            values[~present] = np.nan
    else:
        found = np.zeros(n, dtype=np.bool_)
        values = np.full((n, k), np.nan, dtype=projection.matrix_dtype)
        present = np.zeros((n, k), dtype=np.bool_)
        if len(rows):
            found[rows] = True
            values[rows] = projection.matrix(records)
            if decoded.all_valid:
                present[rows] = True
            else:
                valid = projection.valid(records)
                present[rows] = valid
                values[~present] = np.nan
    # A NaN stored in a float feature is no value: it reads as missing (the caller's
    # on_missing policy applies), like a feature the writer never had.
    nan = np.isnan(values)
    if np.count_nonzero(nan):  # a C call: ndarray.any() goes through Python first
        present = present & ~nan
    return FeatureVectors(  # positional: the hot path's construction, in field order
        entity,
        ids,
        projection.names,
        region,
        values,
        present,
        found,
        stale,
        commit.view(_MICROS),
        write.view(_MICROS),
        near_hits,
        records,
        rows,
        projection,
        corrupt,
        rebuilding,
    )
