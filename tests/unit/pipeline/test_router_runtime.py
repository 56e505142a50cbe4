"""The router's runtime (pipeline.runtime.router) with in-memory ports: what is sent
where, when it is acked, where dead letters go (residency), and that the
dead-letter path never stops the router. The router on the real stack:
tests/integration/pipeline/test_pipeline_faults.py and test_pipeline_residency.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry

from edgefeed.settings import load_settings
from pipeline.homes import Home, HomeBook
from pipeline.messages import decode_pack
from pipeline.metrics import PipelineMetrics
from pipeline.routing import Router
from pipeline.runtime.router import DEAD_LETTER_MAX_BYTES, RouterRuntime, SourceRecord

ROOT = Path(__file__).resolve().parents[3]
SETTINGS = load_settings(ROOT / "examples" / "edgefeed.yaml", env={})
REGIONS = SETTINGS.region_names
T0 = 1_764_000_000_000
HUGE = 2**70  # no JSON integer a regional message may carry: the router dead-letters it
USERS, EVENTS, ITEMS = "edgefeed.public.users", "edgefeed.public.events", "edgefeed.public.items"
HOME_COLUMNS = {USERS: "home_region", EVENTS: "home_region", ITEMS: None}
TABLE_OF = {USERS: "users", EVENTS: "events", ITEMS: "items"}


class Ports:
    """Every port in memory, with one log of what happened in which order."""

    def __init__(self, refusals: int = 0) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.packs: list[tuple[str, int, bytes]] = []
        self.dead: list[tuple[str | None, bytes | None, bytes, dict[str, bytes]]] = []
        self.refusals = refusals  # dead letters the "broker" refuses first
        self.sleeps: list[float] = []

    # RegionalSink
    async def send(self, region: str, partition: int, pack: bytes) -> Any:
        self.packs.append((region, partition, pack))
        self.log.append(("send", region, partition))
        return len(self.packs)

    async def delivered(self, handles: Sequence[Any]) -> None:
        self.log.append(("delivered", tuple(handles)))

    # HomeRecords
    async def close(self) -> None:
        self.log.append(("homes",))

    # RecordAcker
    async def ack(self, record: SourceRecord) -> None:
        self.log.append(("ack", record.topic, record.offset))

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)


class DeadLetters:
    def __init__(self, ports: Ports) -> None:
        self.ports = ports

    async def send(
        self, region: str | None, key: bytes | None, value: bytes, headers: dict[str, bytes]
    ) -> None:
        if self.ports.refusals > 0:
            self.ports.refusals -= 1
            raise RuntimeError("MessageSizeTooLargeError: the broker refused it")
        self.ports.dead.append((region, key, value, dict(headers)))
        self.ports.log.append(("dead", region))


def runtime(ports: Ports, homes: HomeBook | None = None) -> RouterRuntime:
    router = Router(SETTINGS.entities, SETTINGS.tables(), REGIONS, homes or HomeBook())
    return RouterRuntime(
        router,
        home_columns=HOME_COLUMNS,
        partitions=4,
        partition_of=lambda key: sum(key.encode()) % 4,
        regional=ports,
        dead_letters=DeadLetters(ports),
        homes=ports,
        acker=ports,
        metrics=PipelineMetrics.create(CollectorRegistry()),
        app_id="edgefeed-router",
        sleep=ports.sleep,
    )


_offsets: dict[str, int] = {}


def record(topic: str, op: str, before: Any, after: Any, lsn: int) -> SourceRecord:
    body = {
        "op": op,
        "before": before,
        "after": after,
        "source": {"ts_ms": T0, "schema": "public", "table": TABLE_OF[topic], "lsn": lsn},
    }
    offset = _offsets[topic] = _offsets.get(topic, -1) + 1
    return SourceRecord(topic, 0, offset, b"k", json.dumps(body).encode())


def user(home: str, user_id: int = 7) -> dict[str, Any]:
    return {"user_id": user_id, "home_region": home, "country": "DE", "segment": 1}


def event(event_id: int, home: str, user_id: int = 7, price: Any = "10.00") -> dict[str, Any]:
    return {
        "event_id": event_id,
        "user_id": user_id,
        "item_id": 3,
        "category_id": 5,
        "price": price,
        "home_region": home,
        "kind": "view",
        "occurred_at": (T0 - 60_000) * 1000,
    }


def routed_tables(ports: Ports) -> dict[str, set[str]]:
    """Region -> the tables of the changes sent there."""
    out: dict[str, set[str]] = {}
    for region, _, pack in ports.packs:
        for body in decode_pack(pack)[0]:
            out.setdefault(region, set()).add(body["t"])
    return out


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_a_batch_is_routed_by_residency_and_acked_after_its_sends() -> None:
    ports = Ports()
    rt = runtime(ports)
    batch = [
        record(USERS, "c", None, user("eu-west"), 10),
        record(EVENTS, "c", None, event(1, "eu-west"), 11),
        record(ITEMS, "c", None, {"item_id": 3, "price": "9.50", "category_id": 5}, 12),
    ]
    run(rt.route_batch(batch))
    tables = routed_tables(ports)
    assert tables["eu-west"] == {"public.users", "public.events", "public.items"}
    for region in REGIONS:
        if region != "eu-west":
            assert tables[region] == {"public.items"}  # shared data: every region
    kinds = [entry[0] for entry in ports.log]
    # A new user's home is written after the sends it decided are delivered, and
    # the batch is acked after that.
    assert kinds.index("delivered") > max(i for i, k in enumerate(kinds) if k == "send")
    assert kinds.index("homes") > kinds.index("delivered")
    assert min(i for i, k in enumerate(kinds) if k == "ack") > kinds.index("homes")
    assert kinds.count("ack") == 3
    assert rt.routed == {(USERS, 0): batch[0].offset, (EVENTS, 0): 0, (ITEMS, 0): 0}
    assert rt.progress.is_set()


def test_changes_route_in_commit_order_across_topics() -> None:
    ports = Ports()
    rt = runtime(ports)
    # The event (lsn 21) was committed after the user's move to us-east (lsn 20),
    # though its topic was read first.
    run(rt.route_batch([record(USERS, "c", None, user("eu-west"), 5)]))
    ports.packs.clear()
    moved = record(USERS, "u", user("eu-west"), user("us-east"), 20)
    later = record(EVENTS, "c", None, event(2, "us-east"), 21)
    run(rt.route_batch([later, moved]))
    tables = routed_tables(ports)
    assert "public.events" in tables["us-east"]
    assert "public.events" not in tables.get("eu-west", set())


def test_a_truncate_reaches_every_partition_of_every_region() -> None:
    ports = Ports()
    run(runtime(ports).route_batch([record(ITEMS, "t", None, None, 30)]))
    assert {(region, partition) for region, partition, _ in ports.packs} == {
        (region, p) for region in REGIONS for p in range(4)
    }


# -- dead letters -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("what", "topic", "book", "row", "region", "whole"),
    [
        # shared data: the central topic, whole
        ("shared bad price", ITEMS, None, {"item_id": 3, "price": HUGE}, None, True),
        # a personal row naming a known region, no home known: that region, whole
        ("event, no home", EVENTS, None, event(3, "us-east", price=HUGE), "us-east", True),
        # the book knows the user lives in eu-west: the row goes there, whatever
        # region it names (a forged or corrupt row must not carry it elsewhere)
        ("names us-east", EVENTS, "eu-west", event(4, "us-east", price=HUGE), "eu-west", True),
        ("names eu-west", EVENTS, "eu-west", event(5, "eu-west", price=HUGE), "eu-west", True),
        # a row of no known region and no known home: only a pointer, centrally
        ("unknown region", EVENTS, None, event(6, "mars"), None, False),
        # ...even if the book knows the user (the row itself is the problem: its
        # region is unknown, so it leaves the book's region as the only one)
        ("unknown, home known", EVENTS, "ap-southeast", event(7, "mars"), "ap-southeast", True),
    ],
)
def test_dead_letters_keep_residency(
    what: str, topic: str, book: str | None, row: Any, region: str | None, whole: bool
) -> None:
    homes = HomeBook()
    if book is not None:
        homes.records["user:7"] = Home(book, (1, 0)).to_record()
    ports = Ports()
    rt = runtime(ports, homes)
    bad = record(topic, "c", None, row, 40)
    run(rt.route_batch([bad]))
    assert not routed_tables(ports), what
    ((sent_region, _, value, _),) = ports.dead
    assert sent_region == region, what
    assert (value == bad.value) is whole, what
    if not whole:
        assert orjson.loads(value)["withheld"] == "personal row of an unknown region"
        assert b"mars" not in value and b"user_id" not in value
    assert ("ack", topic, bad.offset) in ports.log  # dead-lettered, then acked


def test_an_undecodable_personal_record_leaves_a_pointer() -> None:
    ports = Ports()
    broken = SourceRecord(EVENTS, 0, 99, b"k", b'{"op": "c", "after": {"user_id": 7, ')
    run(runtime(ports).route_batch([broken]))
    ((region, _, value, headers),) = ports.dead
    assert region is None and b"user_id" not in value
    assert headers["edgefeed-reason"] == b"undecodable"


def test_an_oversize_dead_letter_goes_as_a_pointer() -> None:
    ports = Ports()
    big = {"item_id": 3, "price": HUGE, "name": "x" * (DEAD_LETTER_MAX_BYTES + 10)}
    source = record(ITEMS, "c", None, big, 50)
    run(runtime(ports).route_batch([source]))
    ((region, key, value, headers),) = ports.dead
    assert region is None and key is None and len(value) < 1000
    letter = orjson.loads(value)
    assert letter["size"] == len(source.value or b"") and letter["offset"] == source.offset
    assert headers["edgefeed-withheld"] == b"value over the dead-letter size limit"


def test_a_refused_dead_letter_is_retried_as_a_pointer_never_raised() -> None:
    ports = Ports(refusals=3)
    source = record(ITEMS, "c", None, {"item_id": 3, "price": HUGE}, 60)
    run(runtime(ports).route_batch([source]))
    ((region, key, value, headers),) = ports.dead
    assert region is None and key is None
    assert orjson.loads(value)["withheld"] == "refused: RuntimeError"
    assert headers["edgefeed-withheld"] == b"dead letter refused by the broker"
    assert ports.sleeps == [0.5, 1.0, 2.0]  # backoff, then sent
    assert ("ack", ITEMS, source.offset) in ports.log


def test_a_failed_route_decides_no_home() -> None:
    """A change that fails after the router decided a move is dead-lettered and the
    move forgotten: the book still holds the old home."""
    homes = HomeBook()
    homes.records["user:7"] = Home("eu-west", (1, 0)).to_record()
    ports = Ports()
    rt = runtime(ports, homes)
    bad_move = record(USERS, "u", user("eu-west"), {**user("us-east"), "segment": HUGE}, 70)
    run(rt.route_batch([bad_move]))
    assert homes.get("user:7") == Home("eu-west", (1, 0))
    assert ports.dead and ports.dead[0][0] == "eu-west"
    assert "homes" not in [entry[0] for entry in ports.log]


def test_no_function_in_pipeline_is_longer_than_120_lines() -> None:
    import ast

    long = []
    for path in sorted((ROOT / "pipeline").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > 120:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} {lines}")
    assert not long, long
