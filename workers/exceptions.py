"""Errors of the model workers.

Every error names the bad value and the fix. Bad input also subclasses
:class:`ValueError`; :attr:`~edgefeed.errors.EdgefeedError.retryable` says whether
the same request may succeed later unchanged. :attr:`WorkersError.http_status`
is the status the inference server answers with.
"""

from __future__ import annotations

import math

from edgefeed_base.errors import EdgefeedError

__all__ = [
    "BadRequestError",
    "BodyDeadlineError",
    "ClientDisconnectedError",
    "DeadlineExceededError",
    "DrainingError",
    "FeatureLogError",
    "FeatureLookupError",
    "InvalidTensorError",
    "MissingFeaturesError",
    "ModelExecutionError",
    "ModelLoadError",
    "NonFiniteOutputError",
    "OverloadedError",
    "PayloadTooLargeError",
    "QueueFullError",
    "RequestTimeoutError",
    "UnauthorizedError",
    "UnknownModelError",
    "UnsupportedMediaTypeError",
    "WorkerConfigError",
    "WorkerResponseError",
    "WorkersError",
    "retry_after_header",
]


class WorkersError(EdgefeedError):
    """Root of the workers package's errors."""

    http_status: int = 500


class WorkerConfigError(WorkersError, ValueError):
    """A worker setting is invalid (device, precision, batch sizes). Not retryable."""

    http_status = 500


class FeatureLogError(WorkersError, ValueError):
    """A feature log folder or a labels file cannot be read or joined as asked (a
    corrupt Parquet file, a missing join column). Not retryable: fix the input."""

    http_status = 500


class ModelLoadError(WorkersError):
    """A model file is missing, unreadable or does not match its architecture. Not retryable."""


class BadRequestError(WorkersError, ValueError):
    """The request itself is wrong; sending it again unchanged fails again. Not retryable."""

    http_status = 400


class InvalidTensorError(BadRequestError):
    """The payload decoded, but its shape, dtype or encoding is not what the model takes."""


class UnsupportedMediaTypeError(BadRequestError):
    """The request's Content-Type is not one the model accepts."""

    http_status = 415


class PayloadTooLargeError(BadRequestError):
    """The request body is larger than the worker's ``max_payload_bytes``."""

    http_status = 413


class UnknownModelError(BadRequestError):
    """No model of that name is served by this worker."""

    http_status = 404


class UnauthorizedError(WorkersError):
    """The request carries no bearer token, or not the worker's. Not retryable as sent:
    send ``Authorization: Bearer <token>`` with the worker's token."""

    http_status = 401


class MissingFeaturesError(BadRequestError):
    """The edge cache holds no (or incomplete) features for some requested ids.

    Not retryable as such: the ids must be synced to the region first.
    """

    http_status = 422


class FeatureLookupError(WorkersError):
    """Reading features from the edge cache failed for a reason that is not the request's.

    Retryable (HTTP 503) when the region and its fallbacks are unavailable; not
    retryable (HTTP 500) when the cache's schema lacks what the model reads.
    """

    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.http_status = 503 if retryable else 500


def retry_after_header(seconds: float) -> int:
    """The ``Retry-After`` for a wait of ``seconds``: whole seconds (HTTP's unit), at
    least 1. Messages that say when to retry say this, so that there is one answer."""
    return max(1, math.ceil(seconds))


class OverloadedError(WorkersError):
    """The worker cannot take the request now; retry after ``retry_after_s``. Retryable.

    Attributes:
        retry_after_s: Seconds after which a retry is likely to be admitted.
    """

    retryable = True
    http_status = 503

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueFullError(OverloadedError):
    """The model's bounded queue is full (backpressure). Retryable after ``retry_after_s``."""

    http_status = 429


class DrainingError(OverloadedError):
    """The worker is shutting down and admits no new requests. Retry on another worker."""

    http_status = 503


class DeadlineExceededError(WorkersError):
    """The request's latency budget cannot be met, so it is refused instead of served late.

    Retryable with a larger budget or when the worker is less loaded.
    """

    retryable = True
    http_status = 504


class BodyDeadlineError(DeadlineExceededError):
    """The request's body did not arrive within its latency budget (the connection is
    closed: the rest of the body is never read as a request)."""


class ModelExecutionError(WorkersError):
    """The forward pass of the batch holding this request failed.

    Only the requests of that batch fail; the worker keeps serving. Retryable:
    the next batch may hold different neighbours.
    """

    retryable = True
    http_status = 500


class NonFiniteOutputError(WorkersError):
    """The model produced NaN or infinity for this request's rows.

    JSON has no NaN or Infinity (answering them makes the body unparseable by
    strict clients), and a class probability computed from a NaN logit means
    nothing, so the request fails with HTTP 500 naming the row and column.
    Not retryable: the same input through the same weights gives the same value.
    """

    http_status = 500


class ClientDisconnectedError(WorkersError):
    """The client closed the connection before its request body arrived.

    Nobody is left to answer; the server counts it apart from errors
    (``edgefeed_worker_client_aborts``) and logs one line.
    """

    http_status = 499


class RequestTimeoutError(BadRequestError):
    """The request's body did not arrive within ``ServerConfig.body_timeout_s``.

    A slow or stalled client must not hold a connection and a request slot;
    send the body at once (or raise the timeout for slow links).
    """

    http_status = 408


class WorkerResponseError(WorkersError):
    """The client got an error answer from a worker.

    Attributes:
        status: HTTP status of the answer.
        error_type: The server-side error class name.
        retry_after_s: The server's Retry-After, when given.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int,
        error_type: str,
        retryable: bool,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.retryable = retryable
        self.retry_after_s = retry_after_s
