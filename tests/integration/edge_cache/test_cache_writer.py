"""The writer on real Redis: ordered, idempotent, position-checked writes and deletes."""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable

import pytest
import redis
from edge_cache_stack import READ_TIMEOUT_S

from edge_cache import (
    AsyncFeatureWriter,
    CorruptValueError,
    Delete,
    FeatureClient,
    FeatureSchema,
    FeatureWriter,
    ForeignValueError,
    KeyLayout,
    Position,
    RegionSettings,
    Schedule,
    SchemaError,
    Upsert,
    WriteOp,
)

pytestmark = pytest.mark.integration
pytest_plugins = ["edge_cache_stack"]

USER = FeatureSchema.of("user", ["a", "b"])


def _state(client: FeatureClient, ids: list[int]) -> list[object]:
    result = client.get("user", ids)
    return [
        row if found else None for row, found in zip(result.to_dicts(), result.found, strict=True)
    ]


def test_reordered_and_redelivered_events_converge(
    home: RegionSettings, make_writer: Callable[..., FeatureWriter]
) -> None:
    """Every permutation of a stream with duplicates ends in the in-order state."""
    now = time.time()
    events: list[WriteOp] = [
        Upsert("user", 1, {"a": 1.0}, Position(10, 0), now),
        Upsert("user", 1, {"a": 2.0, "b": 5.0}, Position(10, 1), now),
        Upsert("user", 2, {"a": 7.0}, Position(11, 0), now),
        Delete("user", 2, Position(12, 0), now),
        Upsert("user", 3, {"b": 9.0}, Position(12, 3), now),
        Upsert("user", 1, {"a": 3.0}, Position(2**40, 0), now),
    ]
    writer = make_writer(home, [USER])
    with FeatureClient("eu-west", [home], [USER], timeout_s=READ_TIMEOUT_S) as client:
        writer.write(events)
        expected = _state(client, [1, 2, 3])
        assert expected == [{"a": 3.0, "b": None}, None, {"a": None, "b": 9.0}]
        rng = random.Random(3)
        orders = list(itertools.permutations(events))
        for order in rng.sample(orders, 12):
            for key in KeyLayout().keys("user", [1, 2, 3]):
                writer.client.delete(key)
            shuffled = list(order) + rng.sample(events, 3)  # plus redeliveries
            if rng.random() < 0.5:
                writer.write(shuffled)  # one pipelined batch
            else:
                for op in shuffled:
                    writer.write([op])
            assert _state(client, [1, 2, 3]) == expected


def test_outcomes_and_tombstone(
    home: RegionSettings, make_writer: Callable[..., FeatureWriter]
) -> None:
    writer = make_writer(home, [USER], tombstone_ttl_s=600)
    now = time.time()
    assert writer.upsert("user", 5, {"a": 1.0}, Position(100), now) is True
    assert writer.upsert("user", 5, {"a": 1.0}, Position(100), now) is False  # redelivery
    assert writer.upsert("user", 5, {"a": 0.5}, Position(99), now) is False  # older
    assert writer.delete("user", 5, Position(101), now) is True
    # a late, older upsert cannot resurrect the deleted entity
    assert writer.upsert("user", 5, {"a": 9.0}, Position(100, 7), now) is False
    key = KeyLayout().key("user", 5)
    ttl_ms = writer.client.pttl(key)
    assert 0 < ttl_ms <= 600_000
    with FeatureClient("eu-west", [home], [USER], timeout_s=READ_TIMEOUT_S) as client:
        assert client.get("user", [5]).found.tolist() == [False]
        # a later upsert brings it back and clears the tombstone's TTL
        assert writer.upsert("user", 5, {"a": 4.0}, Position(102), now) is True
        assert client.get("user", [5]).to_dicts() == [{"a": 4.0, "b": None}]
    assert writer.client.pttl(key) == -1


def test_vector_ttl(
    regions: list[RegionSettings], make_writer: Callable[..., FeatureWriter]
) -> None:
    writer = make_writer(regions[0], [USER])
    writer.upsert("user", 6, {"a": 1.0}, Position(1), time.time(), ttl_s=30)
    assert 0 < writer.client.pttl(KeyLayout().key("user", 6)) <= 30_000


def test_script_reloaded_after_flush(
    regions: list[RegionSettings], make_writer: Callable[..., FeatureWriter]
) -> None:
    writer = make_writer(regions[0], [USER])
    assert writer.upsert("user", 1, {"a": 1.0}, Position(1), time.time())
    writer.client.script_flush()
    assert writer.upsert("user", 1, {"a": 2.0}, Position(2), time.time())


