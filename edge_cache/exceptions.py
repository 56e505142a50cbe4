"""Errors raised by the edge cache: key layout, writer and lookup client.

Every class derives from :class:`EdgeCacheError` (itself an
:class:`edgefeed.errors.EdgefeedError`). Errors caused by bad input also
derive from :class:`ValueError`. ``retryable`` says whether the same call may
succeed later without any change.
"""

from __future__ import annotations

from edgefeed_base.errors import EdgefeedError

__all__ = [
    "ConfigError",
    "CorruptValueError",
    "EdgeCacheError",
    "ForeignValueError",
    "InvalidValueError",
    "LookupOverloadedError",
    "LookupTimeoutError",
    "PoolExhaustedError",
    "RegionUnavailableError",
    "SchemaError",
    "SchemaVersionError",
    "UnknownEntityError",
    "UnknownFeatureError",
]


class EdgeCacheError(EdgefeedError):
    """Base class of every edge cache error."""


class ConfigError(EdgeCacheError, ValueError):
    """The client or writer was configured wrongly (unknown region, bad option). Not retryable."""


class SchemaError(EdgeCacheError, ValueError):
    """A feature schema is invalid (bad name, duplicate feature, unsupported dtype,
    or a new version that is not an append-only evolution). Not retryable."""


class UnknownEntityError(EdgeCacheError, ValueError):
    """The entity type has no schema in this client or writer; the message lists
    the known entity types. Not retryable."""


class UnknownFeatureError(EdgeCacheError, ValueError):
    """A requested feature name is not in the entity's schema; the message lists
    the valid names. Not retryable."""


class InvalidValueError(EdgeCacheError, ValueError):
    """A value handed to the writer does not fit its feature's dtype (wrong type,
    out of range) or names an unknown feature, or an argument of a lookup is
    malformed (an id that is not a non-empty str or int, a negative
    ``max_staleness``). Not retryable."""


class SchemaVersionError(EdgeCacheError):
    """A cached value was written with a schema version this client cannot read
    safely: the version is not published in the cache's schema registry, or it
    is not an append-only evolution of (or ancestor of) the client's schema.
    The value is refused instead of misread. Not retryable: deploy the schema
    (or upgrade the client)."""


class CorruptValueError(EdgeCacheError):
    """A cached value is not in the edgefeed value format (wrong magic, format
    version or length): some other writer used the key space. Not retryable."""


class ForeignValueError(CorruptValueError, ValueError):
    """A write refused for one key: the key holds something that is not an edgefeed
    value (another application's string, or a list, hash or set). The key is left
    untouched and the rest of the batch may be written. Also a ValueError: the value
    cannot go there, whatever retry; the pipeline sets the entity aside (quarantine)
    and goes on with the others. Not retryable: free the key namespace."""


class RegionUnavailableError(EdgeCacheError):
    """No region allowed to serve the request answered: the home region failed
    (timeout, connection error, or its circuit breaker is open) and every
    fallback either failed too or is outside the entity's residency zone.
    Retryable: the region may come back.

    Attributes:
        region: The home region of the client.
        attempts: ``(region, reason)`` for every region tried or skipped.
    """

    retryable = True

    def __init__(self, message: str, region: str, attempts: tuple[tuple[str, str], ...]) -> None:
        super().__init__(message)
        self.region = region
        self.attempts = attempts


class LookupTimeoutError(RegionUnavailableError):
    """Every region tried ran out of its deadline (``timeout_s`` covers a region's
    whole read, not one socket read) and no other allowed region answered.
    Retryable."""


class LookupOverloadedError(EdgeCacheError):
    """This process could not serve the lookup within its deadline while the region
    kept answering: it took more concurrent lookups than it can serve (the asyncio
    client's event loop got round to the region's answer only after the deadline,
    or see :class:`PoolExhaustedError`). The region is healthy: it is not marked
    failed (breaker, failover, failure metrics). Shed the request with 429 and
    ``Retry-After``, or admit fewer. Retryable.

    Attributes:
        region: The region being read.
        retry_after_s: Seconds after which a retry is likely to be served.
    """

    retryable = True

    def __init__(self, message: str, region: str, *, retry_after_s: float) -> None:
        super().__init__(message)
        self.region = region
        self.retry_after_s = retry_after_s


class PoolExhaustedError(LookupOverloadedError):
    """Every pooled connection to a region stayed busy for the call's deadline:
    the process sends more concurrent lookups than its ``max_connections``. The
    region is healthy (it is not marked failed); shed the request with 429 and
    ``Retry-After``, or raise ``max_connections``. Retryable.

    Attributes:
        region: The region whose pool was exhausted.
        retry_after_s: Seconds after which a retry is likely to find a connection.
    """
