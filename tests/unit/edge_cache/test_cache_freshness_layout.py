"""The freshness record and the header times: owned, encoded and parsed by edge_cache.layout."""

from __future__ import annotations

import pytest

from edge_cache import CorruptValueError, FeatureSchema, Position, Upsert
from edge_cache.layout import FreshnessRecord, KeyLayout, encode_tombstone, header_times
from edge_cache.writer import WriterCore


def test_vector_header_times_and_keys() -> None:
    # a tombstone is the bare 40-byte header
    value = encode_tombstone(Position(123, 4), 1_700_000_000_000_000, 1_700_000_000_250_000)
    assert header_times(value) == (1_700_000_000_000_000, 1_700_000_000_250_000)
    assert header_times(b"XX" + bytes(46)) is None
    assert header_times(b"EF") is None
    layout = KeyLayout()
    assert layout.entity_of("ef:{users:42}") == "users"
    assert layout.entity_of("ef:{users:a:b}") == "users"
    assert layout.entity_of("ef:freshness:users") is None
    assert layout.entity_of_freshness_key("ef:freshness:users") == "users"
    assert layout.entity_of_freshness_key("ef:{users:42}") is None
    assert KeyLayout("other").entity_of("ef:{users:42}") is None


def test_freshness_record_round_trips_through_the_hash_fields() -> None:
    record = FreshnessRecord("user", 1_700_000_000_000_000, 1_700_000_000_100_000, 99)
    stored = {k.encode(): str(v).encode() for k, v in record.encode().items()}  # as HGETALL
    assert FreshnessRecord.decode("user", stored) == record


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {b"commit_us": b"1", b"write_us": b"2"},
        {b"commit_us": b"x", b"write_us": b"2", b"lsn": b"3"},
    ],
)
def test_a_malformed_freshness_record_is_a_typed_error(fields: dict[bytes, bytes]) -> None:
    with pytest.raises(CorruptValueError, match="freshness record of 'user'"):
        FreshnessRecord.decode("user", fields)


def test_writer_records_the_newest_change_per_entity() -> None:
    core = WriterCore(
        [FeatureSchema.of("user", ["a"]), FeatureSchema.of("item", ["b"])], clock=lambda: 50.0
    )
    ops = [
        Upsert("user", "1", {"a": 1.0}, Position(10), 2.0),
        Upsert("user", "2", {"a": 1.0}, Position(12), 3.0),
        Upsert("user", "3", {"a": 1.0}, Position(11), 1.0),
        Upsert("item", "9", {"b": 1.0}, Position(5), 4.0),
    ]
    assert sorted(core.freshness(ops), key=lambda r: r.entity) == [
        FreshnessRecord("item", 4_000_000, 50_000_000, 5),
        FreshnessRecord("user", 3_000_000, 50_000_000, 12),
    ]
