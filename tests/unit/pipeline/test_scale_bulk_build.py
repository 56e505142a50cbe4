"""benchmarks/scale.py's bulk-built state (issue 36): the large sizes are measured
over a state written straight to the worker's store and changelog instead of
applied change by change, so the bulk build must give what the worker's own
apply path gives for the same events, and a worker must go on from it (and from
a kill -9 over it) exactly."""

from __future__ import annotations

import json

from benchrun import run_benchmark


def test_bulk_built_store_restarts_into_the_apply_paths_states() -> None:
    completed = run_benchmark("scale.py", "--smoke", "--mode", "disk", "--bulk", "500", "--json")
    disk, bulk = json.loads(completed.stdout)
    assert (disk["mode"], bulk["mode"]) == ("disk", "bulk")
    assert bulk["users"] == disk["users"] == 500

    # Reopened (a restart), the bulk-built store holds every entity the worker's
    # apply path stored for the same events, with the same rows and positions
    # (the state digest) and the same vectors.
    assert bulk["entities"] == disk["entities"] == 550
    assert bulk["state_digest"] == disk["state_digest"]
    assert bulk["digest"] == disk["digest"]
    # Its saved offsets are the changelog's real positions: each partition's
    # offset is its last record in the changelog file.
    assert bulk["offsets_match"] is True
    # A sample recomputed from its events by the feature engine alone agrees.
    assert bulk["sample"] > 0 and bulk["sample_equal"] is True
    # A bulk-built store's size is the stored records', compressed.
    assert 0 < bulk["store_mb"] <= 2 * bulk["serialized_mb"]

    # A worker applies new changes over it in every access pattern, within its
    # memory budget (nothing dead-lettered).
    assert bulk["dead_lettered"] == 0
    for pattern in ("round", "uniform", "hot"):
        assert bulk[f"{pattern}_changes_per_s"] > 0
    # Killed with kill -9 during a load, inside a checkpoint whose records the
    # changelog holds and the store does not yet, and restarted on the same folder:
    # the worker replays exactly those records (the changelog's tail after the
    # saved offsets, not 0), serves a fresh write, and every entity checked equals
    # its recomputation from all its changes: none lost, none counted twice (the
    # tail's changes are delivered again: unacknowledged).
    assert bulk["killed_during_load"] is True
    assert bulk["kill_unstored_records"] > 0
    assert bulk["kill_tail_records"] == bulk["kill_unstored_records"]
    assert bulk["kill_fresh_served"] is True
    assert bulk["kill_checked"] > 0 and bulk["kill_equal"] is True
    # A lost disk: an empty folder rebuilt from the changelog holds byte for byte
    # what the folder it replaces holds (states, saved offsets, renewal index).
    assert bulk["rebuild_records"] >= bulk["changelog_records"]
    assert bulk["rebuilt_equal"] is True
