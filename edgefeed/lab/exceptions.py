"""Errors of the latency lab."""

from __future__ import annotations

from edgefeed_base.errors import EdgefeedError

__all__ = ["LabDataError", "LabError", "LabSettingError"]


class LabError(EdgefeedError):
    """Root of the lab's errors."""


class LabSettingError(LabError, ValueError):
    """A lab option is out of range (the message names it and the range). Not retryable."""


class LabDataError(LabError):
    """The lab's database could not be loaded or queried. Retryable: start PostgreSQL
    (``edgefeed dev up``) or fix ``database:`` in the settings; the message never
    holds the password."""

    retryable = True
