"""Composing the pipeline's configuration from the settings file."""

from __future__ import annotations

from connectors.database import table_columns
from edgefeed.settings import EdgefeedSettings, SettingsError
from pipeline.config import PipelineConfig
from pipeline.validate import check_feature_columns

__all__ = ["pipeline_config"]


def pipeline_config(
    settings: EdgefeedSettings, *, check_database: bool = True, region: str | None = None
) -> PipelineConfig:
    """The pipeline's configuration; with ``check_database``, feature columns are checked.

    With ``region``, the Kafka settings are that region's site's (its own broker
    when ``sites.regions`` names one): a regional worker, its changelog and its
    dead letters live there.

    Raises:
        SettingsError: no entities are declared.
        FeatureConfigError: a feature reads a column the database does not have.
    """
    if not settings.entities:
        raise SettingsError(
            "no entities are declared in the settings: add an 'entities:' section "
            "(see examples/edgefeed.yaml)"
        )
    if check_database:
        tables = sorted({t for entity in settings.entities for t in entity.tables})
        check_feature_columns(settings.entities, table_columns(settings.database, tables))
    return PipelineConfig(
        kafka=settings.kafka if region is None else settings.region_kafka(region),
        pipeline=settings.pipeline,
        entities=settings.entities,
        tables=settings.tables(),
        source_topics=settings.topic_of_table(),
        regions=settings.regions,
    )
