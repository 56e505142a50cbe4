"""How the ranker's feature source turns the edge cache's errors into HTTP answers."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from edge_cache import PoolExhaustedError, RegionUnavailableError, UnknownEntityError
from workers.exceptions import FeatureLookupError, QueueFullError
from workers.features import EdgeCacheFeatureSource, pool_size


class _Raising:
    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    async def get(self, *args: Any, **kwargs: Any) -> Any:
        raise self.exc


async def test_an_exhausted_lookup_pool_sheds_with_429_and_retry_after() -> None:
    exc = PoolExhaustedError("busy", "eu-west", retry_after_s=0.25)
    source = EdgeCacheFeatureSource(_Raising(exc), owns_client=False)  # type: ignore[arg-type]
    with pytest.raises(QueueFullError) as raised:
        await source.get("item", ["a"])
    assert raised.value.http_status == 429
    assert raised.value.retry_after_s == 0.25
    assert raised.value.retryable


async def test_an_unavailable_region_is_still_a_retryable_503() -> None:
    exc = RegionUnavailableError("down", "eu-west", (("eu-west", "timed out"),))
    source = EdgeCacheFeatureSource(_Raising(exc), owns_client=False)  # type: ignore[arg-type]
    with pytest.raises(FeatureLookupError) as raised:
        await source.get("item", ["a"])
    assert raised.value.http_status == 503


def test_pool_is_sized_for_two_lookups_per_request() -> None:
    assert pool_size(256) == 512
    assert pool_size(0) == 2


class _Table:
    """A lookup client over a dict: value of feature f of id i is table[i][f]."""

    def __init__(self, table: dict[str, list[float]], delay: float = 0.0) -> None:
        self.table = table
        self.delay = delay
        self.calls: list[tuple[str, list[str], Any]] = []
        self.joint: list[list[str]] = []  # the entities of each get_many call

    async def get(self, entity: str, ids: list[str], features: Any, staleness: Any) -> Any:
        self.calls.append((entity, list(ids), features))
        if self.delay:
            await asyncio.sleep(self.delay)
        rows = [self.table.get(i, [math.nan, math.nan]) for i in ids]
        values = np.array(rows, dtype=np.float64).reshape(len(ids), 2)
        return SimpleNamespace(to_numpy=lambda: values, mask=np.isnan(values))

    async def get_many(
        self, lookups: list[tuple[str, list[str], Any]], staleness: Any, **options: Any
    ) -> list[Any]:
        """As AsyncFeatureClient.get_many: each lookup's answer or its error, in order."""
        self.joint.append([entity for entity, _, _ in lookups])
        answers: list[Any] = []
        for entity, ids, features in lookups:
            try:
                answers.append(await self.get(entity, ids, features, staleness))
            except Exception as exc:
                if not options.get("return_exceptions"):
                    raise
                answers.append(exc)
        return answers


TABLE = {"u1": [1.0, 2.0], "a": [10.0, 11.0], "b": [20.0, 21.0], "c": [30.0, 31.0]}


async def test_lookups_asked_together_are_one_lookup_per_entity_each_answer_its_own() -> None:
    client = _Table(TABLE)
    source = EdgeCacheFeatureSource(client, owns_client=False)  # type: ignore[arg-type]
    answers = await asyncio.gather(
        source.get("user", ["u1"], ["f", "g"]),
        source.get("item", ["c", "a"], ["f", "g"]),
        source.get("item", ["a", "zz", "b"], ["f", "g"]),  # zz: not in the cache
        source.get("item", ["b"], ["f", "g"]),
    )
    # one lookup per entity, each id once, in first-asked order
    assert sorted(client.calls) == [
        ("item", ["c", "a", "zz", "b"], ("f", "g")),
        ("user", ["u1"], ("f", "g")),
    ]
    assert (source.calls, source.lookups) == (4, 2)
    assert client.joint == [["user", "item"]]  # both in one call: one write, one round trip
    (users, user_mask), (first, _), (second, second_mask), (third, _) = answers
    assert users.tolist() == [[1.0, 2.0]] and not user_mask.any()
    assert first.tolist() == [[30.0, 31.0], [10.0, 11.0]]
    assert first.dtype == np.float32
    assert second[0].tolist() == [10.0, 11.0] and second[2].tolist() == [20.0, 21.0]
    assert second_mask.tolist() == [[False, False], [True, True], [False, False]]
    assert third.tolist() == [[20.0, 21.0]]