def test_foreign_value_is_refused_not_overwritten(
    regions: list[RegionSettings], make_writer: Callable[..., FeatureWriter]
) -> None:
    writer = make_writer(regions[0], [USER])
    key = KeyLayout().key("user", 1)
    writer.client.set(key, b"someone else's data")
    with pytest.raises(ForeignValueError, match="not an edgefeed value") as refused:
        writer.upsert("user", 1, {"a": 1.0}, Position(1), time.time())
    # Per key and for good: a CorruptValueError, and a ValueError the pipeline
    # quarantines the entity for (not a dependency's blip it would retry forever).
    assert isinstance(refused.value, CorruptValueError | ValueError)
    assert writer.client.get(key) == b"someone else's data"
    other = KeyLayout().key("user", 2)
    writer.client.rpush(other, b"a list")  # another Redis type under an entity key
    with pytest.raises(ForeignValueError, match=r"user:2.*another Redis type"):
        writer.upsert("user", 2, {"a": 1.0}, Position(1), time.time())
    assert writer.client.lrange(other, 0, -1) == [b"a list"]


def test_publish_schemas(
    regions: list[RegionSettings], make_writer: Callable[..., FeatureWriter]
) -> None:
    writer = make_writer(regions[0], [USER])
    writer.publish_schemas()
    writer.publish_schemas()  # idempotent
    stored = writer.client.get(KeyLayout().schema_key("user", 1))
    assert FeatureSchema.from_json(stored) == USER
    clash = make_writer(regions[0], [FeatureSchema.of("user", ["a", "c"])])
    with pytest.raises(SchemaError, match=r"different schema.*FeatureSchema\.evolve"):
        clash.publish_schemas()


async def test_async_writer_same_semantics(home: RegionSettings) -> None:
    async with AsyncFeatureWriter.from_region(home, [USER]) as writer:
        await writer.publish_schemas()
        now = time.time()
        assert await writer.write(
            [
                Upsert("user", 1, {"a": 1.0}, Position(5), now),
                Upsert("user", 1, {"a": 0.0}, Position(4), now),
                Delete("user", 2, Position(5), now),
                Upsert("user", 2, {"a": 1.0}, Position(4), now),
            ]
        ) == [True, False, True, False]
        assert await writer.upsert("user", 1, {"b": 2.0}, Position(6), now)
        assert not await writer.delete("user", 1, Position(6), now)
    with FeatureClient("eu-west", [home], [USER], timeout_s=READ_TIMEOUT_S) as client:
        assert _state(client, [1, 2]) == [{"a": None, "b": 2.0}, None]


def test_batch_is_one_round_trip(
    regions: list[RegionSettings], make_writer: Callable[..., FeatureWriter]
) -> None:
    """A batch of N ops is sent as one pipeline: the server sees N EVALSHA in one read."""
    writer = make_writer(regions[0], [USER])
    writer.upsert("user", 0, {"a": 0.0}, Position(1), time.time())  # script loaded
    sent: list[int] = []
    original = writer.client.pipeline

    def counting_pipeline(*args: object, **kwargs: object) -> redis.client.Pipeline:
        pipe = original(*args, **kwargs)  # type: ignore[arg-type]
        execute = pipe.execute

        def wrapped(*a: object, **k: object) -> list[object]:
            sent.append(len(pipe.command_stack))
            return execute(*a, **k)  # type: ignore[arg-type]

        pipe.execute = wrapped  # type: ignore[method-assign]
        return pipe

    writer.client.pipeline = counting_pipeline  # type: ignore[method-assign]
    ops = [Upsert("user", i, {"a": float(i)}, Position(2), time.time()) for i in range(50)]
    assert all(writer.write(ops))
    assert sent == [50]


def test_a_scheduled_value_is_renewed_at_the_same_position_and_read_as_of_the_read_time(
    home: RegionSettings, make_writer: Callable[..., FeatureWriter]
) -> None:
    """The write script takes a scheduled value at the stored position when it was
    written later (a renewal of its schedule), never an earlier one, and never an
    unscheduled value at the same position."""
    timed = FeatureSchema.of("clicks", {"n": "int64"}, slots=2)
    clock = {"now": 1_000.0}
    writer = make_writer(home, [USER, timed], clock=lambda: clock["now"])
    now_us = int(time.time() * 1e6)

    def value(n: int, later: int) -> Upsert:
        patch = (now_us + 3_600_000_000, {"n": later})
        return Upsert("clicks", 1, {"n": n}, Position(50), 1.0, schedule=Schedule((patch,)))

    assert writer.write([value(3, 2)]) == [True]
    clock["now"] = 900.0
    assert writer.write([value(9, 9)]) == [False]  # written earlier: refused
    clock["now"] = 1_100.0
    assert writer.write([value(2, 0)]) == [True]  # the same state, renewed
    assert writer.write([value(1, 1)]) == [False]  # same write time: refused
    with FeatureClient("eu-west", [home], [USER, timed], timeout_s=READ_TIMEOUT_S) as client:
        assert client.get("clicks", [1]).to_dicts() == [{"n": 2}]
        later = client.get("clicks", [1], at=now_us / 1e6 + 3_601).to_dicts()
        assert later == [{"n": 0}]
    # Unscheduled values keep the strict rule: the same position is a redelivery.
    assert writer.upsert("user", 9, {"a": 1.0}, Position(50), 1.0) is True
    clock["now"] = 2_000.0
    assert writer.upsert("user", 9, {"a": 2.0}, Position(50), 1.0) is False
