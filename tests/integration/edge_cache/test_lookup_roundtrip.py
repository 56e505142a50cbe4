"""Values round-trip exactly from the writer to dicts, NumPy and Arrow, on a single
server and on a Redis Cluster, through the sync and the async client."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest
from edge_cache_stack import READ_TIMEOUT_S

from edge_cache import (
    AsyncFeatureClient,
    Feature,
    FeatureClient,
    FeatureSchema,
    FeatureWriter,
    Position,
    RegionSettings,
    UnknownEntityError,
    UnknownFeatureError,
    Upsert,
)

pytestmark = pytest.mark.integration
pytest_plugins = ["edge_cache_stack"]

ITEM = FeatureSchema(
    "item",
    (
        Feature("ctr", "float32"),
        Feature("price", "float32"),
        Feature("clicks", "int64"),
        Feature("rank", "int32"),
        Feature("in_stock", "bool"),
        Feature("score", "float64"),
        Feature("emb0", "float32"),
    ),
)

EXTREMES = [
    {
        "ctr": np.float32(0.1),
        "price": np.float32(-0.0),
        "clicks": 2**63 - 1,
        "rank": -(2**31),
        "in_stock": True,
        "score": 1 / 3,
        "emb0": np.float32(1e-45),
    },
    {
        "ctr": np.float32(3.4028235e38),
        "price": np.float32(-1.5),
        "clicks": -(2**63),
        "rank": 7,
        "in_stock": False,
        "score": -1e300,
        "emb0": np.float32(-2.5),
    },
    {"ctr": np.float32(0.25), "clicks": 0},  # partly missing
]


def _write(writer: FeatureWriter, commit: datetime) -> None:
    ops = [
        Upsert("item", f"sku-{i}", values, Position(100 + i), commit)
        for i, values in enumerate(EXTREMES)
    ]
    assert writer.write(ops) == [True, True, True]


def _expected(values: dict[str, object], name: str) -> object:
    value = values.get(name)
    if value is None:
        return None
    if isinstance(value, np.floating):
        return float(value)
    return value


def _check_all_forms(result: object, commit: datetime) -> None:
    from edge_cache import FeatureVectors

    assert isinstance(result, FeatureVectors)
    ids = ("sku-0", "sku-1", "sku-2", "sku-404")
    assert result.ids == ids
    assert result.features == ITEM.names
    # dicts: every value exact, in its own type
    rows = result.to_dicts()
    for row, values in zip(rows[:3], EXTREMES, strict=True):
        for name in ITEM.names:
            assert row[name] == _expected(values, name), name
            if row[name] is not None:
                assert type(row[name]) is type(_expected(values, name)), name
    assert rows[3] == dict.fromkeys(ITEM.names)
    # numpy: float64 matrix (mixed dtypes), NaN + mask where missing
    matrix = result.to_numpy()
    assert matrix.shape == (4, len(ITEM.names))
    assert matrix.dtype == np.float64
    for i, values in enumerate(EXTREMES):
        for j, name in enumerate(ITEM.names):
            expected = _expected(values, name)
            if expected is None:
                assert np.isnan(matrix[i, j]) and not result.present[i, j]
            elif name != "clicks":  # int64 extremes are not exact in float64; see dicts/arrow
                assert matrix[i, j] == float(expected), name  # type: ignore[arg-type]
                assert result.present[i, j]
    assert np.isnan(matrix[3]).all() and not result.present[3].any()
    assert np.signbit(matrix[0, 1])  # -0.0 survives
    assert list(result.found) == [True, True, True, False]
    # arrow: typed columns, nulls where missing
    table = result.to_arrow()
    assert table.column("entity_id").to_pylist() == list(ids)
    assert str(table.schema.field("ctr").type) == "float"
    assert str(table.schema.field("clicks").type) == "int64"
    assert str(table.schema.field("rank").type) == "int32"
    assert str(table.schema.field("in_stock").type) == "bool"
    for name in ITEM.names:
        assert table.column(name).to_pylist() == [r[name] for r in rows], name
    commit_times = table.column("commit_time").to_pylist()
    assert commit_times[:3] == [commit] * 3 and commit_times[3] is None
    assert table.schema.metadata[b"edgefeed.region"] == b"eu-west"
    # freshness per row
    assert result.commit_time[0] == np.datetime64(commit.replace(tzinfo=None), "us")
    assert np.isnat(result.commit_time[3])
    assert (result.write_time[:3] >= result.commit_time[:3]).all()


def test_sync_roundtrip_all_forms(
    home: RegionSettings, make_writer: Callable[..., FeatureWriter]
) -> None:
    commit = datetime.now(UTC).replace(microsecond=123456) - timedelta(seconds=1)
    _write(make_writer(home, [ITEM]), commit)
    with FeatureClient("eu-west", [home], [ITEM], timeout_s=READ_TIMEOUT_S) as client:
        result = client.get("item", ["sku-0", "sku-1", "sku-2", "sku-404"])
        assert result.region == "eu-west"
        _check_all_forms(result, commit)


async def test_async_roundtrip_all_forms(
    home: RegionSettings, make_writer: Callable[..., FeatureWriter]
) -> None:
    commit = datetime.now(UTC).replace(microsecond=654321) - timedelta(seconds=1)
    _write(make_writer(home, [ITEM]), commit)
    async with AsyncFeatureClient("eu-west", [home], [ITEM], timeout_s=READ_TIMEOUT_S) as client:
        result = await client.get("item", ["sku-0", "sku-1", "sku-2", "sku-404"])
        _check_all_forms(result, commit)


def test_float32_vectors_exact_and_selected(
    home: RegionSettings, make_writer: Callable[..., FeatureWriter]
) -> None:
    schema = FeatureSchema.of("user", [f"f{i}" for i in range(50)], personal=True)
    rng = np.random.default_rng(7)
    data = rng.standard_normal((100, 50)).astype(np.float32)
    writer = make_writer(home, [schema])
    writer.write(
        [
            Upsert(
                "user",
                i,
                dict(zip(schema.names, row.tolist(), strict=True)),
                Position(1),
                time.time(),
            )
            for i, row in enumerate(data)
        ]
    )
    with FeatureClient("eu-west", [home], [schema], timeout_s=READ_TIMEOUT_S) as client:
        result = client.get("user", list(range(100)))
        assert result.values.dtype == np.float32
        assert np.array_equal(result.values, data)
        assert result.present.all()
        picked = client.get("user", np.array([99, 3]), ["f49", "f0", "f7"])
        assert np.array_equal(picked.values, data[[99, 3]][:, [49, 0, 7]])
        assert picked.to_dicts()[0] == {
            "f49": float(data[99, 49]),
            "f0": float(data[99, 0]),
            "f7": float(data[99, 7]),
        }


def test_staleness_bound(
    regions: list[RegionSettings], make_writer: Callable[..., FeatureWriter]
) -> None:
    schema = FeatureSchema.of("user", ["a", "b"])
    writer = make_writer(regions[0], [schema])
    now = time.time()
    writer.write(
        [
            Upsert("user", "old", {"a": 1.0, "b": 2.0}, Position(1), now - 30),
            Upsert("user", "new", {"a": 3.0, "b": 4.0}, Position(2), now),
        ]
    )
    with FeatureClient("eu-west", regions, [schema], timeout_s=READ_TIMEOUT_S) as client:
        bounded = client.get("user", ["old", "new"], max_staleness=timedelta(seconds=10))
        assert list(bounded.stale) == [True, False]
        assert list(bounded.found) == [False, True]
        assert np.isnan(bounded.values[0]).all() and not bounded.present[0].any()
        assert list(bounded.values[1]) == [3.0, 4.0]
        assert bounded.to_dicts()[0] == {"a": None, "b": None}
        assert bounded.to_arrow().column("stale").to_pylist() == [True, False]
        # the freshness of the withheld row is still reported
        assert not np.isnat(bounded.commit_time[0])
        loose = client.get("user", ["old", "new"], max_staleness=60)
        assert list(loose.found) == [True, True] and not loose.stale.any()


def test_bad_input_errors_list_valid_names(regions: list[RegionSettings]) -> None:
    schema = FeatureSchema.of("user", ["a", "b"])
    with FeatureClient("eu-west", regions, [schema, ITEM], timeout_s=READ_TIMEOUT_S) as client:
        with pytest.raises(UnknownEntityError, match=r"'usr'.*item, user") as entity_error:
            client.get("usr", [1])
        assert isinstance(entity_error.value, ValueError)
        assert not entity_error.value.retryable
        with pytest.raises(UnknownFeatureError, match=r"'zz'.*valid: a, b"):
            client.get("user", [1], ["a", "zz"])
        empty = client.get("user", [])
        assert empty.values.shape == (0, 2) and empty.to_dicts() == []
        assert empty.to_arrow().num_rows == 0
        # the client keeps serving after bad input
        assert client.get("user", [1]).found.tolist() == [False]


def test_one_round_trip_per_call_whatever_the_number_of_ids(
    regions: list[RegionSettings], make_writer: Callable[..., FeatureWriter]
) -> None:
    import redis

    schema = FeatureSchema.of("user", ["a"])
    make_writer(regions[0], [schema]).write(
        [Upsert("user", i, {"a": float(i)}, Position(1), time.time()) for i in range(300)]
    )
    with (
        redis.Redis.from_url(regions[0].redis_url) as admin,
        FeatureClient("eu-west", regions, [schema], timeout_s=READ_TIMEOUT_S) as client,
    ):
        client.get("user", [0])  # connect
        admin.config_resetstat()
        result = client.get("user", list(range(300)))
        stats = admin.info("commandstats")
    assert result.values[:, 0].tolist() == [float(i) for i in range(300)]
    commands = {
        name: int(value["calls"])
        for name, value in stats.items()
        if not name.startswith(("cmdstat_config", "cmdstat_info"))  # the admin's own
    }
    # one write, one round trip: the MGET and the EXISTS that tells a key of another
    # Redis type (read as nil by MGET) from an absent one
    assert commands == {"cmdstat_mget": 1, "cmdstat_exists": 1}
