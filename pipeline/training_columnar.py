"""The columnar engine of point-in-time training sets: the same values as replaying each
entity's history through the workers' engine per spine row (pipeline.training's
reference path), computed for a whole spine batch at once with numpy.

The history is replayed once, through the workers' own ``EntityEngine.apply`` (its
window index switched off: windows are read here), and each row version it left live
becomes an interval of read times. A version created by a change committed at ``c``
and replaced (updated, deleted, the entity removed) at ``c2`` is in the state at read
time t iff ``c <= t < c2``; it is in a window read at t iff its event time ``e``
satisfies ``e <= t < e + size`` (sliding: the window holds (t - size, t]) or ``e <= t <
end of e's bucket`` (tumbling, in the window's zone), or always (no window). So each
version counts for an aggregate exactly while t is in ``[max(c, e), min(c2, end(e)))``,
and an aggregate at t is one over the versions whose interval holds t ("stabbing"):

- count, sum, mean: cumulative sums over the intervals' starts minus over their ends
  (two ``searchsorted`` per read time). Sums are exact: each float64 is an integer
  multiple of 2**-emin, split in two 30-bit limbs summed in int64, rounded once (as the
  engine, which sums multiples of 2**-1074); a mean whose rounding cannot be decided in
  double-double arithmetic, a subnormal or a column of a wider range goes to Python's
  exact integer division;
- distinct_count: the same, over the union of each value's intervals;
- min, max, last_n, top_k: the intervals are split into chains along which both ends
  grow, so that the versions live at t are one contiguous run of each chain: min and
  max read a sparse table, last_n the run's newest n, top_k counts the runs' values.

Entities and times are one integer key, ``entity * M + rank(time)``, so one global
``searchsorted`` answers every entity's read times at once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.exceptions import PoisonEventError
from pipeline.features import EntityEngine, EntityState
from pipeline.messages import RegionalChange
from pipeline.rows import DEL, LSN, SEQ, VALS, T
from pipeline.windows import WindowKey, WindowSpec, pk_rank

__all__ = ["ColumnarHistory", "Unsupported"]

_NEVER = 1 << 62  # a version not replaced
_F32_MAX = 3.4028234663852886e38
_INT_MAX = {"int32": 2**31 - 1, "int64": 2**63 - 1}
_LIMB = 30
_MASK = (1 << _LIMB) - 1
_MAX_CHAINS = 64
# top_k counts in a rows x values table when it has at most a * pairs + b cells (few
# values), else by sorting the (row, value) pairs.
DENSE_TOP_K = (4, 4096)
_NUMERIC_DTYPES = ("float32", "float64")
_ARROW = {
    "float32": pa.float32(),
    "float64": pa.float64(),
    "int32": pa.int32(),
    "int64": pa.int64(),
    "bool": pa.bool_(),
}


class Unsupported(Exception):
    """What the columnar engine does not compute (the reference path does)."""


@dataclass(slots=True)
class _Table:
    """The live row versions of one table, every entity's, and their order in time."""

    entity: list[int] = field(default_factory=list)
    start: list[int] = field(default_factory=list)  # commit that made it live
    end: list[int] = field(default_factory=list)  # commit that replaced it (or _NEVER)
    entries: list[list[Any]] = field(default_factory=list)
    pks: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _Plan:
    """One aggregate over the versions that can count for it (where filter, value)."""

    kind: str
    names: tuple[str, ...]
    dtype: str
    s: np.ndarray  # interval start (raw ms), then composite key
    f: np.ndarray
    entity: np.ndarray
    order: np.ndarray  # time order of the versions (last_n, top_k ties)
    values: np.ndarray  # float64 / int64 / value codes
    fits: np.ndarray  # the value fits the feature's dtype (ranked kinds)
    decoded: np.ndarray | None = None  # value code -> value (distinct, top_k)
    built: dict[str, Any] = field(default_factory=dict)


def _bucket_ends(spec: WindowSpec, events: np.ndarray) -> np.ndarray:
    """The end of the tumbling bucket holding each event time."""
    size = spec.key[0] if spec.key is not None else 0
    if spec.key is not None and spec.key[2] == "UTC":
        ends: np.ndarray = events - events % size + size
        return ends
    order = np.argsort(events, kind="stable")
    ordered = events[order]
    ends = np.empty_like(ordered)
    i = 0
    while i < len(ordered):  # one zone lookup per occupied bucket
        end = spec.bucket(int(ordered[i]))[1]
        j = int(np.searchsorted(ordered, end, "left"))
        ends[i:j] = end
        i = j
    out = np.empty_like(ends)
    out[order] = ends
    return out


