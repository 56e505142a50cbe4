"""Errors of the connectors package. Messages never contain a secret."""

from __future__ import annotations

from edgefeed_base.errors import EdgefeedError

__all__ = [
    "ConnectRequestError",
    "ConnectUnavailableError",
    "ConnectorFailedError",
    "ConnectorInvalidError",
    "ConnectorsError",
    "SnapshotFilterError",
    "SnapshotTableError",
    "SnapshotUnavailableError",
    "SourceValidationError",
]


class ConnectorsError(EdgefeedError):
    """Base class of the connectors package's errors."""


class ConnectUnavailableError(ConnectorsError):
    """Kafka Connect could not be reached, or kept answering 409/5xx through every
    retry. Retryable: start Connect or check ``connect.url``."""

    retryable = True


class ConnectRequestError(ConnectorsError):
    """Kafka Connect refused a request; the message is Connect's own, verbatim.

    Attributes:
        status: The HTTP status Connect answered.
        connect_message: Connect's error message.
    """

    def __init__(self, message: str, *, status: int, connect_message: str) -> None:
        super().__init__(message)
        self.status = status
        self.connect_message = connect_message


class ConnectorInvalidError(ConnectorsError, ValueError):
    """Connect's validation rejected one or more connector configs. Not retryable:
    every field error is listed; fix the settings. Nothing was applied.

    Attributes:
        errors: ``{connector: {field: [messages]}}``.
    """

    def __init__(self, message: str, errors: dict[str, dict[str, list[str]]]) -> None:
        super().__init__(message)
        self.errors = errors


class SourceValidationError(ConnectorsError, ValueError):
    """The declared sources do not match the database (unknown table, missing
    column, wal_level not logical). Not retryable: fix the settings or the
    database. Nothing was applied."""


class ConnectorFailedError(ConnectorsError):
    """A connector or one of its tasks is FAILED; the message carries the cause
    from the task trace. Retryable after the cause is fixed
    (``edgefeed connectors restart``)."""


class SnapshotTableError(ConnectorsError, ValueError):
    """An incremental snapshot was asked for a table no source captures. Not
    retryable: declare the table under a source and ``edgefeed connectors apply``,
    or name a captured one. Nothing was signalled."""


class SnapshotFilterError(ConnectorsError, ValueError):
    """A snapshot filter is not a valid SQL condition on its table (PostgreSQL's
    own reason is in the message). Not retryable: fix the filter. Nothing was
    signalled."""


class SnapshotUnavailableError(ConnectorsError):
    """The table's connector cannot take a snapshot signal now: it is not
    deployed, not running, or deployed without the signal table. Retryable once
    ``edgefeed connectors apply`` (or ``restart``) has fixed it. Nothing was
    signalled."""

    retryable = True
