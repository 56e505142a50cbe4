"""The WAN link emulator of the local stack: delay, jitter, bandwidth, cut and heal.

The kernel's netem is not available here and Toxiproxy is in no reachable
registry, so each link is an asyncio TCP proxy in front of a remote endpoint
(a region's broker, a region's Redis). What it models and what it does not is
in docs/sites.md.
"""

from __future__ import annotations

from edgefeed.wan.control import ControlServer, WanControl
from edgefeed.wan.exceptions import LinkSettingError, UnknownLinkError, WanControlError, WanError
from edgefeed.wan.proxy import Link, LinkSpec
from edgefeed.wan.shaping import DirectionSchedule, LinkParams, RateMeter, TokenBucket

__all__ = [
    "ControlServer",
    "DirectionSchedule",
    "Link",
    "LinkParams",
    "LinkSettingError",
    "LinkSpec",
    "RateMeter",
    "TokenBucket",
    "UnknownLinkError",
    "WanControl",
    "WanControlError",
    "WanError",
]
