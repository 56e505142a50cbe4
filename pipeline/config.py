"""The pipeline's configuration, as the apps need it (no Faust here: the CLI and the
monitor import this without starting a stream processor)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from connectors.settings import TableSettings
from edge_cache import RegionSettings
from pipeline.exceptions import PipelineConfigError
from pipeline.names import PipelineNames
from pipeline.settings import EntitySettings, KafkaSettings, PipelineSettings

__all__ = ["PipelineConfig"]


@dataclass(frozen=True, slots=True)
class PipelineConfig:
    """Everything the apps need, composed from the settings file by the CLI."""

    kafka: KafkaSettings
    pipeline: PipelineSettings
    entities: Sequence[EntitySettings]
    tables: Mapping[str, TableSettings]
    source_topics: Mapping[str, str]  # table -> Debezium topic
    regions: Sequence[RegionSettings]
    extra_faust: Mapping[str, Any] = field(default_factory=dict)

    @property
    def names(self) -> PipelineNames:
        return self.pipeline.names

    @property
    def region_names(self) -> list[str]:
        return [region.name for region in self.regions]

    def region(self, name: str) -> RegionSettings:
        """The region called ``name``.

        Raises:
            PipelineConfigError: no such region.
        """
        for region in self.regions:
            if region.name == name:
                return region
        raise PipelineConfigError(f"region {name!r} not in regions: {', '.join(self.region_names)}")

    def fed_topics(self) -> list[str]:
        """The Debezium topics of tables that feed some entity."""
        tables = {table for entity in self.entities for table in entity.tables}
        return sorted({self.source_topics[table] for table in tables})
