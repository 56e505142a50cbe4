"""The router: source records in, regional messages out, dead letters that keep
residency, acks only for what was sent. The regional worker's shape
(:mod:`pipeline.runtime.region`), without Faust.

The router talks to the world through four ports, so that everything here runs
in unit tests without a broker (tests/unit/pipeline/test_router_runtime.py):

- :class:`RegionalSink`: the regional topics (a pack of encoded changes to a
  region's partition), and waiting for what was sent to be delivered;
- :class:`RouterDeadLetters`: the central dead-letter topic (``region`` None) and
  each region's own;
- :class:`HomeRecords`: the book of homes' changelog (make what the book flushed
  durable);
- :class:`RecordAcker`: acknowledges consumed source records.

Flow: :meth:`RouterRuntime.route_batch` decodes a batch of source records, routes
them in commit order (:class:`pipeline.routing.Router`), sends the packs, writes
the homes the batch decided once the messages they decided are delivered, and
only then acks the batch. A record that cannot be decoded, routed or encoded is
dead-lettered (:meth:`RouterRuntime.dead_letter`), never half-routed, and the
dead-letter path never stops the router (:meth:`RouterRuntime.send_dead`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from pipeline.envelope import Change, decode_change
from pipeline.exceptions import PoisonEventError
from pipeline.messages import encode_packs
from pipeline.metrics import PipelineMetrics
from pipeline.routing import Router

__all__ = [
    "DEAD_LETTER_MAX_BYTES",
    "HomeRecords",
    "RecordAcker",
    "RegionalSink",
    "RouterDeadLetters",
    "RouterRuntime",
    "SourceRecord",
    "dead_letter_headers",
    "pointer",
]

log = logging.getLogger("edgefeed.pipeline")

DEAD_LETTER_MAX_BYTES = 512 * 1024  # a dead letter's value; brokers refuse ~1 MB
DEAD_RETRY_FIRST_S, DEAD_RETRY_MAX_S = 0.5, 30.0  # a refused dead letter, tried again


@dataclass(frozen=True, slots=True)
class SourceRecord:
    """One consumed record of a Debezium topic.

    Attributes:
        handle: What the acker acknowledges (the Faust event); opaque here.
    """

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    handle: Any = None


class RegionalSink(Protocol):
    async def send(self, region: str, partition: int, pack: bytes) -> Any:
        """Queue ``pack`` for the region's topic partition; returns its delivery handle."""
        ...

    async def delivered(self, handles: Sequence[Any]) -> None:
        """Wait until every handle's record is acknowledged by the broker."""
        ...


class RouterDeadLetters(Protocol):
    async def send(
        self, region: str | None, key: bytes | None, value: bytes, headers: dict[str, bytes]
    ) -> None:
        """Send one dead letter to the region's topic (None: the central one) and wait
        for it; raises what the broker answers (a refused or undeliverable record)."""
        ...


class HomeRecords(Protocol):
    async def close(self) -> None:
        """Make the records the book flushed durable, and mark the changelog's end."""
        ...


class RecordAcker(Protocol):
    async def ack(self, record: SourceRecord) -> None: ...


def dead_letter_headers(
    reason: str, error: str, stage: str, topic: str, partition: int, offset: int
) -> dict[str, bytes]:
    """The headers every dead letter carries: why, and where its record came from."""
    return {
        "edgefeed-reason": reason.encode(),
        "edgefeed-error": error.encode()[:2000],
        "edgefeed-stage": stage.encode(),
        "edgefeed-topic": topic.encode(),
        "edgefeed-partition": str(partition).encode(),
        "edgefeed-offset": str(offset).encode(),
    }


def pointer(headers: Mapping[str, bytes], value: bytes, why: str) -> bytes:
    """A dead letter that points at its source record instead of holding it."""
    return orjson.dumps(
        {
            "withheld": why,
            "reason": headers.get("edgefeed-reason", b"").decode(errors="replace"),
            "topic": headers.get("edgefeed-topic", b"").decode(errors="replace"),
            "partition": int(headers.get("edgefeed-partition", b"-1") or -1),
            "offset": int(headers.get("edgefeed-offset", b"-1") or -1),
            "size": len(value),
            "sha256": hashlib.sha256(value).hexdigest(),
        }
    )


