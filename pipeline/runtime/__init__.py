"""The regional worker's runtime, without Faust.

- :mod:`pipeline.runtime.batch`: continuous batching (what is pending, when a batch is due);
- :mod:`pipeline.runtime.ledger`: checkpoints (dirty entity states, what may be acked);
- :mod:`pipeline.runtime.quiet`: the router's batches by count or age, idle when quiet;
- :mod:`pipeline.runtime.region`: the worker itself, driving both against four
  ports (cache, changelog, dead letters, acks) that ``pipeline.app`` implements
  with Faust and the unit tests with in-memory fakes.
"""

from __future__ import annotations

from pipeline.runtime.batch import BatchPolicy, ClosedBatch, RegionBatch, Touched
from pipeline.runtime.ledger import Checkpoint, CheckpointLedger, Delivery
from pipeline.runtime.quiet import QuietBatches
from pipeline.runtime.region import (
    Acker,
    CacheSink,
    ChangelogSink,
    DeadLetterSink,
    RegionRuntime,
)

__all__ = [
    "Acker",
    "BatchPolicy",
    "CacheSink",
    "ChangelogSink",
    "Checkpoint",
    "CheckpointLedger",
    "ClosedBatch",
    "DeadLetterSink",
    "Delivery",
    "QuietBatches",
    "RegionBatch",
    "RegionRuntime",
    "Touched",
]
