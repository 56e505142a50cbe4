"""The SQL feature source: rows in request order, NaN for ids without a row, and
typed errors (the real database is in tests/integration/edgefeed/test_lab.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import psycopg
import pytest

from workers.exceptions import FeatureLookupError, WorkerConfigError
from workers.sqlfeatures import SqlFeatureQuery, SqlFeatureSource

QUERY = SqlFeatureQuery("SELECT id, a, b FROM t WHERE id = ANY(%(ids)s)", ("a", "b"))


class _Cursor:
    def __init__(self, pool: _Pool) -> None:
        self.pool = pool

    async def __aenter__(self) -> _Cursor:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def execute(self, sql: str, params: dict[str, Any]) -> None:
        if self.pool.error is not None:
            raise self.pool.error
        self.pool.executed.append((sql, params))

    async def fetchall(self) -> list[tuple[Any, ...]]:
        return self.pool.rows


class _Conn:
    def __init__(self, pool: _Pool) -> None:
        self.pool = pool

    def cursor(self) -> _Cursor:
        return _Cursor(self.pool)


class _Pool:
    """Stands in for psycopg_pool.AsyncConnectionPool: hands out one fake connection."""

    def __init__(self, rows: list[tuple[Any, ...]], error: Exception | None = None) -> None:
        self.rows = rows
        self.error = error
        self.executed: list[tuple[str, dict[str, Any]]] = []
        self.closed = False

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[_Conn]:
        yield _Conn(self)

    async def close(self) -> None:
        self.closed = True


def _source(pool: _Pool) -> SqlFeatureSource:
    return SqlFeatureSource(pool, {"user": QUERY})  # type: ignore[arg-type]


async def test_rows_come_back_in_request_order_with_nan_for_ids_without_a_row() -> None:
    pool = _Pool([("9", 9.0, None), ("3", 3.0, 30.0)])  # the database's order, a NULL
    values, mask = await _source(pool).get("user", ["3", "7", "9"])
    np.testing.assert_array_equal(values[0], [3.0, 30.0])
    assert np.isnan(values[1]).all() and mask[1].all(), "id 7 has no row: missing"
    assert values[2][0] == 9.0 and np.isnan(values[2][1]) and mask[2].tolist() == [False, True]
    assert values.dtype == np.float32
    assert pool.executed == [(QUERY.sql, {"ids": ["3", "7", "9"]})], "one query for all ids"


async def test_a_subset_of_features_is_read_in_the_asked_order() -> None:
    pool = _Pool([("1", 1.0, 2.0)])
    values, _ = await _source(pool).get("user", ["1"], ["b", "a"])
    np.testing.assert_array_equal(values, [[2.0, 1.0]])


async def test_unknown_entities_and_features_are_not_retryable_500s() -> None:
    source = _source(_Pool([]))
    with pytest.raises(FeatureLookupError, match="no SQL feature query for entity 'item'") as e:
        await source.get("item", ["1"])
    assert e.value.http_status == 500 and not e.value.retryable
    with pytest.raises(FeatureLookupError, match=r"not \['c'\]") as e:
        await source.get("user", ["1"], ["a", "c"])
    assert not e.value.retryable


async def test_a_database_failure_is_a_retryable_503_without_the_connection_string() -> None:
    error = psycopg.OperationalError("connection to server at host=db password=hunter2 failed")
    with pytest.raises(FeatureLookupError) as e:
        await _source(_Pool([], error)).get("user", ["1"])
    assert e.value.http_status == 503 and e.value.retryable
    assert "hunter2" not in str(e.value) and "OperationalError" in str(e.value)


async def test_the_source_closes_the_pool_it_owns_only() -> None:
    owned, lent = _Pool([]), _Pool([])
    await _source(owned).aclose()
    await SqlFeatureSource(lent, {"user": QUERY}, owns_pool=False).aclose()  # type: ignore[arg-type]
    assert owned.closed and not lent.closed


def test_a_query_must_take_the_ids_parameter_and_name_its_features() -> None:
    with pytest.raises(WorkerConfigError, match=r"%\(ids\)s"):
        SqlFeatureQuery("SELECT id, a FROM t WHERE id = 1", ("a",))
    with pytest.raises(WorkerConfigError, match="at least one feature"):
        SqlFeatureQuery("SELECT id FROM t WHERE id = ANY(%(ids)s)", ())
