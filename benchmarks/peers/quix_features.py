"""The demo shop's user features as a Quix Streams application (the peer in
benchmarks/peers/quix_pipeline.py; runs in the venv made by quix_venv.sh).

It reads the same Debezium topics as edgefeed's router (``public.events`` and
``public.users``), keeps its state in Quix's own RocksDB store and computes
every feature with Quix's own windows and aggregators, then writes one vector
per user per checkpoint to Redis in edgefeed's key layout and value format
(edge_cache's writer, namespace ``--namespace``), so the two caches can be
compared value by value.

The features and how each maps onto Quix (what edgefeed means by a window:
pipeline/windows.py). Quix's windows end at the user's newest event; edgefeed's
are read as of the read time. The benchmark reads both caches right after its
load, within seconds of the newest events, where the two meanings agree (a row
would have to leave a 30-minute window in between to tell them apart):

    views_30m, clicks_30m            sliding 30 min: Count of the view / click column
    carts_1h                         sliding 1 h: Count of the cart column
    avg_price_viewed_1h              sliding 1 h: Mean of the viewed price
    max_price_viewed_1h              sliding 1 h: Max of the viewed price
    distinct_items_1h                sliding 1 h: Distinct (below) of item_id
    top_categories_1h.1..3           sliding 1 h: TopK (below) of category_id
    purchases_today, spend_today     tumbling 1 day: Count / Sum of the purchase price
    last_items.1..5                  sliding 1 day: LastN (below) of item_id
    segment                          the newest users row (a second topic, concatenated)

edgefeed's sliding window of size S holds event times ``[t - S + 1, t]`` in
milliseconds; Quix's sliding window of duration D holds ``[t - D, t]``, so D is
S - 1. Quix has no distinct count, top-k or last-n aggregator: the three small
Aggregator subclasses below are what a Quix user writes for them. A column
that is missing (None) is skipped by Quix's Count, Sum, Mean and Max, which is
how a ``where: {kind: ...}`` filter maps: the column holds a value only for
events of that kind.

Scope: inserts and updates (what the benchmark's load writes); deletes and
truncates are not handled, nor home-region moves.

    PYTHONPATH=. benchmarks/peers/.venv-quix/bin/python benchmarks/peers/quix_features.py \\
        --settings edgefeed.yaml --region eu-west --namespace qx --state-dir /tmp/qx \\
        --metrics-port 9400
"""

from __future__ import annotations

import argparse
import time
from datetime import datetime
from typing import Any

from prometheus_client import REGISTRY, start_http_server
from quixstreams import Application, State
from quixstreams.dataframe.windows import Count, Max, Mean, Sum
from quixstreams.dataframe.windows.aggregations import Aggregator
from quixstreams.sinks import BatchingSink, SinkBatch

from edge_cache import FeatureWriter, KeyLayout, Position, Upsert
from edgefeed.settings import load_settings
from pipeline.features import FeatureEngine
from pipeline.metrics import PipelineMetrics

MINUTE_MS = 60_000
HOUR_MS = 60 * MINUTE_MS
DAY_MS = 24 * HOUR_MS
LATE_MS = MINUTE_MS  # grace for out-of-order events (the load writes in commit order)


# -- the aggregators Quix does not ship -------------------------------------------------------


class Distinct(Aggregator):
    """Number of distinct values of the column (state: value -> count)."""

    def initialize(self) -> dict[str, int]:
        return {}

    def agg(self, old: dict[str, int], new: Any, timestamp: int) -> dict[str, int]:
        value = new.get(self.column)
        if value is not None:
            old[str(value)] = old.get(str(value), 0) + 1
        return old

    def result(self, value: dict[str, int]) -> int:
        return len(value)


class TopK(Aggregator):
    """The k most frequent values, most frequent first; ties go to the value seen last
    (edgefeed's rule: the value whose newest row is newest)."""

    def __init__(self, column: str, k: int) -> None:
        super().__init__(column)
        self.k = k

    def initialize(self) -> dict[str, list[int]]:
        return {}

    def agg(self, old: dict[str, list[int]], new: Any, timestamp: int) -> dict[str, list[int]]:
        value = new.get(self.column)
        if value is not None:
            count = old.get(str(value), [0])[0]
            old[str(value)] = [count + 1, timestamp, new["lsn"], new["event_id"]]
        return old

    def result(self, value: dict[str, list[int]]) -> list[int]:
        ranked = sorted(value.items(), key=lambda kv: (kv[1][0], kv[1][1:]), reverse=True)
        return [int(v) for v, _ in ranked[: self.k]]


