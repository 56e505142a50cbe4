"""The lookup's fast paths answer exactly as its general path (real redis-server).

On the sync face one id is read with ``GET`` alone; several with ``MGET`` and
``EXISTS`` in one write (the async face reads every call so; it is checked alike).
The sync face also keeps its connections checked out between calls instead of taking
them from redis-py's pool each time. Neither may change what a lookup answers."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import redis
import redis.asyncio as aioredis
from edge_cache_stack import READ_TIMEOUT_S
from prometheus_client import CollectorRegistry

from edge_cache import (
    AsyncFeatureClient,
    FeatureClient,
    FeatureSchema,
    FeatureVectors,
    FeatureWriter,
    KeyLayout,
    PoolExhaustedError,
    Position,
    RegionSettings,
    RegionUnavailableError,
    Schedule,
    UnknownEntityError,
    Upsert,
)

pytestmark = pytest.mark.integration
pytest_plugins = ["edge_cache_stack"]

USER = FeatureSchema.of("user", ["a", "b", "c"], personal=True)
TIMED = FeatureSchema.of("timed", ["w1", "w2"], slots=2)
KEYS = KeyLayout()
HOUR_US = 3_600_000_000


def _same(one: FeatureVectors, many: FeatureVectors, row: int) -> None:
    """Row 0 of ``one`` (read alone) is row ``row`` of ``many`` (read with others)."""
    assert one.region == many.region and one.rebuilding == many.rebuilding
    assert np.array_equal(one.values[0], many.values[row], equal_nan=True)
    assert one.values.dtype == many.values.dtype
    for name in ("present", "found", "stale"):
        assert np.array_equal(getattr(one, name)[0], getattr(many, name)[row]), name
    for name in ("commit_time", "write_time"):  # as integers: NaT is not equal to itself
        assert getattr(one, name).view(np.int64)[0] == getattr(many, name).view(np.int64)[row]
    assert one.to_dicts()[0] == many.to_dicts()[row]
    assert [reason for _, reason in one.corrupt] == [
        reason for index, reason in many.corrupt if index == row
    ]


def _seed(region: RegionSettings, writer: FeatureWriter, now: float) -> None:
    now_us = int(now * 1e6)
    old = now - 3600
    writer.write(
        [
            Upsert("user", "full", {"a": 1.0, "b": 2.0, "c": 3.0}, Position(1), now),
            Upsert("user", "partial", {"a": 1.5}, Position(1), now),
            Upsert("user", "old", {"a": 4.0, "b": 5.0, "c": 6.0}, Position(1), old),
            Upsert("user", "gone", {"a": 7.0}, Position(1), now),
            Upsert(
                "timed",
                "taken",  # its first patch took over a minute ago
                {"w1": 1.0, "w2": 1.0},
                Position(1),
                now,
                schedule=Schedule(
                    ((now_us - 60_000_000, {"w1": 2.0}), (now_us + HOUR_US, {"w1": 3.0})),
                    now_us + 2 * HOUR_US,
                ),
            ),
            Upsert(
                "timed",
                "waiting",  # its first patch takes over in a minute
                {"w1": 1.0, "w2": 1.0},
                Position(1),
                now,
                schedule=Schedule(((now_us + 60_000_000, {"w1": 2.0, "w2": 2.0}),), None),
            ),
        ]
    )
    writer.delete("user", "gone", Position(2), now)
    with redis.Redis.from_url(region.redis_url) as plain:
        plain.set(KEYS.key("user", "garbage"), b"EF\x01not a vector")
        plain.hset(KEYS.key("user", "hash"), mapping={"a": "1"})
        plain.set(KEYS.key("user", "nan"), plain.get(KEYS.key("user", "full")) or b"")
        # a NaN stored by someone else: feature b of "nan" (float32 at offset 44)
        plain.setrange(KEYS.key("user", "nan"), 44, np.float32("nan").tobytes())


def _compare(get: Callable[..., FeatureVectors], now: float) -> None:
    users = ["full", "partial", "old", "gone", "absent", "garbage", "hash", "nan"]
    for bound in (None, 60.0):
        many = get("user", users, max_staleness=bound)
        for row, entity_id in enumerate(users):
            _same(get("user", [entity_id], max_staleness=bound), many, row)
        assert many.stale.tolist() == [False, False, bound is not None, *[False] * 5]
    assert many.found.tolist() == [True, True, False, False, False, False, False, True]
    assert [row for row, _ in many.corrupt] == [5, 6]
    timed = ["taken", "waiting", "absent"]
    for at in (None, now + 120, now + 2 * 3600 + 60):
        many = get("timed", timed, at=at)
        for row, entity_id in enumerate(timed):
            _same(get("timed", [entity_id], at=at), many, row)
    assert get("timed", timed).to_dicts()[:2] == [
        {"w1": 2.0, "w2": None},
        {"w1": 1.0, "w2": 1.0},
    ]


@pytest.mark.parametrize("face", ["sync", "async"])
def test_one_id_reads_as_many_ids_do(
    regions: list[RegionSettings], make_writer: Callable[..., FeatureWriter], face: str
) -> None:
    home = regions[0].model_copy(update={"failover": []})
    now = time.time()
    _seed(home, make_writer(home, [USER, TIMED]), now)
    registry = CollectorRegistry()
    options: dict[str, Any] = {"registry": registry, "timeout_s": READ_TIMEOUT_S}
    if face == "sync":
        with FeatureClient("eu-west", [home], [USER, TIMED], **options) as client:
            _compare(client.get, now)
    else:
        loop = asyncio.new_event_loop()
        aclient = AsyncFeatureClient("eu-west", [home], [USER, TIMED], **options)
        try:
            _compare(lambda *a, **kw: loop.run_until_complete(aclient.get(*a, **kw)), now)
        finally:
            loop.run_until_complete(aclient.close())
            loop.close()
    # each wrong-typed value counted once per call that met it
    wrong = {"region": "eu-west", "entity": "user", "reason": "wrong_type"}
    assert registry.get_sample_value("edgefeed_lookup_corrupt_values_total", wrong) == 4


def _refusing_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_residency_refusal_reads_the_same_for_one_id_and_many(
    regions: list[RegionSettings], make_writer: Callable[..., FeatureWriter]
) -> None:
    for region in regions:
        make_writer(region, [USER]).upsert("user", "u1", {"a": 1.0}, Position(1), time.time())
    dead = [
        regions[0].model_copy(update={"redis_url": f"redis://127.0.0.1:{_refusing_port()}/0"}),
        *regions[1:],
    ]
    errors: list[str] = []
    for ids in (["u1"], ["u1", "u2"]):
        with (
            FeatureClient("eu-west", dead, [USER], timeout_s=READ_TIMEOUT_S) as client,
            pytest.raises(RegionUnavailableError) as error,
        ):
            client.get("user", ids)
        errors.append(str(error.value))
    assert errors[0] == errors[1]
    assert "us-east: not tried: zone 'us' is outside residency zone 'eu'" in errors[0]


def test_a_kept_connection_the_server_closed_is_replaced_not_a_region_failure(
    regions: list[RegionSettings], make_writer: Callable[..., FeatureWriter]
) -> None:
    home = regions[0].model_copy(update={"failover": []})
    make_writer(home, [USER]).upsert("user", "u1", {"a": 1.0}, Position(1), time.time())
    registry = CollectorRegistry()
    with FeatureClient(
        "eu-west", [home], [USER], registry=registry, timeout_s=READ_TIMEOUT_S
    ) as client:
        for ids in (["u1"], ["u1", "u2"]):
            assert client.get("user", ids).found[0]
            with redis.Redis.from_url(home.redis_url) as admin:
                assert admin.client_kill_filter(_type="normal", skipme=True) >= 1
            # the idle connection now holds the server's close: taken again, it is
            # reconnected first, as redis-py's pool would
            result: Any = client.get("user", ids)
            assert result.found[0] and result.region == "eu-west"
        assert client.breakers["eu-west"].state == "closed"
    failures = [
        sample
        for family in registry.collect()
        if family.name == "edgefeed_lookup_region_failures"
        for sample in family.samples
    ]
    assert failures == []


# -- several lookups in one call (AsyncFeatureClient.get_many): the ranker's user and
# items read in one write and one round trip, each answer what get alone gives --------

USERS = ["full", "partial", "old", "gone", "absent", "garbage", "hash", "nan"]
TIMES = ["taken", "waiting", "absent"]


def _equal(one: FeatureVectors, other: FeatureVectors) -> None:
    assert one.ids == other.ids and one.region == other.region
    assert one.rebuilding == other.rebuilding
    assert np.array_equal(one.values, other.values, equal_nan=True)
    for name in ("present", "found", "stale"):
        assert np.array_equal(getattr(one, name), getattr(other, name)), name
    for name in ("commit_time", "write_time"):  # as integers: NaT is not equal to itself
        assert np.array_equal(
            getattr(one, name).view(np.int64), getattr(other, name).view(np.int64)
        )
    assert one.to_dicts() == other.to_dicts() and one.corrupt == other.corrupt


def _run(client: AsyncFeatureClient, coroutine: Any) -> Any:
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coroutine(client))
    finally:
        loop.run_until_complete(client.close())
        loop.close()


def test_lookups_read_together_answer_as_each_alone_in_one_write(
    regions: list[RegionSettings],
    make_writer: Callable[..., FeatureWriter],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    home = regions[0].model_copy(update={"failover": []})
    now = time.time()
    _seed(home, make_writer(home, [USER, TIMED]), now)
    writes: list[int] = []  # the MGETs in each write that holds any
    send = aioredis.Connection.send_packed_command

    async def counted(self: Any, command: Any, check_health: bool = True) -> None:
        data = command if isinstance(command, bytes) else b"".join(command)
        if b"MGET" in data:
            writes.append(data.count(b"\r\nMGET\r\n"))
        await send(self, command, check_health)

    monkeypatch.setattr(aioredis.Connection, "send_packed_command", counted)

    async def check(client: AsyncFeatureClient) -> None:
        for entity in ("user", "timed"):  # the schemas read, a connection made
            await client.get(entity, ["full"])
        for bound, at in ((None, None), (60.0, None), (None, now + 2 * 3600 + 60)):
            del writes[:]
            both = await client.get_many(
                [("user", USERS, None), ("timed", TIMES, ["w1"])], max_staleness=bound, at=at
            )
            assert writes == [2]  # both lookups' MGET (and EXISTS) in one write
            alone = [
                await client.get("user", USERS, max_staleness=bound, at=at),
                await client.get("timed", TIMES, ["w1"], max_staleness=bound, at=at),
            ]
            for together, single in zip(both, alone, strict=True):
                assert isinstance(together, FeatureVectors)
                _equal(single, together)
        assert client.breakers[home.name].state == "closed"

    registry = CollectorRegistry()
    _run(
        AsyncFeatureClient(
            home.name, [home], [USER, TIMED], registry=registry, timeout_s=READ_TIMEOUT_S
        ),
        check,
    )


def test_each_lookup_gets_its_own_error_and_the_others_their_answer(
    regions: list[RegionSettings], make_writer: Callable[..., FeatureWriter]
) -> None:
    home = regions[0].model_copy(update={"failover": []})
    _seed(home, make_writer(home, [USER, TIMED]), time.time())

    async def check(client: AsyncFeatureClient) -> None:
        lookups: list[Any] = [
            ("user", ["full"], None),
            ("nobody", ["x"], None),
            ("timed", ["taken"], None),
        ]
        answers = await client.get_many(lookups, return_exceptions=True)
        assert isinstance(answers[0], FeatureVectors) and answers[0].found.tolist() == [True]
        assert isinstance(answers[1], UnknownEntityError) and "nobody" in str(answers[1])
        assert isinstance(answers[2], FeatureVectors) and answers[2].found.tolist() == [True]
        with pytest.raises(UnknownEntityError, match="nobody"):
            await client.get_many(lookups)
        assert await client.get_many([]) == []

    _run(AsyncFeatureClient(home.name, [home], [USER, TIMED], timeout_s=READ_TIMEOUT_S), check)


def test_a_region_down_fails_every_lookup_read_with_it_as_get_does(
    regions: list[RegionSettings],
) -> None:
    dead = regions[0].model_copy(
        update={"failover": [], "redis_url": f"redis://127.0.0.1:{_refusing_port()}/0"}
    )

    async def check(client: AsyncFeatureClient) -> None:
        answers = await client.get_many(
            [("user", ["a", "b"], None), ("timed", ["c"], None)], return_exceptions=True
        )
        assert all(isinstance(answer, RegionUnavailableError) for answer in answers)
        for answer, entity in zip(answers, ("user", "timed"), strict=True):
            assert f"entity type {entity!r}" in str(answer)
            assert f"{dead.name}: connection failed" in str(answer)

    _run(AsyncFeatureClient(dead.name, [dead], [USER, TIMED], timeout_s=READ_TIMEOUT_S), check)


def test_a_joint_read_cut_by_its_deadline_leaves_the_connections_clean(
    regions: list[RegionSettings], make_writer: Callable[..., FeatureWriter]
) -> None:
    """The server pauses past the deadline mid-call: both lookups fail as the region's
    timeout (nothing else was answered meanwhile), the half-read connection is never
    reused (the next calls read their own replies), and every connection permit is back."""
    home = regions[0].model_copy(update={"failover": []})
    _seed(home, make_writer(home, [USER, TIMED]), time.time())

    async def check(client: AsyncFeatureClient) -> None:
        lookups: list[Any] = [("user", ["full"], None), ("timed", ["taken"], None)]
        await client.get_many(lookups)  # schemas read, a connection made
        admin = aioredis.Redis.from_url(home.redis_url)
        try:
            await admin.execute_command("CLIENT", "PAUSE", 600, "ALL")  # type: ignore[no-untyped-call]
            answers = await client.get_many(lookups, timeout_s=0.2, return_exceptions=True)
        finally:
            await admin.aclose()
        assert all(isinstance(answer, RegionUnavailableError) for answer in answers)
        assert all("timed out after 0.2 s" in str(answer) for answer in answers)
        assert client.gates[home.name]._value == client.max_connections
        deadline = time.monotonic() + 10
        while True:  # the pause ends, then the breaker lets a probe through
            again = await client.get_many(lookups, return_exceptions=True)
            if all(isinstance(answer, FeatureVectors) for answer in again):
                break
            assert time.monotonic() < deadline, again
            await asyncio.sleep(0.1)
        user, timed = again
        assert isinstance(user, FeatureVectors) and user.to_dicts() == [
            {"a": 1.0, "b": 2.0, "c": 3.0}
        ]
        assert isinstance(timed, FeatureVectors) and timed.ids == ("taken",)
        assert client.gates[home.name]._value == client.max_connections

    _run(
        AsyncFeatureClient(
            home.name, [home], [USER, TIMED], timeout_s=READ_TIMEOUT_S, breaker_reset_s=0.2
        ),
        check,
    )


def test_no_connection_in_time_sheds_every_joint_lookup_as_this_process_overload(
    regions: list[RegionSettings], make_writer: Callable[..., FeatureWriter]
) -> None:
    home = regions[0].model_copy(update={"failover": []})
    _seed(home, make_writer(home, [USER, TIMED]), time.time())

    async def check(client: AsyncFeatureClient) -> None:
        lookups: list[Any] = [("user", ["full"], None), ("timed", ["taken"], None)]
        await client.get_many(lookups)
        await client.gates[home.name].acquire()  # another call holds the one connection
        try:
            answers = await client.get_many(lookups, timeout_s=0.05, return_exceptions=True)
        finally:
            client.gates[home.name].release()
        assert all(isinstance(answer, PoolExhaustedError) for answer in answers)
        assert client.breakers[home.name].state == "closed"  # not the region's failure
        assert all(isinstance(a, FeatureVectors) for a in await client.get_many(lookups))
        assert client.gates[home.name]._value == 1

    _run(
        AsyncFeatureClient(
            home.name, [home], [USER, TIMED], timeout_s=READ_TIMEOUT_S, max_connections=1
        ),
        check,
    )
