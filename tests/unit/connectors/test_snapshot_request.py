"""The snapshot signal: which source a table belongs to, and the signal's payload."""

from __future__ import annotations

import pytest

from connectors.exceptions import SnapshotFilterError, SnapshotTableError
from connectors.settings import DatabaseSettings, SourceSettings, TableSettings
from connectors.snapshot import check_filter, signal_payload, source_of

SOURCES = [
    SourceSettings(name="shop", tables=[TableSettings(name="users", key=["user_id"])]),
    SourceSettings(
        name="catalog",
        tables=[
            TableSettings(name="public.items", key=["item_id"]),
            TableSettings(name="sales.prices", key=["item_id"]),
        ],
    ),
]


def test_a_table_maps_to_the_source_that_captures_it() -> None:
    source, table = source_of(SOURCES, "items")
    assert (source.name, table.name) == ("catalog", "public.items")
    source, table = source_of(SOURCES, "sales.prices")
    assert (source.name, table.name) == ("catalog", "sales.prices")


def test_an_uncaptured_table_is_refused_with_the_captured_ones_named() -> None:
    with pytest.raises(SnapshotTableError) as info:
        source_of(SOURCES, "public.orders")
    message = str(info.value)
    assert "'public.orders' is not captured" in message
    assert "public.items, public.users, sales.prices" in message
    assert "edgefeed connectors apply" in message
    assert isinstance(info.value, ValueError)


def test_payload_is_an_incremental_execute_snapshot_with_a_bracketed_filter() -> None:
    assert signal_payload("public.items", None) == {
        "data-collections": ["public.items"],
        "type": "incremental",
    }
    with_filter = signal_payload("public.items", "a = 1 OR b = 2")
    assert with_filter["additional-conditions"] == [
        {"data-collection": "public.items", "filter": "(a = 1 OR b = 2)"}
    ]


@pytest.mark.parametrize(("text", "reason"), [("  ", "is empty"), ("x" * 5000, "5000 characters")])
def test_empty_or_huge_filters_are_refused_before_any_connection(text: str, reason: str) -> None:
    # Port 1: nothing listens there; the check must fail before connecting.
    database = DatabaseSettings(port=1)
    with pytest.raises(SnapshotFilterError, match=reason):
        check_filter(database, TableSettings(name="items", key=["item_id"]), text)
