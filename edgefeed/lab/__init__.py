"""The latency lab: the case study's topologies deployed on the local stack behind
emulated WAN links, every term of T_total measured by the production instrumentation.

Imports the workers (torch) and the WAN emulator; the CLI loads it only when
``edgefeed lab`` runs.
"""

from __future__ import annotations

from edgefeed.lab.exceptions import LabDataError, LabError, LabSettingError
from edgefeed.lab.stats import TERMS, Percentiles, Sample, TopologySummary, summarize
from edgefeed.lab.topologies import LabOptions

__all__ = [
    "TERMS",
    "LabDataError",
    "LabError",
    "LabOptions",
    "LabSettingError",
    "Percentiles",
    "Sample",
    "TopologySummary",
    "summarize",
]
