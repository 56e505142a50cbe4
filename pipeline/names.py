"""Topic and consumer-group names of the pipeline: the one place that derives them.

The pipeline's apps, the monitor (``edgefeed lag``, the exporter) and the tests
all ask this module, so a renamed prefix can never leave one of them watching
the wrong group.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["HOMES_TABLE", "STATE_TABLE", "PipelineNames"]

STATE_TABLE = "entities"  # the regional app's Faust table of entity states
HOMES_TABLE = "homes"  # the router's Faust table of entity homes (pipeline.homes)


@dataclass(frozen=True, slots=True)
class PipelineNames:
    """Names derived from the ``pipeline:`` settings.

    Attributes:
        app_prefix: Prefix of the Faust app ids, which are also the consumer groups.
        region_topic_prefix: A region's change topic is ``<prefix>.<region>``.
        dead_letter_topic: Where events that cannot be processed go, with the reason:
            the router's poison of shared tables, and a pointer (no value) to poison
            of personal tables whose home region is not known. A region's own dead
            letters go to :meth:`region_dead_letter_topic`, so personal rows never
            leave their region.
    """

    app_prefix: str = "edgefeed"
    region_topic_prefix: str = "edgefeed.region"
    dead_letter_topic: str = "edgefeed.deadletter"

    @property
    def router_group(self) -> str:
        """The router's Faust app id and consumer group."""
        return f"{self.app_prefix}-router"

    @property
    def region_group_prefix(self) -> str:
        return f"{self.app_prefix}-region-"

    def region_group(self, region: str) -> str:
        """A region's feature app id and consumer group."""
        return f"{self.region_group_prefix}{region}"

    def region_of_group(self, group: str) -> str | None:
        """The region whose feature group ``group`` is, or None."""
        prefix = self.region_group_prefix
        return (group[len(prefix) :] or None) if group.startswith(prefix) else None

    def forward_group(self, region: str) -> str:
        """The consumer group (on the central broker) of a region's forwarder
        (pipeline.forward), when the region has a broker of its own."""
        return f"{self.app_prefix}-forward-{region}"

    def region_topic(self, region: str) -> str:
        """The topic the router writes a region's changes to."""
        return f"{self.region_topic_prefix}.{region}"

    def region_dead_letter_topic(self, region: str) -> str:
        """A region's dead letters: its worker's, and the router's poison of personal
        rows whose home is this region (``<dead_letter_topic>.<region>``)."""
        return f"{self.dead_letter_topic}.{region}"

    def dead_letter_topics(self, regions: Iterable[str]) -> list[str]:
        """Every dead-letter topic: the central one, then each region's."""
        return [self.dead_letter_topic, *(self.region_dead_letter_topic(r) for r in regions)]

    def changelog_topic(self, region: str) -> str:
        """The changelog of a region's entity states (Faust names a table's changelog
        ``<app id>-<table>-changelog``)."""
        return f"{self.region_group(region)}-{STATE_TABLE}-changelog"

    @property
    def homes_changelog_topic(self) -> str:
        """The router's book of entity homes (compacted; entity key -> home region)."""
        return f"{self.router_group}-{HOMES_TABLE}-changelog"

    @property
    def history_topic(self) -> str:
        """The router's history records (pipeline.history): per windowed table, whether
        the stream's history covers its windows (one partition, compacted)."""
        return f"{self.router_group}-history"

    def owns_group(self, group: str) -> bool:
        """True for the groups of this pipeline (router and regions)."""
        return group == self.router_group or group.startswith(self.region_group_prefix)
