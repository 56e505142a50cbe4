"""Property suite over the cache value decoder: whatever bytes a key holds (random,
truncated, bit-flipped, grown, another schema's, a foreign registry document), decoding
and assembling a lookup raises nothing but edge_cache's typed errors."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edge_cache import EdgeCacheError, FeatureSchema, KeyLayout, Position, Schedule
from edge_cache.layout import (
    HEADER_SIZE,
    FreshnessRecord,
    RecordLayout,
    RecordReader,
    encode_tombstone,
    header_times,
)
from edge_cache.result import Projection, build_vectors
from edge_cache.schema import Dtype

DTYPES: tuple[Dtype, ...] = ("float32", "float64", "int32", "int64", "bool")
LAYOUT = KeyLayout()
# ~500 calls of 1-12 values each (~3,000 values), generated and mutated: ~8 s
PROPERTY = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def schemas(draw: st.DrawFn) -> FeatureSchema:
    dtypes = draw(st.lists(st.sampled_from(DTYPES), min_size=1, max_size=12))
    version = draw(st.integers(1, 3))
    slots = draw(st.sampled_from((0, 0, 1, 3)))  # with slots: windows read as of the read time
    return FeatureSchema.of(
        "e", {f"f{i}": d for i, d in enumerate(dtypes)}, version=version, slots=slots
    )


def _value(dtype: Dtype, data: st.DataObject) -> Any:
    if dtype == "bool":
        return data.draw(st.booleans())
    if dtype == "int32":
        return data.draw(st.integers(-(2**31), 2**31 - 1))
    if dtype == "int64":
        return data.draw(st.integers(-(2**63), 2**63 - 1))
    width = 32 if dtype == "float32" else 64
    return data.draw(st.floats(width=width, allow_nan=True, allow_infinity=True))


def _vector(schema: FeatureSchema, data: st.DataObject) -> dict[str, Any]:
    return {f.name: _value(f.dtype, data) for f in schema.features if data.draw(st.booleans())}


def _schedule(schema: FeatureSchema, data: st.DataObject) -> Schedule | None:
    if not schema.slots:
        return None
    times = data.draw(st.lists(st.integers(0, 10**16), max_size=schema.slots + 1, unique=True))
    until = data.draw(st.one_of(st.none(), st.integers(0, 2**63 - 2)))
    return Schedule(tuple((t, _vector(schema, data)) for t in sorted(times)), until)


def _encoded(schema: FeatureSchema, data: st.DataObject) -> bytes:
    values = _vector(schema, data)
    position = Position(data.draw(st.integers(0, 2**64 - 1)), data.draw(st.integers(0, 2**32 - 1)))
    return RecordLayout(schema).encode(values, position, 1, 2, _schedule(schema, data))


@st.composite
def mutated(draw: st.DrawFn, valid: bytes) -> bytes:
    raw = bytearray(valid)
    kind = draw(st.sampled_from(["flip", "truncate", "grow", "splice", "keep"]))
    if kind == "flip" and raw:
        for _ in range(draw(st.integers(1, 4))):
            index = draw(st.integers(0, len(raw) - 1))
            raw[index] ^= 1 << draw(st.integers(0, 7))
    elif kind == "truncate":
        raw = raw[: draw(st.integers(0, len(raw)))]
    elif kind == "grow":
        raw += draw(st.binary(min_size=1, max_size=16))
    elif kind == "splice" and raw:
        start = draw(st.integers(0, len(raw) - 1))
        chunk = draw(st.binary(min_size=1, max_size=8))
        raw[start : start + len(chunk)] = chunk
    return bytes(raw)


def _decode_and_assemble(reader: RecordReader, raws: list[bytes | None], data: Any) -> None:
    ids = [f"id{i}" for i in range(len(raws))]
    decoded = reader.decode(raws, ids)
    for version, fingerprint in decoded.needs:
        document = data.draw(
            st.one_of(
                st.none(),
                st.binary(max_size=64),
                st.just(reader.schema.to_json()),
                schemas().map(lambda s: s.to_json()),
            )
        )
        reader.learn(version, fingerprint, document)
    if decoded.needs:
        decoded = reader.decode(raws, ids)
    projection = Projection(
        reader.record, reader.schema.names, np.arange(len(reader.schema.names), dtype=np.intp)
    )
    result = build_vectors(
        entity="e",
        ids=tuple(ids),
        region="r",
        projection=projection,
        decoded=decoded,
        now_us=10**15,
        max_staleness_us=data.draw(st.one_of(st.none(), st.integers(0, 10**16))),
        near_hits=0,
        corrupt=decoded.corrupt,
    )
    assert result.values.shape == (len(ids), len(reader.schema.names))
    # what a caller can rely on: a present cell holds a number, never NaN
    assert not np.isnan(result.values[result.present]).any()
    for row in result.to_dicts():
        assert all(v is None or not (isinstance(v, float) and math.isnan(v)) for v in row.values())
    result.to_arrow()


@PROPERTY
@given(schema=schemas(), other=schemas(), data=st.data())
def test_decoding_any_stored_bytes_raises_only_typed_errors(
    schema: FeatureSchema, other: FeatureSchema, data: st.DataObject
) -> None:
    reader = RecordReader(schema, LAYOUT)
    raws: list[bytes | None] = []
    for _ in range(data.draw(st.integers(1, 12))):
        source = data.draw(st.sampled_from(["mine", "other", "tombstone", "random", "none"]))
        if source == "none":
            raws.append(None)
        elif source == "random":
            raws.append(data.draw(st.binary(max_size=128)))
        else:
            if source == "tombstone":
                valid = encode_tombstone(Position(1), 1, 2)
            else:
                valid = _encoded(schema if source == "mine" else other, data)
            raws.append(data.draw(mutated(valid)))
    # a typed error (SchemaVersionError) is the only acceptable failure
    with contextlib.suppress(EdgeCacheError):
        _decode_and_assemble(reader, raws, data)


@settings(max_examples=1000, deadline=None)
@given(value=st.binary(max_size=96))
def test_header_times_never_raise(value: bytes) -> None:
    times = header_times(value)
    assert times is None or len(times) == 2


@settings(max_examples=300, deadline=None)
@given(
    fields=st.dictionaries(
        st.sampled_from([b"commit_us", b"write_us", b"lsn", b"other", "lsn"]),
        st.one_of(st.binary(max_size=24), st.integers().map(lambda i: str(i).encode())),
    )
)
def test_freshness_records_decode_or_raise_typed(fields: dict[Any, bytes]) -> None:
    try:
        FreshnessRecord.decode("user", fields)
    except EdgeCacheError as exc:
        assert isinstance(exc, ValueError) or "freshness record" in str(exc)


@settings(max_examples=300, deadline=None)
@given(schema=schemas().filter(lambda s: s.slots > 0), data=st.data())
def test_scheduled_values_read_the_vector_in_force_exactly(
    schema: FeatureSchema, data: st.DataObject
) -> None:
    """Whatever the schedule and the read time, one value alone (per-value path) and
    among many (the NumPy gather) read exactly the vector the schedule has in force."""
    layout = RecordLayout(schema)
    reader = RecordReader(schema, LAYOUT)
    vectors = [_vector(schema, data) for _ in range(data.draw(st.integers(1, 12)))]
    schedules = [_schedule(schema, data) for _ in vectors]
    raws = [
        layout.encode(values, Position(1), 1, 2, schedule)
        for values, schedule in zip(vectors, schedules, strict=True)
    ]
    # read times anywhere, and on either side of and at every take-over
    edges = [t + d for sch in schedules if sch for t, _ in sch.patches for d in (-1, 0, 1)]
    now_us = data.draw(
        st.one_of(st.none(), st.integers(-1, 10**16 + 1), st.sampled_from(edges or [0]))
    )
    expected = []
    for values, schedule in zip(vectors, schedules, strict=True):
        in_force, patches = values, schedule.patches[: schema.slots] if schedule else ()
        for from_us, patch in patches:
            if now_us is not None and from_us <= now_us:
                in_force = patch
        # the vector in force encoded alone (no schedule): the bytes a read must return
        body = layout.encode(in_force, Position(1), 1, 2)[HEADER_SIZE : layout.compact_size]
        expected.append(body)
    for many in (False, True):
        picked = raws * 9 if many else raws[:1]
        records = reader.decode(picked, list(range(len(picked))), now_us).records
        assert records.dtype == layout.compact
        got = [records[i : i + 1].tobytes()[HEADER_SIZE:] for i in range(len(picked))]
        assert got == (expected * 9 if many else expected[:1])