async def test_a_different_feature_list_is_a_separate_lookup() -> None:
    client = _Table(TABLE)
    source = EdgeCacheFeatureSource(client, owns_client=False)  # type: ignore[arg-type]
    await asyncio.gather(source.get("item", ["a"], ["f", "g"]), source.get("item", ["a"], None))
    assert len(client.calls) == 2 and client.joint == [["item", "item"]]


async def test_in_a_joint_lookup_each_entity_gets_its_own_error_typed() -> None:
    """The user's lookup fails (an entity the region's schemas lack), the items' is
    answered: each asker gets its own group's outcome."""

    class _Partial(_Table):
        async def get(self, entity: str, ids: list[str], features: Any, staleness: Any) -> Any:
            if entity == "user":
                raise UnknownEntityError("unknown entity type 'user'")
            return await super().get(entity, ids, features, staleness)

    source = EdgeCacheFeatureSource(_Partial(TABLE), owns_client=False)  # type: ignore[arg-type]
    answers: list[Any] = await asyncio.gather(
        source.get("user", ["u1"]), source.get("item", ["a"]), return_exceptions=True
    )
    user, items = answers
    assert isinstance(user, FeatureLookupError) and user.http_status == 500
    assert "schemas disagree" in str(user)
    assert not isinstance(items, BaseException) and items[0].tolist() == [[10.0, 11.0]]


async def test_a_failed_coalesced_lookup_fails_every_request_of_it_typed() -> None:
    exc = RegionUnavailableError("down", "eu-west", (("eu-west", "timed out"),))
    source = EdgeCacheFeatureSource(_Raising(exc), owns_client=False)  # type: ignore[arg-type]
    results = await asyncio.gather(
        source.get("item", ["a"]), source.get("item", ["b"]), return_exceptions=True
    )
    assert all(isinstance(r, FeatureLookupError) and r.http_status == 503 for r in results)


async def test_a_joint_lookup_that_breaks_fails_its_askers_never_leaves_them_hanging() -> None:
    """get_many raising (a bug, not a lookup's error): every asker of every group gets
    the error (a 500), none is cancelled or left waiting."""

    class _Broken(_Table):
        async def get_many(self, *args: Any, **kwargs: Any) -> list[Any]:
            raise RuntimeError("broken client")

    source = EdgeCacheFeatureSource(_Broken(TABLE), owns_client=False)  # type: ignore[arg-type]
    answers = await asyncio.wait_for(
        asyncio.gather(
            source.get("user", ["u1"]),
            source.get("item", ["a"]),
            source.get("item", ["b"]),
            return_exceptions=True,
        ),
        timeout=5,
    )
    assert all(isinstance(a, RuntimeError) and "broken" in str(a) for a in answers), answers


async def test_a_shed_joint_lookup_is_a_429_for_every_asker() -> None:
    exc = PoolExhaustedError("busy", "eu-west", retry_after_s=0.25)

    class _Busy(_Table):
        async def get(self, *args: Any, **kwargs: Any) -> Any:
            raise exc

    source = EdgeCacheFeatureSource(_Busy(TABLE), owns_client=False)  # type: ignore[arg-type]
    answers = await asyncio.gather(
        source.get("user", ["u1"]), source.get("item", ["a"]), return_exceptions=True
    )
    assert all(isinstance(a, QueueFullError) and a.http_status == 429 for a in answers)
    assert all(a.retry_after_s == 0.25 for a in answers)  # type: ignore[union-attr]


async def test_a_cancelled_request_leaves_the_others_of_its_lookup_answered() -> None:
    client = _Table(TABLE, delay=0.05)
    source = EdgeCacheFeatureSource(client, owns_client=False)  # type: ignore[arg-type]
    gone = asyncio.ensure_future(source.get("item", ["a"]))
    kept = asyncio.ensure_future(source.get("item", ["b"]))
    await asyncio.sleep(0.01)  # the lookup is in flight
    gone.cancel()
    values, mask = await kept
    assert values.tolist() == [[20.0, 21.0]] and not mask.any()
    assert gone.cancelled()
    await source.aclose()


async def test_without_coalescing_every_call_is_its_own_lookup() -> None:
    client = _Table(TABLE)
    source = EdgeCacheFeatureSource(client, owns_client=False, coalesce=False)  # type: ignore[arg-type]
    await asyncio.gather(source.get("item", ["a"]), source.get("item", ["b"]))
    assert [ids for _, ids, _ in client.calls] == [["a"], ["b"]]
    with pytest.raises(ValueError, match="coalesce_turns -1"):
        EdgeCacheFeatureSource(client, coalesce_turns=-1)  # type: ignore[arg-type]