def _chains(rest: np.ndarray, s: np.ndarray, f: np.ndarray) -> list[np.ndarray]:
    """Split indices (in the order given) into chains along which ``s`` and ``f`` never
    fall: the versions live at a read time are then one run of each chain."""
    chains: list[np.ndarray] = []
    while len(rest):
        if len(chains) == _MAX_CHAINS:
            raise Unsupported(f"over {_MAX_CHAINS} chains (commit order far from event order)")
        rs, rf = s[rest], f[rest]
        top_s = np.maximum.accumulate(rs)
        top_f = np.maximum.accumulate(rf)
        keep = (rs >= top_s) & (rf >= top_f)
        chains.append(rest[keep])
        rest = rest[~keep]
    return chains


def _runs(chain: dict[str, np.ndarray], q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The run ``[lo, hi)`` of a chain live at each query key."""
    lo = np.searchsorted(chain["f"], q, "left")  # before: f <= t (or an earlier entity)
    hi = np.searchsorted(chain["s"], q, "left")  # before: s <= t (or an earlier entity)
    return lo, np.maximum(hi, lo)


def _sparse(values: np.ndarray, op: Callable[..., np.ndarray]) -> np.ndarray:
    """Levels of a sparse table: level j holds op over values[i : i + 2**j]."""
    levels = [values]
    width = 1
    while 2 * width <= len(values):
        prev = levels[-1]
        nxt = np.empty_like(values)
        nxt[: len(values) - 2 * width + 1] = op(prev[: -width or None], prev[width:])[
            : len(values) - 2 * width + 1
        ]
        levels.append(nxt)
        width *= 2
    return np.stack(levels)


def _range_op(table: np.ndarray, lo: np.ndarray, hi: np.ndarray, op: Any) -> np.ndarray:
    length = hi - lo
    some = length > 0
    level = np.zeros(len(lo), dtype=np.int64)
    level[some] = np.floor(np.log2(length[some])).astype(np.int64)
    left = np.where(some, lo, 0)
    right = np.where(some, hi - (np.int64(1) << level), 0)
    out = op(table[level, left], table[level, right])
    return np.where(some, out, np.nan)


def _limbs(values: np.ndarray) -> tuple[list[np.ndarray], int]:
    """Each float as an exact integer multiple of 2**emin, in signed 30-bit limbs
    (their sums over up to 2**33 values stay exact in int64)."""
    nonzero = values != 0
    if not nonzero.any():
        return [np.zeros(len(values), np.int64)], 0
    mant, exps = np.frexp(np.abs(values))
    ints = np.ldexp(mant, 53).astype(np.int64)  # the 53-bit mantissa
    low = np.where(nonzero, ints & -ints, 1).astype(np.float64)
    lowest = np.where(nonzero, exps - 53 + np.log2(low).astype(np.int64), 1 << 20)
    emin = int(lowest.min())
    shift = np.where(nonzero, exps - 53 - emin, 0)  # value = ints * 2**(emin + shift)
    top = int(shift.max()) + 53
    sign = np.where(values < 0, -1, 1).astype(np.int64)
    limbs = []
    for k in range(-(-top // _LIMB)):
        d = shift - _LIMB * k  # this limb holds ints shifted left by d, low 30 bits
        left = np.left_shift(ints, np.clip(d, 0, 63)) & _MASK
        right = np.right_shift(ints, np.clip(-d, 0, 63)) & _MASK
        limb = np.where(d >= _LIMB, 0, np.where(d >= 0, left, np.where(d > -53, right, 0)))
        limbs.append(sign * limb)
    return limbs, emin


def _python_sum(limbs: list[int], emin: int, n: int | None) -> float | None:
    """The engine's own arithmetic: exact integers, one correctly rounded division."""
    total = sum(d << (_LIMB * k) for k, d in enumerate(limbs))
    try:
        if emin >= 0:
            return float(total << emin) if n is None else (total << emin) / n
        return total / ((n or 1) << -emin)
    except OverflowError:
        return None


def _two_sum(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def _split(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    c = a * 134217729.0  # 2**27 + 1
    hi = c - (c - a)
    return hi, a - hi


def _two_product(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    p = a * b
    ah, al = _split(a)
    bh, bl = _split(b)
    return p, ((ah * bh - p) + ah * bl + al * bh) + al * bl


def _toward(q: np.ndarray, residual: np.ndarray) -> np.ndarray:
    step: np.ndarray = np.nextafter(q, np.where(residual > 0, np.inf, -np.inf))
    return step


def _rounded_quotient(
    high: np.ndarray, rest: np.ndarray, present: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(high + rest) / present rounded once (high, rest exact floats, their sum exact
    as an integer): the float quotient of the rounded sum can be one step off (two
    roundings); its exact residual, in double-double, says which neighbour is right.
    Residual and half-gap are multiples of a unit far above the double-double error,
    so comparing them is exact. Returns the quotients and what is left undecided."""
    count = present.astype(np.float64)
    q = (high + rest) / count

    def residual_of(q: np.ndarray) -> np.ndarray:
        prod, err = _two_product(q, count)
        x1, y1 = _two_sum(high, -prod)
        x2, y2 = _two_sum(x1, rest)
        out: np.ndarray = x2 + ((y1 + y2) - err)  # high + rest - q * count
        return out

    r = residual_of(q)
    half = np.abs(_toward(q, r) - q) * count / 2
    tie = np.abs(r) == half
    step = np.abs(r) > half
    q = np.where(step, _toward(q, r), q)
    # A tie goes to the even neighbour (round half to even).
    other = _toward(q, r)
    odd = (np.ldexp(np.frexp(q)[0], 53).astype(np.int64) & 1) == 1
    q = np.where(tie & odd, other, q)
    r2 = residual_of(q)
    half2 = np.abs(_toward(q, r2) - q) * count / 2
    undecided = (step & ~(np.abs(r2) < half2)) | ~np.isfinite(q)
    return q, undecided


def _normalised(limbs: list[np.ndarray]) -> tuple[list[np.ndarray], np.ndarray]:
    """Limbs of |T|, each in [0, 2**30) (one more at the top takes the carries), and
    T's sign."""
    carried = [x.copy() for x in limbs] + [np.zeros_like(limbs[0])]
    for k in range(len(carried) - 1):
        carried[k + 1] += carried[k] >> _LIMB
        carried[k] &= _MASK
    negative = carried[-1] < 0
    if negative.any():
        flipped = [np.where(negative, -x, x) for x in carried]
        for k in range(len(flipped) - 1):
            flipped[k + 1] += flipped[k] >> _LIMB
            flipped[k] &= _MASK
        carried = flipped
    return carried, np.where(negative, -1.0, 1.0)


def _exact_sums(
    limbs: list[np.ndarray], present: np.ndarray, emin: int, mean: bool
) -> tuple[np.ndarray, np.ndarray]:
    """The sum (or sum / present) of the limbs' integers times 2**emin, rounded once as
    the engine's exact integer division rounds it; values and a null mask.

    |T| is read from its top three nonzero limbs (up to 93 bits, split in two exact
    floats) scaled by 2**(30 * (top - 2)); lower nonzero limbs set the lowest bit
    (round to odd: the sum has at least 2 bits below its rounding position then)."""
    parts, sign = _normalised(limbs)
    k = len(parts)
    stack = np.stack(parts + [np.zeros_like(parts[0])] * 2)  # two zero limbs below 0
    stack = np.roll(stack, 2, axis=0)
    nonzero = stack != 0
    top = np.where(nonzero.any(axis=0), k + 1 - np.argmax(nonzero[::-1], axis=0), 2)
    top = np.maximum(top, 2)
    cols = np.arange(stack.shape[1])
    x2, x1, x0 = stack[top, cols], stack[top - 1, cols], stack[top - 2, cols]
    below = np.cumsum(nonzero, axis=0)[np.maximum(top - 3, 0), cols] * (top >= 3) > 0
    high = ((x2 << 7) + (x1 >> 23)).astype(np.float64) * 2.0**53
    rest = ((x1 & ((1 << 23) - 1)) << _LIMB | x0) | below
    rest_f = rest.astype(np.float64)
    scale = emin + _LIMB * (top - 4)
    undecided = below & mean
    if mean:
        total, unsure = _rounded_quotient(high, rest_f, np.maximum(present, 1))
        undecided |= unsure
    else:
        total = high + rest_f
    with np.errstate(over="ignore"):
        out = sign * np.ldexp(total, scale)
    undecided |= (out != 0) & (np.abs(out) < 2.0**-1022)
    null = ~np.isfinite(out)
    if mean:
        null |= present == 0
        undecided &= present > 0
    for i in np.flatnonzero(undecided):
        value = _python_sum([int(x[i]) for x in limbs], emin, int(present[i]) if mean else None)
        out[i] = np.nan if value is None else value
        null[i] = value is None
    return out, null


class ColumnarHistory:
    """An entity type's history as row-version intervals, and its features at any
    entity ids and read times, for a whole spine batch at once.

    Raises:
        Unsupported: a feature the columnar engine does not compute (its dtype).
    """

    def __init__(
        self, engine: EntityEngine, history: Mapping[str, list[tuple[int, RegionalChange]]]
    ):
        self.engine = engine
        self.ids = list(history)
        self._tables: dict[str, dict[str, Any]] = {}
        self._inverse = np.zeros(0, np.int64)
        self._check(engine)
        tables, records = self._replay(history)
        rec_entity, rec_commit, rec_served, rec_latest = records
        self.plans = [self._plan(p, tables.get(p.table, _Table())) for p in engine._reads]
        times = [np.asarray(rec_commit, np.int64)]
        for plan in self.plans:
            times += [plan.s, plan.f]
        self.times = np.unique(np.concatenate(times)) if times else np.zeros(0, np.int64)
        self.m = np.int64(len(self.times) + 1)
        entity = np.asarray(rec_entity, np.int64)
        self.rec_key = entity * self.m + np.searchsorted(
            self.times, np.asarray(rec_commit, np.int64)
        )
        self.rec_entity = entity
        self.rec_served = np.asarray(rec_served, bool)
        self.latest = {
            f.name: pa.array([v[f.name] for v in rec_latest], _ARROW[f.dtype])
            for f in engine.settings.latest
        }
        for plan in self.plans:
            self._build(plan)

    @staticmethod
    def _check(engine: EntityEngine) -> None:
        for plan in engine._reads:
            dtype = engine._dtypes[plan.names[0]]
            if dtype == "bool":
                raise Unsupported(f"{plan.names[0]}: dtype bool")

    def _replay(
        self, history: Mapping[str, list[tuple[int, RegionalChange]]]
    ) -> tuple[dict[str, _Table], tuple[list[int], list[int], list[bool], list[dict[str, Any]]]]:
        """Each entity's changes through the engine once; the versions they left live."""
        engine = self.engine
        latest_tables = {f.table for f in engine.settings.latest}
        owners = set(engine.own_tables)
        tables: dict[str, _Table] = {}
        rec_entity: list[int] = []
        rec_commit: list[int] = []
        rec_served: list[bool] = []
        rec_latest: list[dict[str, Any]] = []
        none = {f.name: None for f in engine.settings.latest}

        def close(key: tuple[str, str], at: int) -> None:
            table, index = tracked.pop(key)
            tables[table].end[index] = at

        def open_(code: int, key: tuple[str, str], entry: list[Any], at: int) -> None:
            table = tables.get(key[0])
            if table is None:
                table = tables[key[0]] = _Table()
            tracked[key] = (key[0], len(table.start))
            table.entity.append(code)
            table.start.append(at)
            table.end.append(_NEVER)
            table.entries.append(entry)
            table.pks.append(key[1])

        for code, key in enumerate(self.ids):
            state = EntityState(rows={}, lsn=0, rev=0, ts=0, gone=None)
            state.index = {}  # windows are read here, not kept by the engine
            tracked: dict[tuple[str, str], tuple[str, int]] = {}
            live: dict[tuple[str, str], list[Any]] = {}
            latest = none
            served: bool | None = None
            for commit, change in history[key]:
                before = state
                try:
                    state, _ = engine.apply(state, change)
                except PoisonEventError:
                    continue  # dead-lettered live: not counted
                if state.index is None:
                    state.index = {}
                state.changed = set()
                if state is not before:
                    keys = set(live) | {(t, pk) for t, rows in state["rows"].items() for pk in rows}
                else:
                    keys = {(change.table, change.pk)}
                for row_key in keys:
                    entry = state["rows"].get(row_key[0], {}).get(row_key[1])
                    if entry is not None and entry[DEL]:
                        entry = None
                    if live.get(row_key) is entry:
                        continue
                    if row_key in live:
                        close(row_key, commit)
                        del live[row_key]
                    if entry is not None:
                        open_(code, row_key, entry, commit)
                        live[row_key] = entry
                if state is not before or change.table in latest_tables:
                    latest = engine._checked(engine._latest(state)) if latest_tables else none
                if (
                    served is None
                    or state is not before
                    or change.table in owners
                    or state.get("gone") is not None
                ):
                    served = engine.served(state)
                rec_entity.append(code)
                rec_commit.append(commit)
                rec_served.append(served)
                rec_latest.append(latest)
        return tables, (rec_entity, rec_commit, rec_served, rec_latest)

    def _columns(self, name: str, table: _Table) -> dict[str, Any]:
        """A table's versions as arrays, with their time order (entity, event time,
        source position, key: the index's order), once per table."""
        cached = self._tables.get(name)
        if cached is None:
            events = [e[T] for e in table.entries]
            keys = sorted(
                range(len(events)),
                key=lambda i: (
                    table.entity[i],
                    events[i],
                    table.entries[i][LSN],
                    table.entries[i][SEQ],
                    pk_rank(table.pks[i]),
                ),
            )
            order = np.empty(len(events), np.int64)
            order[np.asarray(keys, np.int64)] = np.arange(len(events))
            cached = self._tables[name] = {
                "entity": np.asarray(table.entity, np.int64),
                "start": np.asarray(table.start, np.int64),
                "end": np.asarray(table.end, np.int64),
                "event": np.asarray(events, np.int64),
                "order": order,
                "where": {},
            }
        return cached

    def _plan(self, read: Any, table: _Table) -> _Plan:
        """The versions that can count for one aggregate, with their intervals."""
        kind, column, window = read.kind.name, read.column, read.window
        dtype = self.engine._dtypes[read.names[0]]
        arrays = self._columns(read.table, table)
        matching = arrays["where"].get(read.where)
        if matching is None:
            where = read.where
            matching = list(range(len(table.entries)))
            for column_name, wanted in where:  # one pass per filtered column
                entries = table.entries
                matching = [i for i in matching if entries[i][VALS].get(column_name) == wanted]
            arrays["where"][read.where] = matching
        if kind == "count":
            picked, values = matching, [0] * len(matching)
        else:
            got = [(i, table.entries[i][VALS].get(column)) for i in matching]
            picked = [i for i, v in got if v is not None]
            values = [v for _, v in got if v is not None]
        idx = np.asarray(picked, np.int64)
        start, end, events = arrays["start"][idx], arrays["end"][idx], arrays["event"][idx]
        s, f = self._interval(window, start, end, events)
        order, entity = arrays["order"][idx], arrays["entity"][idx]
        coded, fits, decoded = self._values(kind, dtype, values)
        visible = s < f
        return _Plan(
            kind,
            read.names,
            dtype,
            s[visible],
            f[visible],
            entity[visible],
            order[visible],
            coded[visible],
            fits[visible],
            decoded,
        )

    @staticmethod
    def _interval(
        window: WindowKey | None, start: np.ndarray, end: np.ndarray, events: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        if window is None:
            return start, end
        if window[1] == "sliding":
            leaves = events + window[0]
        else:
            leaves = _bucket_ends(WindowSpec(window), events)
        return np.maximum(start, events), np.minimum(end, leaves)

    @staticmethod
    def _values(
        kind: str, dtype: str, values: list[Any]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        n = len(values)
        fits = np.ones(n, bool)
        if kind == "count":
            return np.zeros(n, np.int64), fits, None
        if kind in ("sum", "mean", "min", "max"):
            return np.asarray(values, np.float64).reshape(n), fits, None
        codes: dict[Any, int] = {}
        coded = np.asarray([codes.setdefault(v, len(codes)) for v in values], np.int64)
        if kind == "distinct_count":
            return coded.reshape(n), fits, None
        firsts = list(codes)  # the first of equal values (1 == 1.0), as a Counter keeps it
        if dtype in _INT_MAX:
            if any(type(v) is not int for v in firsts):
                raise Unsupported(f"{kind} values that are not integers as {dtype}")
            top = _INT_MAX[dtype]
            fits = np.asarray([-top - 1 <= values[i] <= top for i in range(n)], bool)
            decoded = np.asarray(firsts, np.int64) if all(abs(v) < 2**63 for v in firsts) else None
            if decoded is None:
                raise Unsupported("values beyond int64")
        else:
            if any(type(v) not in (int, float) for v in firsts):
                raise Unsupported(f"{kind} values that are not numbers as {dtype}")
            decoded = np.asarray(firsts, np.float64)
            if dtype == "float32":
                fits = np.abs(np.asarray(values, np.float64)) <= _F32_MAX
        return coded.reshape(n), fits, decoded

    # -- the structures each aggregate reads ----------------------------------------------

    def _keys(self, plan: _Plan, times: np.ndarray) -> np.ndarray:
        return plan.entity * self.m + np.searchsorted(self.times, times)

    def _build(self, plan: _Plan) -> None:
        sk, fk = self._keys(plan, plan.s), self._keys(plan, plan.f)
        built = plan.built
        if plan.kind in ("count", "sum", "mean"):
            by_s, by_f = np.argsort(sk, kind="stable"), np.argsort(fk, kind="stable")
            built["s"], built["f"] = sk[by_s], fk[by_f]
            if plan.kind != "count":
                limbs, built["emin"] = _limbs(plan.values)
                zero = np.zeros(1, np.int64)
                built["cs"] = [np.concatenate([zero, np.cumsum(x[by_s])]) for x in limbs]
                built["cf"] = [np.concatenate([zero, np.cumsum(x[by_f])]) for x in limbs]
        elif plan.kind == "distinct_count":
            self._build_distinct(plan, sk, fk)
        else:
            if plan.kind == "last_n":
                order = np.argsort(plan.order, kind="stable")  # newest last in each run
            else:
                order = np.lexsort((fk, sk))
            built["chains"] = []
            for chain in _chains(order, sk, fk):
                part: dict[str, Any] = {"s": sk[chain], "f": fk[chain], "i": chain}
                if plan.kind in ("min", "max"):
                    op = np.minimum if plan.kind == "min" else np.maximum
                    part["table"] = _sparse(plan.values[chain], op)
                built["chains"].append(part)

    def _build_distinct(self, plan: _Plan, sk: np.ndarray, fk: np.ndarray) -> None:
        """The union of each (entity, value)'s intervals: one segment per stretch of
        read times the value is in the window, counted as a count is."""
        m = self.m
        if not len(sk):
            plan.built["s"], plan.built["f"] = sk, fk
            return
        s_rank, f_rank = sk - plan.entity * m, fk - plan.entity * m
        order = np.lexsort((f_rank, s_rank, plan.values, plan.entity))
        entity, value = plan.entity[order], plan.values[order]
        fresh = np.ones(len(order), bool)
        fresh[1:] = (entity[1:] != entity[:-1]) | (value[1:] != value[:-1])
        group = np.cumsum(fresh) - 1
        starts = group * m + s_rank[order]
        ends = np.maximum.accumulate(group * m + f_rank[order])
        new = np.ones(len(order), bool)
        new[1:] = starts[1:] >= ends[:-1]
        first = np.flatnonzero(new)
        last = np.append(first[1:] - 1, len(order) - 1).astype(np.int64)
        seg_s = sk[order][first]
        seg_f = entity[first] * m + (ends[last] - group[last] * m)
        plan.built["s"], plan.built["f"] = np.sort(seg_s), np.sort(seg_f)

    # -- reading ----------------------------------------------------------------------------

    def columns(self, codes: np.ndarray, times: np.ndarray) -> list[pa.Array]:
        """Every feature (the schema's order) of the entities ``codes`` (-1: unknown) at
        read times ``times`` (ms)."""
        known = codes >= 0
        # Sorted keys: each searchsorted below walks its array once, not at random.
        by_time = np.argsort(times)
        ranks = np.empty(len(times), np.int64)
        ranks[by_time] = np.searchsorted(self.times, times[by_time], "right")
        q = np.where(known, codes, 0) * self.m + ranks
        perm = np.argsort(q)
        inverse = np.empty_like(perm)
        inverse[perm] = np.arange(len(perm))
        self._inverse = inverse  # the features are put back in the spine's order
        q, codes, known = q[perm], codes[perm], known[perm]
        idx = np.searchsorted(self.rec_key, q, "left") - 1
        ok = known & (idx >= 0)
        if len(self.rec_key):
            at = np.maximum(idx, 0)
            ok &= (self.rec_entity[at] == codes) & self.rec_served[at]
        else:
            at = np.zeros(len(codes), np.int64)
        missing = ~ok
        out: dict[str, pa.Array] = {}
        if self.latest:
            take = pa.array(at[inverse], pa.int64(), mask=missing[inverse])
            out.update({name: values.take(take) for name, values in self.latest.items()})
        for plan in self.plans:
            out.update(self._read(plan, q, missing))
        return [out[f.name] for f in self.engine.schema.features]

    def _out(self, values: np.ndarray, dtype: str, null: np.ndarray) -> pa.Array:
        back = self._inverse
        return _arrow(values[back], dtype, null[back])

    def _read(self, plan: _Plan, q: np.ndarray, missing: np.ndarray) -> dict[str, pa.Array]:
        built, name = plan.built, plan.names[0]
        if plan.kind in ("count", "distinct_count"):
            counts = np.searchsorted(built["s"], q) - np.searchsorted(built["f"], q)
            return {name: self._out(counts.astype(np.int64), plan.dtype, missing)}
        if plan.kind in ("sum", "mean"):
            i, j = np.searchsorted(built["s"], q), np.searchsorted(built["f"], q)
            limbs = [cs[i] - cf[j] for cs, cf in zip(built["cs"], built["cf"], strict=True)]
            values, null = _exact_sums(limbs, i - j, built["emin"], plan.kind == "mean")
            return {name: self._out(values, plan.dtype, missing | null)}
        if plan.kind in ("min", "max"):
            op = np.fmin if plan.kind == "min" else np.fmax
            best = np.full(len(q), np.nan)
            for chain in built["chains"]:
                lo, hi = _runs(chain, q)
                best = op(best, _range_op(chain["table"], lo, hi, op))
            return {name: self._out(best, plan.dtype, missing | np.isnan(best))}
        if plan.kind == "last_n":
            return self._read_last(plan, q, missing)
        return self._read_top(plan, q, missing)

    def _ranked(
        self, plan: _Plan, rows: np.ndarray, q_count: int, picked: np.ndarray, missing: np.ndarray
    ) -> dict[str, pa.Array]:
        """``picked``: per query, the versions ranked 1..n (-1: none)."""
        decoded = plan.decoded if plan.decoded is not None else np.zeros(1, np.int64)
        out = {}
        for rank, name in enumerate(plan.names):
            version = picked[:, rank] if picked.shape[1] > rank else np.full(q_count, -1)
            valid = version >= 0
            safe = np.where(valid, version, 0)
            null = missing | ~valid
            if len(plan.values):
                null |= ~plan.fits[safe]
                values = decoded[plan.values[safe]]
            else:
                values = np.zeros(q_count, decoded.dtype)
            out[name] = self._out(values, plan.dtype, null)
        return out

    def _read_last(self, plan: _Plan, q: np.ndarray, missing: np.ndarray) -> dict[str, pa.Array]:
        """The n newest live versions: each chain's run ends with its newest, so the
        n best heads of the chains are taken one at a time (a merge)."""
        n, count_q = len(plan.names), len(q)
        chains = plan.built["chains"]
        picked = np.full((count_q, n), -1, np.int64)
        if not chains:
            return self._ranked(plan, q, count_q, picked, missing)
        lows, highs = zip(*(_runs(chain, q) for chain in chains), strict=True)
        low, head = np.stack(lows, axis=1), np.stack(highs, axis=1) - 1  # rows x chains
        every = np.arange(count_q)
        for rank in range(n):
            live = head >= low
            newest = np.full(head.shape, -1, np.int64)
            for c, chain in enumerate(chains):
                at = np.where(live[:, c], head[:, c], 0)
                if len(chain["i"]):
                    newest[:, c] = np.where(live[:, c], plan.order[chain["i"][at]], -1)
            best = np.argmax(newest, axis=1)
            some = newest[every, best] >= 0
            for c, chain in enumerate(chains):
                take = some & (best == c)
                picked[take, rank] = chain["i"][head[take, c]]
                head[take, c] -= 1
        return self._ranked(plan, q, count_q, picked, missing)

    def _read_top(self, plan: _Plan, q: np.ndarray, missing: np.ndarray) -> dict[str, pa.Array]:
        """Count each value over the versions live at each read time; most frequent
        first, ties to the value whose newest version is newest."""
        n, count_q = len(plan.names), len(q)
        queries, versions = [], []
        for chain in plan.built["chains"]:
            lo, hi = _runs(chain, q)
            lengths = hi - lo
            total = int(lengths.sum())
            rows = np.repeat(np.arange(count_q), lengths)
            offsets = np.repeat(lo - (np.cumsum(lengths) - lengths), lengths)
            queries.append(rows)
            versions.append(chain["i"][np.arange(total) + offsets])
        picked = np.full((count_q, n), -1)
        if queries and sum(len(x) for x in queries):
            row = np.concatenate(queries)
            version = np.concatenate(versions)
            width = np.int64(max(int(plan.values.max()) + 1, 1))
            if count_q * int(width) <= DENSE_TOP_K[0] * len(row) + DENSE_TOP_K[1]:
                picked = _top_dense(row, plan.values[version], plan.order, version, count_q, n)
                return self._ranked(plan, q, count_q, picked, missing)
            span = np.int64(max(len(plan.order), 1))
            key = row * width + plan.values[version]
            if count_q * int(width) * int(span) < 2**62:  # one key: a plain sort
                order = np.argsort(key * span + plan.order[version])
            else:
                order = np.lexsort((plan.order[version], key))
            key, version = key[order], version[order]
            last = np.flatnonzero(np.append(key[1:] != key[:-1], True))
            first = np.append(0, last[:-1] + 1)
            counts, newest = last - first + 1, plan.order[version[last]]
            group_row = key[last] // width
            most = int(counts.max())
            if count_q * (most + 1) * int(span) < 2**62:
                ranked = np.argsort(
                    (group_row * (most + 1) + (most - counts)) * span + (span - 1 - newest)
                )
            else:
                ranked = np.lexsort((-newest, -counts, group_row))
            group_row = group_row[ranked]
            starts = np.searchsorted(group_row, group_row, "left")
            place = np.arange(len(ranked)) - starts
            keep = place < n
            picked[group_row[keep], place[keep]] = version[last][ranked][keep]
        return self._ranked(plan, q, count_q, picked, missing)


def _top_dense(
    row: np.ndarray, code: np.ndarray, order: np.ndarray, version: np.ndarray, rows: int, n: int
) -> np.ndarray:
    """top_k where there are few values: a rows x values table of counts and each
    value's newest version, then the n best per row (count, then newest)."""
    width = int(code.max()) + 1
    cell = row * width + code
    counts = np.bincount(cell, minlength=rows * width).reshape(rows, width)
    newest = np.full(rows * width, -1, np.int64)
    np.maximum.at(newest, cell, order[version])
    flat = np.full(rows * width, -1, np.int64)
    hit = newest[cell] == order[version]
    flat[cell[hit]] = version[hit]  # the newest version of each (row, value)
    span = np.int64(len(order) + 1)
    score = np.where(counts > 0, counts * span + newest.reshape(rows, width) + 1, 0)
    owner = flat.reshape(rows, width)
    picked = np.full((rows, n), -1, np.int64)
    for rank in range(min(n, width)):
        best = np.argmax(score, axis=1)
        some = score[np.arange(rows), best] > 0
        picked[some, rank] = owner[some, best[some]]
        score[np.arange(rows), best] = 0
    return picked


def _arrow(values: np.ndarray, dtype: str, null: np.ndarray) -> pa.Array:
    """Values as the feature's Arrow type; what the dtype cannot hold is null (as the
    engine's ``_checked``: a float in an integer feature, beyond float32's range)."""
    if dtype in _INT_MAX:
        if values.dtype.kind == "f":
            null = np.ones(len(values), bool)
            values = np.zeros(len(values), np.int64)
        elif dtype == "int32":
            null = null | (values > _INT_MAX["int32"]) | (values < -_INT_MAX["int32"] - 1)
        safe = np.where(null, 0, values).astype(np.int32 if dtype == "int32" else np.int64)
        return pa.array(safe, _ARROW[dtype], mask=null)
    floats = values.astype(np.float64)
    if dtype == "float32":
        null = null | ~(np.abs(floats) <= _F32_MAX)
        return pa.array(np.where(null, 0, floats).astype(np.float32), pa.float32(), mask=null)
    return pa.array(np.where(null, 0, floats), pa.float64(), mask=null)