class RouterRuntime:
    """The router's processing, independent of Faust.

    Args:
        router: Routing (residency) with its book of homes.
        home_columns: Source topic -> its table's home-region column (None: shared).
        partitions: Partitions of every regional topic.
        partition_of: Entity key -> its regional partition (Kafka's partitioner).
        regional, dead_letters, homes, acker: The ports.
        metrics: The process's metrics; ``app_id`` labels them.
        sleep: ``asyncio.sleep`` (a fake in tests of the dead-letter backoff).
    """

    def __init__(
        self,
        router: Router,
        *,
        home_columns: Mapping[str, str | None],
        partitions: int,
        partition_of: Callable[[str], int],
        regional: RegionalSink,
        dead_letters: RouterDeadLetters,
        homes: HomeRecords,
        acker: RecordAcker,
        metrics: PipelineMetrics,
        app_id: str,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.router = router
        self.home_columns = dict(home_columns)
        self.all_partitions = list(range(partitions))
        self.partition_of = partition_of
        self.regional, self.dead_letters, self.homes, self.acker = (
            regional,
            dead_letters,
            homes,
            acker,
        )
        self.metrics, self.app_id, self.sleep = metrics, app_id, sleep
        self.routed: dict[tuple[str, int], int] = {}  # (topic, partition) -> last offset
        self.progress = asyncio.Event()  # set after each routed batch
        self._routed = metrics.events.labels(app_id, "routed")
        self._ignored = metrics.events.labels(app_id, "ignored")
        self._tombstones = metrics.events.labels(app_id, "tombstone")
        self._batch_sizes = metrics.batch_size.labels(app_id)

    # -- routing ------------------------------------------------------------------

    async def route_batch(self, records: Sequence[SourceRecord]) -> None:
        """Route one batch of source records, then ack them (after their sends)."""
        self._batch_sizes.observe(len(records))
        decoded = await self._decode(records)
        # In commit order across the batch's topics (each topic is in order already):
        # a user's move and the events after it route in the order they were made,
        # as far as one batch holds both (the Debezium topics are not ordered with
        # one another; docs/pipeline.md, "Residency").
        decoded.sort(key=lambda pair: pair[1].lsn)
        # (region, partition) -> the encoded changes bound there, in routing order.
        packs: dict[tuple[str, int], list[bytes]] = {}
        for record, change in decoded:
            await self._route_one(record, change, packs)
        sent = [
            await self.regional.send(region, partition, pack)
            for (region, partition), bodies in packs.items()
            for pack in encode_packs(bodies)
        ]
        if self.router.homes.pending:
            # A home changed (a move, a new entity): its record is written only once
            # the regional messages it decided (the evictions) are delivered, and the
            # batch is acked only once the record is: a router that dies in between
            # routes the batch again with the old homes and evicts again.
            await self.regional.delivered(sent)
            self.router.homes.flush()
            await self.homes.close()
        for record in records:
            await self.acker.ack(record)
            place = (record.topic, record.partition)
            self.routed[place] = max(self.routed.get(place, -1), record.offset)
        self.progress.set()

    async def _decode(self, records: Sequence[SourceRecord]) -> list[tuple[SourceRecord, Change]]:
        decoded: list[tuple[SourceRecord, Change]] = []
        for record in records:
            try:
                change = decode_change(record.value or b"", offset=record.offset)
            except Exception as exc:
                await self.dead_letter(record, None, exc)
                continue
            if change is None:
                self._tombstones.inc()
                continue
            if change.snapshot == "incremental":
                self.metrics.snapshot_rows.labels(change.table).inc()
            decoded.append((record, change))
        return decoded

    async def _route_one(
        self, record: SourceRecord, change: Change, packs: dict[tuple[str, int], list[bytes]]
    ) -> None:
        try:
            # Encoded before anything is queued: a change that cannot be encoded is
            # dead-lettered whole, never half-routed.
            bound = [(m, m.change.encode()) for m in self.router.route(change)]
        except Exception as exc:
            self.router.homes.rollback()  # the moves it decided are never sent
            await self.dead_letter(record, change, exc)
            return
        if not bound:
            self._ignored.inc()
            return
        for message, body in bound:
            key = message.key
            targets = self.all_partitions if key is None else [self.partition_of(key)]
            for partition in targets:  # a truncate reaches every partition
                packs.setdefault((message.region, partition), []).append(body)
        self._routed.inc()

    # -- dead letters -------------------------------------------------------------

    async def dead_letter(
        self, record: SourceRecord, change: Change | None, exc: BaseException
    ) -> None:
        """One source record to the dead letters, keeping residency.

        Shared data goes to the central topic. A personal row goes to the region
        the book of homes holds for its entity, else to the region the row names
        (:meth:`pipeline.routing.Router.dead_letter_region`), and never elsewhere:
        a row whose region is unknown, or that cannot be decoded, leaves only a
        pointer to its source record in the central topic.
        """
        # PoisonEventError for bad records; anything else is a bug met by this record,
        # which goes to the dead letters instead of stopping the router.
        if not isinstance(exc, PoisonEventError):
            log.error(
                "router failed on %s:%s@%s",
                record.topic,
                record.partition,
                record.offset,
                exc_info=exc,
            )
            exc = PoisonEventError("router-error", f"{type(exc).__name__}: {exc}")
        self.metrics.dead_letters.labels(self.app_id, exc.reason).inc()
        log.warning(
            "dead-lettered %s:%s@%s: %s", record.topic, record.partition, record.offset, exc
        )
        headers = dead_letter_headers(
            exc.reason, str(exc), "router", record.topic, record.partition, record.offset
        )
        value = record.value or b""
        if self.home_columns.get(record.topic) is None:  # shared data: the central topic
            await self.send_dead(None, record.key, value, headers)
            return
        region = None if change is None else self.router.dead_letter_region(change)
        if region is not None:  # personal data stays in its region
            await self.send_dead(region, record.key, value, headers)
            return
        # Personal data of no known region: a pointer to the source record, never the
        # row itself, an error text quoting it, or its size or hash.
        headers["edgefeed-withheld"] = b"personal row of an unknown region"
        headers["edgefeed-error"] = exc.reason.encode()
        withheld = {
            "withheld": "personal row of an unknown region",
            "reason": exc.reason,
            "topic": record.topic,
            "partition": record.partition,
            "offset": record.offset,
        }
        await self.send_dead(None, None, orjson.dumps(withheld), headers)

    async def send_dead(
        self, region: str | None, key: bytes | None, value: bytes, headers: dict[str, bytes]
    ) -> None:
        """Send a dead letter; the dead-letter path never stops the router.

        A value over :data:`DEAD_LETTER_MAX_BYTES` (the broker's limit is ~1 MB)
        goes as a pointer to its source record (topic, partition, offset, size,
        SHA-256); a send the broker refuses is tried again with backoff, as a
        pointer after the first refusal (a lost broker or a missing topic is
        waited for, never a crash loop that meets the same record after every
        restart, and never a silent drop).
        """
        if len(value) > DEAD_LETTER_MAX_BYTES:
            key, value = None, pointer(headers, value, "over the dead-letter size limit")
            headers["edgefeed-withheld"] = b"value over the dead-letter size limit"
        delay = DEAD_RETRY_FIRST_S
        while True:
            try:
                await self.dead_letters.send(region, key, value, headers)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # MessageSizeTooLarge, an unknown topic, a lost broker
                log.error(
                    "dead letter to %s refused (%s: %s); sending a pointer in %.1f s",
                    region or "the central topic",
                    type(exc).__name__,
                    exc,
                    delay,
                )
                if "edgefeed-withheld" not in headers:
                    key, value = None, pointer(headers, value, f"refused: {type(exc).__name__}")
                    headers["edgefeed-withheld"] = b"dead letter refused by the broker"
                await self.sleep(delay)
                delay = min(DEAD_RETRY_MAX_S, delay * 2)
