"""Which part of the pipeline one monitor reads and reports: all of it, the central
part, or one region's.

On Kubernetes each region's cache may be read only from inside the region
(residency), so one exporter cannot read everything: a *central* exporter reads
what is not a region's (the router's and forwarders' groups, the central
dead-letter topic, topic offsets, slots, connectors, snapshots, links) and one
exporter *per region* reads that region's cache and its own consumer group.
Every piece has one owner (``None``: central, else a region's name), so the
series of the central exporter and of every region's add up to what one
``all`` exporter shows, none of them twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from monitoring.exceptions import MonitoringConfigError

__all__ = ["ALL", "Scope", "ScopeKind"]

ScopeKind = Literal["all", "central", "region"]

_FORMS = "all, central or region:NAME"


@dataclass(frozen=True, slots=True)
class Scope:
    """The part a monitor covers.

    Attributes:
        kind: ``all`` (everything, the default), ``central`` (everything that is not
            a region's: no cache is read) or ``region`` (one region's cache and group).
        region: The region of a ``region`` scope.
    """

    kind: ScopeKind = "all"
    region: str | None = None

    def __post_init__(self) -> None:
        if (self.kind == "region") != bool(self.region):
            raise MonitoringConfigError(
                f"scope {self.kind!r} with region {self.region!r}: a region scope needs a "
                "region, and only a region scope takes one"
            )

    @classmethod
    def parse(cls, text: str) -> Scope:
        """``all``, ``central`` or ``region:NAME`` (see :meth:`check` for NAME).

        Raises:
            MonitoringConfigError: any other text.
        """
        value = text.strip()
        if value == "all":
            return cls()
        if value == "central":
            return cls("central")
        kind, sep, region = value.partition(":")
        if kind == "region" and sep and region:
            return cls("region", region)
        raise MonitoringConfigError(f"scope {text!r} is not {_FORMS}")

    def check(self, regions: Sequence[str]) -> None:
        """Raise unless a region scope names one of ``regions``.

        Raises:
            MonitoringConfigError: the region is not declared; the message lists them.
        """
        if self.region is not None and self.region not in regions:
            declared = ", ".join(regions) or "(none)"
            raise MonitoringConfigError(
                f"scope {str(self)!r}: region {self.region!r} not in regions: {declared}"
            )

    def owns(self, owner: str | None) -> bool:
        """Whether this scope reports a piece whose owner is ``owner`` (None: central)."""
        if self.kind == "all":
            return True
        if self.kind == "central":
            return owner is None
        return owner == self.region

    @property
    def central(self) -> bool:
        """Reads and reports what no region owns (``all`` and ``central``)."""
        return self.owns(None)

    @property
    def judges_regions(self) -> bool:
        """Judges region caches against the freshness budget (``all`` and ``region``)."""
        return self.kind != "central"

    def __str__(self) -> str:
        return f"region:{self.region}" if self.kind == "region" else self.kind


#: The default: everything, from one process.
ALL = Scope()
