"""Errors of the WAN link emulator (``edgefeed dev wan``)."""

from __future__ import annotations

from edgefeed.errors import EdgefeedError

__all__ = ["LinkSettingError", "UnknownLinkError", "WanControlError", "WanError"]


class WanError(EdgefeedError):
    """Base class of the WAN emulator's errors."""


class LinkSettingError(WanError, ValueError):
    """A link setting is out of range (negative delay, zero bandwidth). Not
    retryable: fix the value the message names."""


class UnknownLinkError(WanError, ValueError):
    """A command names a link the emulator does not run. Not retryable: use one
    of the names the message lists (``edgefeed dev wan status``)."""


class WanControlError(WanError):
    """The emulator's control socket does not answer (not started, or stopped).
    Retryable once ``edgefeed dev up`` has started it."""

    retryable = True
