"""Schemas, keys and the value format, without Redis."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edge_cache import (
    Feature,
    FeatureSchema,
    InvalidValueError,
    KeyLayout,
    Position,
    RegionSettings,
    Schedule,
    SchemaError,
    SchemaVersionError,
)
from edge_cache.core import LookupCore
from edge_cache.layout import HEADER_SIZE, RecordLayout, RecordReader, encode_tombstone, to_micros
from edge_cache.writer import WRITE_SCRIPT

MIXED = FeatureSchema(
    "item",
    (
        Feature("a", "float32"),
        Feature("b", "float32"),
        Feature("n", "int64"),
        Feature("k", "int32"),
        Feature("ok", "bool"),
        Feature("x", "float64"),
        Feature("c", "float32"),
    ),
)


def test_schema_validation_messages() -> None:
    with pytest.raises(SchemaError, match="appears twice"):
        FeatureSchema.of("user", ["a", "a"])
    with pytest.raises(SchemaError, match="dtype 'float16'; supported: float32, float64"):
        Feature("a", "float16")  # type: ignore[arg-type]
    with pytest.raises(SchemaError, match="feature name 'a b' is invalid"):
        Feature("a b")
    with pytest.raises(SchemaError, match="at least one feature"):
        FeatureSchema("user", ())
    with pytest.raises(SchemaError, match="version 0"):
        FeatureSchema.of("user", ["a"], version=0)
    assert issubclass(SchemaError, ValueError)


def test_evolve_is_append_only_and_fingerprints_differ() -> None:
    v1 = FeatureSchema.of("user", ["a", "b"], personal=True)
    v2 = v1.evolve(Feature("c", "int32"))
    assert v2.version == 2 and v2.names == ("a", "b", "c") and v2.personal
    assert v1.is_prefix_of(v2) and not v2.is_prefix_of(v1)
    assert v1.fingerprint != v2.fingerprint
    assert FeatureSchema.of("user", ["b", "a"]).fingerprint != v1.fingerprint
    with pytest.raises(SchemaError):
        v1.evolve()
    assert FeatureSchema.from_json(v2.to_json()) == v2
    with pytest.raises(SchemaError, match="not a feature schema"):
        FeatureSchema.from_json(json.dumps({"entity": "user"}))


def test_keys_use_the_entity_as_hash_tag() -> None:
    layout = KeyLayout()
    assert layout.key("user", 42) == "ef:{user:42}"
    assert layout.keys("user", ["a", 7]) == ["ef:{user:a}", "ef:{user:7}"]
    assert KeyLayout("prod").schema_key("user", 3) == "prod:schema:user:3"
    with pytest.raises(InvalidValueError, match="non-empty str or an int"):
        layout.key("user", "")
    with pytest.raises(InvalidValueError):
        layout.key("user", True)
    with pytest.raises(SchemaError):
        KeyLayout("a{b")


def test_position_order_and_pg_lsn() -> None:
    assert Position.from_pg_lsn("16/B374D848", 3) == Position((0x16 << 32) | 0xB374D848, 3)
    assert Position(5, 9) < Position(6, 0) < Position(6, 1)
    assert Position(1, 2).pack() == bytes.fromhex("0000000000000001") + bytes.fromhex("00000002")
    with pytest.raises(InvalidValueError, match="not a PostgreSQL LSN"):
        Position.from_pg_lsn("nope")
    with pytest.raises(InvalidValueError, match=r"0\.\.2"):
        Position(-1)


def test_value_layout_matches_the_documented_offsets() -> None:
    record = RecordLayout(MIXED)
    value = record.encode({"a": 1.0, "ok": True}, Position(0x0102030405060708, 9), 11, 22)
    assert len(value) == record.itemsize == HEADER_SIZE + 4 + 4 + 8 + 4 + 1 + 8 + 4 + 1
    assert value[:2] == b"EF" and value[2] == 1 and value[3] == 0
    assert int.from_bytes(value[4:6], "little") == 1
    assert int.from_bytes(value[6:8], "little") == 7
    assert int.from_bytes(value[8:12], "little") == MIXED.fingerprint
    assert value[12:24] == Position(0x0102030405060708, 9).pack()  # what the Lua script reads
    assert int.from_bytes(value[24:32], "little") == 11
    assert int.from_bytes(value[32:40], "little") == 22
    assert value[-1] == 0b00010001  # features 0 (a) and 4 (ok) are present
    # the script reads exactly that span
    assert "string.sub(old, 13, 24)" in WRITE_SCRIPT


def test_encode_rejects_bad_values() -> None:
    record = RecordLayout(MIXED)
    p = Position(1)
    with pytest.raises(InvalidValueError, match=r"'zz' is not in schema 'item' v1; valid: a, b, n"):
        record.encode({"zz": 1.0}, p, 0, 0)
    with pytest.raises(InvalidValueError, match="out of int32 range"):
        record.encode({"k": 2**31}, p, 0, 0)
    with pytest.raises(InvalidValueError, match=r"is int64; got 1\.5"):
        record.encode({"n": 1.5}, p, 0, 0)
    with pytest.raises(InvalidValueError, match="is bool; got 1"):
        record.encode({"ok": 1}, p, 0, 0)
    with pytest.raises(InvalidValueError, match="got the bool"):
        record.encode({"a": True}, p, 0, 0)
    with pytest.raises(InvalidValueError, match="out of float32 range"):
        record.encode({"a": 1e39}, p, 0, 0)
    with pytest.raises(InvalidValueError, match="no time zone"):
        from datetime import datetime

        to_micros(datetime(2024, 1, 1))


def test_reader_decodes_own_values_and_tombstones() -> None:
    reader = RecordReader(MIXED, KeyLayout())
    record = RecordLayout(MIXED)
    values = [
        record.encode({"a": 1.5, "n": -(2**63), "x": 0.1}, Position(1), 5, 6),
        None,
        encode_tombstone(Position(2), 5, 6),
        record.encode({"c": -2.0}, Position(1), 7, 8),
    ]
    decoded = reader.decode(values, [1, 2, 3, 4])
    assert decoded.rows.tolist() == [0, 3]
    assert decoded.deleted == (2,)
    assert decoded.records["r1"][:, 0].tolist() == [-(2**63), 0]  # the int64 run
    assert decoded.records["commit_us"].tolist() == [5, 7]
    assert not decoded.complete and not decoded.all_valid


def test_reader_refuses_foreign_bytes_per_entity() -> None:
    reader = RecordReader(MIXED, KeyLayout())
    good = RecordLayout(MIXED).encode({}, Position(1), 1, 2)
    decoded = reader.decode([b"abc", good, b"X" * 60], [1, 2, 3])
    assert decoded.rows.tolist() == [1]  # the good value is served
    (first, short), (third, foreign) = decoded.corrupt
    assert first == 0 and "'ef:{item:1}' is 3 bytes" in short
    assert third == 2 and "'ef:{item:3}' is not an edgefeed value" in foreign


def _translate(writer: FeatureSchema, reader: FeatureSchema, values: dict[str, object]) -> object:
    encoded = RecordLayout(writer).encode(values, Position(1), 1, 2)
    rdr = RecordReader(reader, KeyLayout())
    first = rdr.decode([encoded], ["e"])
    assert first.needs == frozenset({(writer.version, writer.fingerprint)})
    rdr.learn(writer.version, writer.fingerprint, writer.to_json())
    return rdr.decode([encoded], ["e"])


def test_versions_translate_both_ways() -> None:
    from edge_cache.result import Projection, build_vectors

    v1 = FeatureSchema.of("u", {"a": "float32", "n": "int32", "f": "bool"})
    v2 = v1.evolve(*[Feature(f"g{i}", "float64") for i in range(9)])
    newer = _translate(v2, v1, {"a": 2.5, "f": True, "g8": 1.0})
    older = _translate(v1, v2, {"a": 2.5, "n": 3})
    for schema, decoded, expected in (
        (v1, newer, {"a": 2.5, "n": None, "f": True}),
        (v2, older, {"a": 2.5, "n": 3, "f": None, **{f"g{i}": None for i in range(9)}}),
    ):
        projection = Projection(RecordLayout(schema), schema.names, np.arange(len(schema.names)))
        result = build_vectors(
            entity="u",
            ids=("e",),
            region="r",
            projection=projection,
            decoded=decoded,  # type: ignore[arg-type]
            now_us=0,
            max_staleness_us=None,
            near_hits=0,
        )
        assert result.to_dicts() == [expected]


def test_reader_refusals_name_the_problem() -> None:
    v1 = FeatureSchema.of("u", ["a", "b"])
    swapped = FeatureSchema.of("u", ["b", "a"], version=2)
    value = RecordLayout(swapped).encode({"a": 1.0}, Position(1), 0, 0)
    reader = RecordReader(v1, KeyLayout())
    reader.learn(2, swapped.fingerprint, swapped.to_json())
    with pytest.raises(SchemaVersionError, match="not an append-only evolution"):
        reader.decode([value], ["e"])
    reader.learn(2, swapped.fingerprint, None)
    with pytest.raises(SchemaVersionError, match="not published"):
        reader.decode([value], ["e"])
    reader.learn(
        2, swapped.fingerprint, FeatureSchema.of("u", ["a", "b", "c"], version=2).to_json()
    )
    with pytest.raises(SchemaVersionError, match="two different schemas were deployed"):
        reader.decode([value], ["e"])


def test_bulk_decode_matches_the_per_value_path() -> None:
    """Many values take the vectorised path; gaps, tombstones, partial vectors and other
    versions among them must give the same answer as one by one."""
    schema = FeatureSchema.of("u", ["a", "b", "c"])
    record = RecordLayout(schema)
    reader = RecordReader(schema, KeyLayout())
    full = [
        record.encode({"a": float(i), "b": 1.0, "c": 2.0}, Position(i), i, i) for i in range(20)
    ]
    everything = reader.decode(full, list(range(20)))
    assert everything.complete and everything.all_valid
    assert everything.records["r0"][:, 0].tolist() == [float(i) for i in range(20)]

    gappy: list[bytes | None] = list(full)
    gappy[3] = None
    gappy[7] = record.encode({"a": 7.0}, Position(7), 7, 7)  # partial vector
    decoded = reader.decode(gappy, list(range(20)))
    assert not decoded.complete and not decoded.all_valid
    assert decoded.rows.tolist() == [i for i in range(20) if i != 3]

    with_tombstone: list[bytes | None] = list(full)
    with_tombstone[5] = encode_tombstone(Position(99), 0, 0)
    decoded = reader.decode(with_tombstone, list(range(20)))
    assert decoded.deleted == (5,)
    assert sorted(decoded.rows.tolist()) == [i for i in range(20) if i != 5]

    newer = schema.evolve(Feature("d", "int32"))
    mixed: list[bytes | None] = list(full)
    mixed[0] = RecordLayout(newer).encode({"a": 0.5, "d": 3}, Position(1), 0, 0)
    first = reader.decode(mixed, list(range(20)))
    assert first.needs == frozenset({(2, newer.fingerprint)})
    reader.learn(2, newer.fingerprint, newer.to_json())
    decoded = reader.decode(mixed, list(range(20)))
    by_row = dict(zip(decoded.rows.tolist(), decoded.records["r0"][:, 0].tolist(), strict=True))
    assert by_row[0] == 0.5 and by_row[19] == 19.0

    foreign: list[bytes | None] = list(full)
    foreign[9] = b"EF" + b"\x07" * (record.itemsize - 2)  # right size, wrong format
    odd = reader.decode(foreign, list(range(20)))
    assert [index for index, _ in odd.corrupt] == [9]
    assert 9 not in odd.rows.tolist() and len(odd.rows) == 19


def test_numpy_integer_ids_make_the_same_keys() -> None:
    layout = KeyLayout()
    assert layout.keys("u", [np.int64(5), 6]) == ["ef:{u:5}", "ef:{u:6}"]
    with pytest.raises(InvalidValueError):
        layout.keys("u", [1, ""])
    with pytest.raises(InvalidValueError):
        layout.keys("u", [1, None])  # type: ignore[list-item]


# -- scheduled values (windows read as of the read time) -------------------------------------

TIMED = FeatureSchema.of("user", {"views": "int64", "spend": "float32", "seg": "int32"}, slots=3)
SCHEDULE = Schedule(
    patches=(
        (2_000_000, {"views": 2, "spend": 1.5, "seg": 4}),
        (3_000_000, {"views": 0, "seg": 4}),
    ),
    until_us=9_000_000,
)


def _read_at(
    reader: RecordReader, raws: list[bytes | None], now_us: int
) -> list[dict[str, object]]:
    records = reader.decode(raws, list(range(len(raws))), now_us).records
    # what a read returns is the vector in force alone, never the schedule behind it
    assert records.dtype == reader.record.compact
    assert reader.record.compact_size == HEADER_SIZE + reader.record.body_size
    out = []
    for record in records:
        views, seg = record["r0"][0], record["r2"][0]
        valid = int(record["valid"][0])
        out.append(
            {
                "views": int(views) if valid & 1 else None,
                "spend": float(record["r1"][0]) if valid & 2 else None,
                "seg": int(seg) if valid & 4 else None,
            }
        )
    return out


def test_a_scheduled_value_reads_the_vector_in_force_at_each_read_time() -> None:
    layout = RecordLayout(TIMED)
    raw = layout.encode(
        {"views": 3, "spend": 2.5, "seg": 4}, Position(7, 1), 10, 1_000_000, SCHEDULE
    )
    assert len(raw) == layout.itemsize and raw[3] == 2  # flag: scheduled
    reader = RecordReader(TIMED, KeyLayout())
    for now_us, views, spend in (
        (0, 3, 2.5),  # before the write: the vector written
        (1_999_999, 3, 2.5),
        (2_000_000, 2, 1.5),
        (2_999_999, 2, 1.5),
        (3_000_000, 0, None),  # a patch is a whole vector: spend is missing
        (50_000_000, 0, None),  # past until: the last one (the worker renews by then)
    ):
        # one value alone (per-value path) and among many (the bulk NumPy path)
        for raws in ([raw], [raw] * 12):
            got = _read_at(reader, raws, now_us)
            assert all(g == got[0] for g in got)
            assert got[0] == {"views": views, "spend": spend, "seg": 4}, now_us


def test_more_patches_than_slots_end_the_schedule_at_the_first_left_out() -> None:
    layout = RecordLayout(TIMED)
    patches = tuple((t * 1_000_000, {"views": t}) for t in range(1, 6))
    raw = layout.encode({"views": 0}, Position(7, 1), 10, 10, Schedule(patches, None))
    reader = RecordReader(TIMED, KeyLayout())
    assert _read_at(reader, [raw], 3_500_000)[0]["views"] == 3
    until = np.frombuffer(raw, "<i8", count=1, offset=HEADER_SIZE + layout.body_size)
    assert int(until[0]) == 4_000_000
    with pytest.raises(InvalidValueError, match="increasing times"):
        layout.encode({}, Position(7, 1), 10, 10, Schedule(((5, {}), (5, {})), None))
    with pytest.raises(InvalidValueError, match="no slots"):
        RecordLayout(MIXED).encode({}, Position(7, 1), 10, 10, SCHEDULE)


def test_a_feature_missing_from_the_vector_in_force_reads_as_missing() -> None:
    """The result's ``present`` follows the vector in force at the read time, not the
    one written: a window that empties (an average with no rows) is missing, not 0."""
    core = LookupCore(
        "eu-west",
        [RegionSettings(name="eu-west", redis_url="redis://h:1", residency_zone="eu")],
        [TIMED],
    )
    layout = RecordLayout(TIMED)
    raw = layout.encode(
        {"views": 3, "spend": 2.5, "seg": 4}, Position(7, 1), 10, 1_000_000, SCHEDULE
    )
    for count in (1, 12):  # the per-value path and the bulk NumPy path
        for at_us, views, spend in ((1_000_000, 3, 2.5), (3_000_000, 0, None)):
            plan = core.plan("user", list(range(count)), None, None, at_us / 1e6)
            decoded = plan.reader.decode([raw] * count, plan.ids, plan.at_us)
            result = core.assemble(plan, "eu-west", decoded, 0)
            want = {"views": views, "spend": spend, "seg": 4}
            assert result.to_dicts() == [want] * count, (count, at_us)
            assert result.present[:, 1].tolist() == [spend is not None] * count
            assert np.isnan(result.values[:, 1]).all() == (spend is None)


def test_scheduled_values_translate_between_versions_at_the_read_time() -> None:
    newer = TIMED.evolve(Feature("extra", "float64"))
    raw = RecordLayout(newer).encode({"views": 3, "extra": 1.0}, Position(7, 1), 10, 10, SCHEDULE)
    reader = RecordReader(TIMED, KeyLayout())
    reader.learn(newer.version, newer.fingerprint, newer.to_json())
    views = [_read_at(reader, [raw], t)[0]["views"] for t in (0, 2_000_000, 3_000_000)]
    assert views == [3, 2, 0]
    # A reader without slots (an older deployment) reads the vector in force now.
    older_unscheduled = FeatureSchema.of("user", {"views": "int64", "spend": "float32"})
    mixed_reader = RecordReader(older_unscheduled, KeyLayout())
    timed_v2 = FeatureSchema.of(
        "user", {"views": "int64", "spend": "float32", "seg": "int32"}, version=2, slots=2
    )
    mixed_reader.learn(2, timed_v2.fingerprint, timed_v2.to_json())
    now_patch = Schedule(((1, {"views": 9}),), None)  # in force since 1 us after the epoch
    value = RecordLayout(timed_v2).encode({"views": 3}, Position(7, 1), 10, 10, now_patch)
    decoded = mixed_reader.decode([value], [1])
    assert int(decoded.records[0]["r0"][0]) == 9
    # A reader with fewer slots than the writer still reads the writer's whole schedule.
    one_slot = FeatureSchema.of("user", {"views": "int64", "spend": "float32"}, slots=1)
    narrow = RecordReader(one_slot, KeyLayout())
    narrow.learn(2, timed_v2.fingerprint, timed_v2.to_json())
    value = RecordLayout(timed_v2).encode({"views": 3}, Position(7, 1), 10, 10, SCHEDULE)
    for many in (1, 12):
        views = [
            narrow.decode([value] * many, list(range(many)), t).records["r0"][0, 0]
            for t in (0, 2_000_000, 3_500_000)
        ]
        assert views == [3, 2, 0]


def test_slots_are_part_of_the_fingerprint_and_the_registry_document() -> None:
    plain = FeatureSchema.of("user", {"views": "int64", "spend": "float32", "seg": "int32"})
    assert plain.fingerprint != TIMED.fingerprint
    assert FeatureSchema.from_json(TIMED.to_json()) == TIMED
    assert "slots" not in plain.to_json()  # unscheduled documents are unchanged
    with pytest.raises(SchemaError, match="slots=-1"):
        FeatureSchema.of("user", ["a"], slots=-1)
