"""The load of benchmarks/scale.py: users and items, each event a function of
(user, round), packed into messages as the router sends them."""

from __future__ import annotations

import math
import random
import zlib
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import Any

from pipeline.messages import RegionalChange, encode_packs

DAY_MS = 86_400_000
PARTITIONS = 4
CHANGES_PER_MESSAGE = 100  # the router's packs under load
KINDS = ("view",) * 6 + ("click",) * 2 + ("add_to_cart", "purchase")


def event_row(event_id: int, user: int, item: int, at: int, rng: random.Random) -> dict[str, Any]:
    return {
        "event_id": event_id,
        "user_id": user,
        "item_id": item,
        "category_id": item % 20,
        "price": round(rng.uniform(1, 200), 2),
        "home_region": "eu-west",
        "kind": rng.choice(KINDS),
        "occurred_at": at * 1000,
    }


_M64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finalizer: a well-spread 64-bit hash of ``x`` (the load's
    draws, so that any event is computed alone: the bulk build needs each
    entity's events without generating everyone's)."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


class Load:
    """The load: ``users`` users with ``events`` events each over the day before
    ``now_ms``; the r-th event of every user falls in the r-th slice of the day, and
    round r gives every user its r-th event (a stream interleaves its entities).
    Every event two regional changes: its user's and its item's (one item per 10
    users). Each event is a function of (user, round), and each item's events are
    found without the others' (its users in a round are a residue class of a
    permutation of the users), so that the bulk build computes an entity's events
    alone, the very ones the stream carries."""

    def __init__(self, users: int, events: int, now_ms: int, seed: int) -> None:
        self.users, self.events, self.now_ms, self.seed = users, events, now_ms, seed
        self.items = max(1, users // 10)
        self.slice_ms = DAY_MS // events
        step = 0x9E3779B1
        while math.gcd(step, users) != 1:
            step += 2
        self.step, self.inverse = step, pow(step, -1, users) if users > 1 else 0

    def item_of(self, user: int, r: int) -> int:
        return 1 + (((user - 1) * self.step) % self.users + r) % self.items

    def users_of(self, item: int, r: int) -> list[int]:
        """The users whose r-th event is on ``item``, in order."""
        first = (item - 1 - r) % self.items
        found = [1 + (w * self.inverse) % self.users for w in range(first, self.users, self.items)]
        found.sort()
        return found

    def event(self, user: int, r: int) -> tuple[RegionalChange, RegionalChange]:
        """The user's r-th event: its user's change and its item's."""
        event_id = r * self.users + user
        draw = _mix((self.seed << 48) ^ event_id)
        at = self.now_ms - DAY_MS + r * self.slice_ms + draw % self.slice_ms
        item = self.item_of(user, r)
        row = {
            "event_id": event_id,
            "user_id": user,
            "item_id": item,
            "category_id": item % 20,
            "price": round(1 + (draw >> 24) % 19_901 / 100, 2),
            "home_region": "eu-west",
            "kind": KINDS[(draw >> 48) % len(KINDS)],
            "occurred_at": at * 1000,
        }
        lsn, pk = 1_000 + event_id, str(event_id)
        return (
            RegionalChange("public.events", "c", lsn, 0, at, "user", user, pk, row),
            RegionalChange("public.events", "c", lsn, 1, at, "item", item, pk, row),
        )

    def stream(self) -> Iterator[RegionalChange]:
        for r in range(self.events):
            for user in range(1, self.users + 1):
                yield from self.event(user, r)

    def entity_keys(self) -> Iterator[str]:
        """Every entity's key: the users, then the items."""
        for user in range(1, self.users + 1):
            yield f"user:{user}"
        for item in range(1, self.items + 1):
            yield f"item:{item}"

    def changes_of(self, key: str) -> list[RegionalChange]:
        """The entity's changes in the stream, in stream order."""
        entity, _, raw = key.partition(":")
        number = int(raw)
        if entity == "user":
            return [self.event(number, r)[0] for r in range(self.events)]
        return [
            self.event(user, r)[1] for r in range(self.events) for user in self.users_of(number, r)
        ]


def changes(users: int, events: int, now_ms: int, seed: int) -> Iterator[RegionalChange]:
    """The load's changes in stream order (see :class:`Load`)."""
    return Load(users, events, now_ms, seed).stream()


def partition_of(key: str) -> int:
    """The router's key partitioning (a stable hash: the bulk build, the worker it
    kills and the one restarted after it are other processes)."""
    return zlib.crc32(key.encode()) % PARTITIONS


def messages(users: int, events: int, now_ms: int, seed: int) -> Iterator[tuple[int, list[bytes]]]:
    """The load's (partition, packs), see :func:`pack_changes`."""
    return pack_changes(changes(users, events, now_ms, seed))


def numbered(stream: Iterable[tuple[int, list[bytes]]]) -> Iterator[tuple[int, int, bytes]]:
    """Each message of ``stream`` as (partition, offset, body), offsets from 1."""
    offsets: dict[int, int] = defaultdict(int)
    for partition, packs in stream:
        for body in packs:
            offsets[partition] += 1
            yield partition, offsets[partition], body


def pack_changes(stream: Iterable[RegionalChange]) -> Iterator[tuple[int, list[bytes]]]:
    """(partition, packs) by CHANGES_PER_MESSAGE changes, per partition as the router's
    key partitioning sends them."""
    pending: dict[int, list[bytes]] = {p: [] for p in range(PARTITIONS)}
    for change in stream:
        partition = partition_of(change.key or "")
        bodies = pending[partition]
        bodies.append(change.encode())
        if len(bodies) >= CHANGES_PER_MESSAGE:
            yield partition, encode_packs(bodies)
            pending[partition] = []
    for partition, bodies in pending.items():
        if bodies:
            yield partition, encode_packs(bodies)
