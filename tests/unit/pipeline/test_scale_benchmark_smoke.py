"""Keep benchmarks/scale.py from rotting: its --smoke run in both modes. In memory,
the recovery must give back every entity with the very vectors the worker held
before it; on disk, the worker must compute the same vectors as in memory with a
bounded set of states in memory (the rest evicted and read back), serve a fresh
change at once after a restart, and recover (or rebuild a lost disk) exactly."""

from __future__ import annotations

import json
from typing import Any

from benchrun import run_benchmark


def check_load(result: dict[str, Any]) -> None:
    users, events = result["users"], result["events_per_user"]
    assert result["changes"] == 2 * users * events
    assert result["dead_lettered"] == 0
    assert result["entities"] == users + users // 10  # every user and every item
    assert 0 < result["rows"] <= result["changes"]
    assert result["recovered_entities"] == result["entities"]
    assert result["recovered_equal"] is True
    # Every recovered state is the one whose vector the cache holds: none is written
    # again at once (each is renewed when its schedule runs out).
    assert result["rewritten"] == 0
    assert result["changes_per_s"] > 0


def test_scale_benchmark_smoke_run() -> None:
    completed = run_benchmark("scale.py", "--smoke", "--json")
    memory, disk = json.loads(completed.stdout)
    assert (memory["mode"], disk["mode"]) == ("memory", "disk")

    check_load(memory)
    assert memory["state_mb"] >= 0

    check_load(disk)
    assert disk["users"] == memory["users"]
    # The same load gives the same vectors whether its states stay in memory or not.
    assert disk["entities"] == memory["entities"]
    assert disk["digest"] == memory["digest"]
    # Bounded: most states left memory and were read back from disk when needed;
    # once every state is on disk, what stays in memory is within the budget.
    assert disk["dirty_after"] == 0
    assert disk["hot_entities"] < disk["entities"]
    assert disk["evictions"] > 0 and disk["loads"] > 0
    assert disk["recovered_hot"] < disk["recovered_entities"]
    assert disk["recovered_cache_bytes"] <= disk["budget_bytes"]
    # After a restart on the same folder: a new change served, and a folder rebuilt
    # from the changelog alone (a lost disk) holds the very same states.
    assert disk["fresh_served"] is True
    assert disk["rebuilt_equal"] is True
    assert disk["rebuild_records"] >= disk["changelog_records"]
    assert disk["serialized_mb"] > 0 and disk["store_mb"] > 0
