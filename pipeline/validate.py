"""Start-up checks of the feature declarations against the database's real columns."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from pipeline.exceptions import FeatureConfigError
from pipeline.settings import EntitySettings

__all__ = ["check_feature_columns"]


def check_feature_columns(
    entities: Iterable[EntitySettings], columns: Mapping[str, set[str]]
) -> None:
    """Check that every column a feature reads exists.

    Args:
        columns: ``schema.table`` -> its columns, as the database has them.

    Raises:
        FeatureConfigError: listing every missing table and column.
    """
    problems: list[str] = []
    for entity in entities:
        wanted: list[tuple[str, str, str]] = [
            (table, column, "id column") for table, column in entity.tables.items()
        ]
        wanted += [(t, c, "time column") for t, c in entity.time_columns.items()]
        for latest in entity.latest:
            wanted.append((latest.table, latest.column, f"feature {latest.name!r}"))
        for agg in entity.aggregates:
            if agg.column:
                wanted.append((agg.table, agg.column, f"feature {agg.name!r}"))
            for column in agg.where:
                wanted.append((agg.table, column, f"feature {agg.name!r} (where)"))
        for table, column, role in wanted:
            have = columns.get(table, set())
            if not have:
                problems.append(f"entity {entity.name!r}: table {table} does not exist")
            elif column not in have:
                problems.append(
                    f"entity {entity.name!r}: {role} reads column {column!r}, which {table} "
                    f"does not have (columns: {', '.join(sorted(have))})"
                )
    if problems:
        unique = list(dict.fromkeys(problems))
        raise FeatureConfigError(
            "the feature declarations do not match the database:\n  " + "\n  ".join(unique)
        )
