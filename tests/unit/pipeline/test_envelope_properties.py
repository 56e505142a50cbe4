"""Property suite over the Debezium envelope decoder (pipeline.envelope.decode_change).

Whatever bytes a change topic holds (generated envelopes with and without an
embedded schema, then mutated: wrong types, missing or extra fields, huge or
non-finite numbers, deep nesting, truncation, bit flips, random bytes), the
decoder returns a Change within its bounds, None for a tombstone, or raises
PoisonEventError; nothing else escapes, and memory per call stays bounded by a
small multiple of the input. Derandomized, with no example database, so a
failure reproduces on every machine.
"""

from __future__ import annotations

import json
import tracemalloc
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.envelope import Change, decode_change
from pipeline.exceptions import PoisonEventError
from pipeline.messages import MAX_TIME_MS

PROPERTY = settings(
    max_examples=2000,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
ROWS = st.one_of(st.none(), st.dictionaries(st.text(max_size=12), JSON_VALUES, max_size=6))


@st.composite
def envelopes(draw: st.DrawFn) -> dict[str, Any]:
    source: dict[str, Any] = {
        "ts_ms": draw(st.one_of(st.integers(0, MAX_TIME_MS), JSON_VALUES)),
        "schema": draw(st.one_of(st.just("public"), JSON_VALUES)),
        "table": draw(st.one_of(st.text(max_size=20), JSON_VALUES)),
        "lsn": draw(st.one_of(st.integers(0, 2**63 - 1), st.integers(), JSON_VALUES)),
        "snapshot": draw(st.sampled_from([None, True, False, "true", "last", "first", "false", 3])),
    }
    for key in list(source):
        if draw(st.integers(0, 9)) == 0:
            del source[key]
    envelope: dict[str, Any] = {
        "op": draw(st.one_of(st.sampled_from(["c", "u", "d", "r", "t"]), JSON_VALUES)),
        "before": draw(ROWS),
        "after": draw(ROWS),
        "source": draw(st.one_of(st.just(source), JSON_VALUES)),
    }
    for key in list(envelope):
        if draw(st.integers(0, 9)) == 0:
            del envelope[key]
    if draw(st.booleans()):
        envelope[draw(st.text(max_size=8))] = draw(JSON_VALUES)
    if draw(st.booleans()):
        return {
            "schema": draw(JSON_VALUES),
            "payload": draw(st.one_of(st.just(envelope), JSON_VALUES)),
        }
    return envelope


@st.composite
def hostile_bytes(draw: st.DrawFn) -> bytes:
    raw = bytearray(json.dumps(draw(envelopes())).encode())
    kind = draw(
        st.sampled_from(["keep", "keep", "truncate", "flip", "splice", "nest", "bigint", "random"])
    )
    if kind == "truncate" and raw:
        del raw[draw(st.integers(0, len(raw) - 1)) :]
    elif kind == "flip" and raw:
        for _ in range(draw(st.integers(1, 8))):
            index = draw(st.integers(0, len(raw) - 1))
            raw[index] ^= 1 << draw(st.integers(0, 7))
    elif kind == "splice" and raw:
        index = draw(st.integers(0, len(raw)))
        raw[index:index] = draw(st.binary(max_size=32))
    elif kind == "nest":
        depth = draw(st.integers(1, 50_000))
        raw = bytearray(b'{"op":"c","after":' + b"[" * depth + b"]" * depth + b"}")
    elif kind == "bigint":
        digits = draw(st.integers(20, 50_000))
        raw = bytearray(b'{"op":"c","after":{},"source":{"table":"t","ts_ms":1,"lsn":')
        raw += b"9" * digits + b"}}"
    elif kind == "random":
        raw = bytearray(draw(st.binary(max_size=256)))
    return bytes(raw)


def _check(change: Change | None) -> None:
    if change is None:
        return
    assert isinstance(change.table, str) and "." in change.table
    assert change.op in ("c", "u", "d", "r", "t")
    assert 0 <= change.lsn <= 2**63 - 1
    assert 0 <= change.seq < 2**32
    assert 0 <= change.commit_ms <= MAX_TIME_MS
    assert change.row is None or isinstance(change.row, dict)
    if change.op in ("c", "u", "r"):
        assert change.after is not None
    if change.op == "d":
        assert change.before is not None


@PROPERTY
@given(value=hostile_bytes(), offset=st.integers(0, 2**63 - 1))
def test_any_change_topic_bytes_decode_or_raise_poison_in_bounded_memory(
    value: bytes, offset: int
) -> None:
    tracemalloc.start()
    try:
        try:
            change = decode_change(value, offset=offset)
        except PoisonEventError as exc:
            assert exc.reason == "undecodable"
            assert len(str(exc)) < 4096  # a bounded message, whatever the input
        else:
            _check(change)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Parsing holds the document and its Python objects: a small multiple of the input.
    assert peak < 64 * len(value) + 2 * 1024 * 1024, (len(value), peak)


@settings(PROPERTY, max_examples=1000)
@given(envelope=envelopes())
def test_well_typed_envelopes_decode_to_their_row(envelope: dict[str, Any]) -> None:
    """An envelope whose fields have the right types decodes to exactly its row."""
    body = envelope.get("payload", envelope) if "schema" in envelope else envelope
    try:
        change = decode_change(json.dumps(envelope).encode())
    except PoisonEventError:
        return
    if change is None:
        assert "schema" in envelope and envelope.get("payload") is None
        return
    assert isinstance(body, dict)
    assert change.op == body["op"]
    assert change.after == body.get("after")
    assert change.before == body.get("before")
    assert change.table.endswith("." + body["source"]["table"])
