"""Errors of the pipeline."""

from __future__ import annotations

from edgefeed_base.errors import EdgefeedError

__all__ = [
    "FeatureConfigError",
    "PipelineConfigError",
    "PipelineError",
    "PoisonEventError",
    "SinkUnavailableError",
    "StateStoreError",
    "TrainingSetError",
]


class PipelineError(EdgefeedError):
    """Base class of the pipeline's errors."""


class FeatureConfigError(PipelineError, ValueError):
    """The feature declarations do not fit the sources or the database (a table
    not captured, a column that does not exist). Raised at start, before any
    event is consumed. Not retryable: fix the settings."""


class PoisonEventError(PipelineError, ValueError):
    """An event cannot be processed (undecodable, no key, wrong types). It goes to
    the dead-letter topic with this message as the reason; the agent carries on.
    Not retryable: the event itself is wrong.

    Attributes:
        reason: Short machine-readable cause (``undecodable``, ``missing-key``, ...).
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class PipelineConfigError(PipelineError, ValueError):
    """The pipeline was asked for something its configuration does not have (a region
    not in ``regions``). Not retryable: fix the command or the settings."""


class SinkUnavailableError(PipelineError):
    """A dependency the worker writes to (the region's Redis) did not answer: a
    connection refused or reset, a timeout, a server still loading. Retryable: the
    worker keeps the batch, acks nothing, and retries with backoff."""

    retryable = True


class StateStoreError(PipelineError):
    """The worker's local state store cannot be written or read (a full disk, an I/O
    error, a folder another process holds; pipeline.localstore). The worker stops
    consuming and acks nothing until it can write again: no change is lost."""

    retryable = True


class TrainingSetError(PipelineError, ValueError):
    """A point-in-time training set cannot be built from what it was given (pipeline.training):
    a spine without the entity or time column, naive timestamps, a feature-set version the
    settings no longer define, an entity type not declared. The message names the column or
    version and the fix. Not retryable: fix the spine or the command."""