class LastN(Aggregator):
    """The n newest values, newest first (state: [timestamp, lsn, event id, value])."""

    def __init__(self, column: str, n: int) -> None:
        super().__init__(column)
        self.n = n

    def initialize(self) -> list[list[int]]:
        return []

    def agg(self, old: list[list[int]], new: Any, timestamp: int) -> list[list[int]]:
        value = new.get(self.column)
        if value is not None:
            old.append([timestamp, new["lsn"], new["event_id"], value])
            old.sort()
            del old[: -self.n]
        return old

    def result(self, value: list[list[int]]) -> list[int]:
        return [entry[3] for entry in reversed(value)]


# -- decoding Debezium records ----------------------------------------------------------------


def payload(value: Any) -> dict[str, Any] | None:
    """The Debezium envelope (with or without an embedded schema); None for tombstones."""
    if isinstance(value, dict) and "payload" in value and "schema" in value:
        value = value["payload"]
    return value if isinstance(value, dict) else None


def event_ms(text: str) -> int:
    """A ``timestamptz`` (Debezium ZonedTimestamp, ISO 8601) in epoch milliseconds."""
    return int(datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() * 1000)


def event_columns(envelope: dict[str, Any]) -> dict[str, Any]:
    """One event row as the columns the aggregators read."""
    row, source = envelope["after"], envelope["source"]
    kind, price = row["kind"], float(row["price"])
    return {
        "user_id": str(row["user_id"]),
        "event_id": int(row["event_id"]),
        "item_id": int(row["item_id"]),
        "category_id": int(row["category_id"]),
        "view": 1 if kind == "view" else None,
        "click": 1 if kind == "click" else None,
        "cart": 1 if kind == "add_to_cart" else None,
        "view_price": price if kind == "view" else None,
        "purchase_price": price if kind == "purchase" else None,
        "lsn": int(source.get("lsn") or 0),
        "commit_ms": int(source["ts_ms"]),
    }


def events_timestamp(value: Any, headers: Any, timestamp: float, kind: Any) -> int:
    envelope = payload(value)
    if envelope is None or envelope.get("after") is None:
        return int(timestamp)
    return event_ms(envelope["after"]["occurred_at"])


# -- the application --------------------------------------------------------------------------


class RedisVectors(BatchingSink):
    """Writes each checkpoint's newest vector per user in one pipelined round trip
    (edge_cache's writer: the key layout, value format and position check)."""

    def __init__(self, writer: FeatureWriter, metrics: PipelineMetrics, region: str) -> None:
        super().__init__()
        self.writer = writer
        self.freshness = metrics.freshness.labels(region)
        self.writes = metrics.cache_writes

    def write(self, batch: SinkBatch) -> None:
        newest: dict[str, dict[str, Any]] = {}
        for item in batch:
            newest[item.value["id"]] = item.value
        if not newest:
            return
        ops = [
            Upsert(
                "user",
                user,
                vector["features"],
                Position(vector["lsn"], vector["seq"]),
                vector["commit_ms"] / 1000.0,
            )
            for user, vector in newest.items()
        ]
        applied = self.writer.write(ops, freshness=True)
        now = time.time()
        for op in ops:
            self.freshness.observe(max(0.0, now - float(op.commit_time)))  # type: ignore[arg-type]
        self.writes.labels("quix", "true").inc(sum(applied))


def build(args: argparse.Namespace) -> Application:
    settings = load_settings(args.settings)
    source = settings.sources[0]
    schema = FeatureEngine(settings.entities).engine("user").schema
    region = settings.region(args.region)
    metrics = PipelineMetrics.create(REGISTRY)
    applied = metrics.events.labels("quix", "applied")
    writer = FeatureWriter.from_region(region, [schema], layout=KeyLayout(args.namespace))
    writer.publish_schemas()

    app = Application(
        broker_address=",".join(settings.kafka.bootstrap_servers),
        consumer_group=args.group,
        auto_offset_reset="earliest",
        state_dir=args.state_dir,
        commit_interval=args.commit_interval,
        processing_guarantee="at-least-once",
        # edgefeed's consumers wait at most fetch_max_wait_ms for a fetch to fill.
        consumer_extra_config={"fetch.wait.max.ms": settings.kafka.fetch_max_wait_ms},
        loglevel="INFO",
    )
    events_topic = app.topic(
        source.topic_for("public.events"),
        value_deserializer="json",
        key_deserializer="bytes",
        timestamp_extractor=events_timestamp,
    )
    users_topic = app.topic(
        source.topic_for("public.users"), value_deserializer="json", key_deserializer="bytes"
    )

    def is_change(value: Any) -> bool:
        envelope = payload(value)
        return (
            envelope is not None
            and envelope.get("op") in ("c", "r", "u")
            and envelope["after"].get("home_region") == args.region
        )

    events = app.dataframe(events_topic).filter(is_change)
    events = events.apply(lambda value: event_columns(payload(value)))  # type: ignore[arg-type]
    events = events.group_by("user_id")
    events = events.update(lambda value: applied.inc())

    def window_of(sdf: Any, size_ms: int) -> Any:
        return sdf.sliding_window(duration_ms=size_ms - 1, grace_ms=LATE_MS)

    commit = {"lsn": Max("lsn"), "commit_ms": Max("commit_ms")}
    w30m = (
        window_of(events, 30 * MINUTE_MS)
        .agg(views_30m=Count("view"), clicks_30m=Count("click"), **commit)
        .current()
    )
    w1h = (
        window_of(events, HOUR_MS)
        .agg(
            carts_1h=Count("cart"),
            avg_price_viewed_1h=Mean("view_price"),
            max_price_viewed_1h=Max("view_price"),
            distinct_items_1h=Distinct("item_id"),
            top_categories_1h=TopK("category_id", 3),
            **commit,
        )
        .current()
    )
    w1d = (
        events.tumbling_window(duration_ms=DAY_MS, grace_ms=LATE_MS)
        .agg(purchases_today=Count("purchase_price"), spend_today=Sum("purchase_price"), **commit)
        .current()
    )
    last = window_of(events, DAY_MS).agg(last_items=LastN("item_id", 5), **commit).current()

    def user_columns(value: Any) -> dict[str, Any]:
        envelope = payload(value) or {}  # not None: filtered by is_change
        row, source_ = envelope["after"], envelope["source"]
        return {
            "user_id": str(row["user_id"]),
            "segment": int(row["segment"]),
            "lsn": int(source_.get("lsn") or 0),
            "commit_ms": int(source_["ts_ms"]),
        }

    users = app.dataframe(users_topic).filter(is_change).apply(user_columns)
    users = users.group_by("user_id")
    users = users.update(lambda value: applied.inc())

    empty = {name: None for name in schema.names}
    # An empty window's count, sum and distinct count are 0 (as in edgefeed's vector).
    empty.update(
        views_30m=0,
        clicks_30m=0,
        carts_1h=0,
        purchases_today=0,
        spend_today=0.0,
        distinct_items_1h=0,
    )

    def merge(value: dict[str, Any], key: Any, timestamp: int, headers: Any, state: State) -> Any:
        """Fold one branch's result into the user's vector (kept in Quix state)."""
        vector = state.get("v") or {"features": dict(empty), "lsn": 0, "seq": 0, "commit_ms": 0}
        features = vector["features"]
        for name, result in value.items():
            if name in ("start", "end", "user_id", "lsn", "commit_ms"):
                continue
            if name in ("last_items", "top_categories_1h"):
                for rank in range(1, 6 if name == "last_items" else 4):
                    features[f"{name}.{rank}"] = result[rank - 1] if rank <= len(result) else None
            else:
                features[name] = result
        # The sink writes each source topic's batch on its own, in no set order, and
        # the cache keeps the vector of the highest position: a vector computed later
        # must carry a higher one, so ties on the LSN go to the order of computing.
        if value["lsn"] > vector["lsn"]:
            vector["lsn"], vector["seq"] = value["lsn"], 0
        else:
            vector["seq"] = vector.get("seq", 0) + 1
        vector["commit_ms"] = max(vector["commit_ms"], value["commit_ms"])
        state.set("v", vector)
        user = key.decode() if isinstance(key, bytes) else str(key)
        return {"id": user, **vector}

    merged = w30m.concat(w1h).concat(w1d).concat(last).concat(users)
    merged = merged.apply(merge, stateful=True, metadata=True)
    merged.sink(RedisVectors(writer, metrics, args.region))
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", required=True, help="edgefeed settings file")
    parser.add_argument("--region", default="eu-west", help="the region whose users it serves")
    parser.add_argument("--namespace", default="qx", help="Redis key namespace (edgefeed: ef)")
    parser.add_argument("--state-dir", required=True, help="Quix's RocksDB state folder")
    parser.add_argument("--group", default="quix-features", help="consumer group")
    parser.add_argument("--commit-interval", type=float, default=5.0, help="seconds")
    parser.add_argument("--metrics-port", type=int, required=True)
    args = parser.parse_args()
    start_http_server(args.metrics_port, addr="127.0.0.1")
    build(args).run()


if __name__ == "__main__":
    main()
