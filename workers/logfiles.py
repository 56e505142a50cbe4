"""Reading feature logs back: a folder's summary, and logs joined with labels.

The files are those :mod:`workers.featurelog` writes: ``*.parquet`` files are
complete (written under a temporary name, then renamed); ``*.arrows.tmp`` and
``*.parquet.tmp`` files are a writer's work in progress, or what a killed
writer left (the next worker started on the folder recovers them).

Two joins with labels (``edgefeed features logs join``):

``request``
    Labels carry the ``request_id`` the worker answered in its
    ``X-Edgefeed-Request-Id`` header, plus any id column of the log they also
    have (the ranker's ``item_id``): each label gets exactly the row the model
    scored. Labels of requests that were not sampled have no row and are left out.
``asof``
    Labels carry entity ids (``user_id``, ``item_id``: every id column the log
    has that they have too) and a time (``--time-column``, with a time zone):
    each label gets the latest logged row of the same ids read at or before its
    time, within ``tolerance_s``. Labels with none are left out.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from workers.exceptions import FeatureLogError
from workers.featurelog import TEMP_SUFFIX

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["JoinMode", "JoinReport", "LogFile", "LogSummary", "join_labels", "summarize"]

JoinMode = Literal["request", "asof"]
_TEMP_MARKERS = (TEMP_SUFFIX, ".parquet.tmp", ".recovering-")
_META = ("read_time", "feature_set_version", "model", "model_version", "region")


@dataclass(frozen=True, slots=True)
class LogFile:
    """One complete log file: its rows and the read times it spans."""

    path: Path
    rows: int
    start: object  # datetime (None when empty)
    end: object


@dataclass(slots=True)
class LogSummary:
    """What a log folder holds.

    Attributes:
        files: The complete Parquet files.
        corrupt: Files named ``*.parquet`` that cannot be read, with why.
        temporary: Files being written, or left by a killed writer.
        versions: Rows per feature-set version (``demo_user=1,demo_item=1``).
        models: Rows per ``model:version``.
        regions: Rows per region.
        entities: The entity types logged.
    """

    files: list[LogFile] = field(default_factory=list)
    corrupt: list[tuple[Path, str]] = field(default_factory=list)
    temporary: list[Path] = field(default_factory=list)
    versions: Counter[str] = field(default_factory=Counter)
    models: Counter[str] = field(default_factory=Counter)
    regions: Counter[str] = field(default_factory=Counter)
    entities: set[str] = field(default_factory=set)

    @property
    def rows(self) -> int:
        return sum(f.rows for f in self.files)

    @property
    def start(self) -> object:
        starts = [f.start for f in self.files if f.start is not None]
        return min(starts) if starts else None  # type: ignore[type-var]

    @property
    def end(self) -> object:
        ends = [f.end for f in self.files if f.end is not None]
        return max(ends) if ends else None  # type: ignore[type-var]


def _files(folder: Path) -> tuple[list[Path], list[Path]]:
    if not folder.is_dir():
        raise FeatureLogError(
            f"feature log folder {str(folder)!r} does not exist or is not a folder; give the "
            "workers.feature_log.dir of the settings (or one region's folder under it)"
        )
    complete, temporary = [], []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        if any(marker in path.name for marker in _TEMP_MARKERS):
            temporary.append(path)
        elif path.suffix == ".parquet":
            complete.append(path)
    return complete, temporary


def _read(path: Path, *, labels: bool = False) -> pa.Table:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        if labels:
            raise FeatureLogError(
                f"labels file {str(path)!r} cannot be read as Parquet "
                f"({type(exc).__name__}: {exc}); give a Parquet file of labels"
            ) from None
        raise FeatureLogError(
            f"{str(path)!r} is not a readable Parquet file ({type(exc).__name__}: {exc}); "
            "move it out of the folder (a log file under its final name is always whole: "
            "this one was not written by a feature log)"
        ) from None


def summarize(folder: Path) -> LogSummary:
    """Rows, time span, versions, entity types and files of a log folder.

    Corrupt files are listed, not raised: the summary is how one finds them.

    Raises:
        FeatureLogError: the folder does not exist.
    """
    import pyarrow.compute as pc

    complete, temporary = _files(folder)
    summary = LogSummary(temporary=temporary)
    for path in complete:
        try:
            table = _read(path)
            missing = [name for name in _META if name not in table.column_names]
            if missing:
                raise FeatureLogError(f"not a feature log: no column {', '.join(missing)}")
        except FeatureLogError as exc:
            summary.corrupt.append((path, str(exc)))
            continue
        times = table.column("read_time")
        bounds = pc.min_max(times).as_py() if table.num_rows else {"min": None, "max": None}
        summary.files.append(LogFile(path, table.num_rows, bounds["min"], bounds["max"]))
        for name, counter in (
            ("feature_set_version", summary.versions),
            ("region", summary.regions),
        ):
            for value, count in _counts(table.column(name)):
                counter[value] += count
        model = pc.binary_join_element_wise(table["model"], table["model_version"], ":")
        for value, count in _counts(model):
            summary.models[value] += count
        for version, _ in _counts(table.column("feature_set_version")):
            summary.entities.update(part.split("=", 1)[0] for part in version.split(","))
    return summary


def _counts(column: pa.ChunkedArray) -> list[tuple[str, int]]:
    import pyarrow.compute as pc

    return [(str(v["values"]), int(v["counts"])) for v in pc.value_counts(column).to_pylist()]


@dataclass(frozen=True, slots=True)
class JoinReport:
    """What :func:`join_labels` wrote.

    Attributes:
        out: The training set.
        rows: Its rows.
        labels: Rows of the labels file.
        unmatched: Labels with no logged row (not sampled, or too old).
        keys: The columns joined on.
    """

    out: Path
    rows: int
    labels: int
    unmatched: int
    keys: tuple[str, ...]


def _load_logs(folder: Path) -> pa.Table:
    import pyarrow as pa

    complete, _ = _files(folder)
    if not complete:
        raise FeatureLogError(
            f"feature log folder {str(folder)!r} holds no log file (*.parquet); is logging "
            "on (workers.feature_log) and has a file been closed yet (max_file_s)?"
        )
    return pa.concat_tables([_read(path) for path in complete], promote_options="default")


def _id_columns(logs: pa.Table) -> list[str]:
    """The log's entity id columns (``user_id``, ``item_id``)."""
    return [
        name
        for name in logs.column_names
        if name.endswith("_id") and name != "request_id" and "." not in name
    ]


def join_labels(
    folder: Path,
    labels_path: Path,
    out: Path,
    *,
    on: JoinMode = "request",
    time_column: str = "timestamp",
    tolerance_s: float = 3600.0,
) -> JoinReport:
    """Join a log folder with a labels file into a Parquet training set.

    Args:
        folder: The log folder (or any folder above its files).
        labels_path: Parquet labels (see the module's docstring for the columns).
        out: Where to write the training set.
        on: ``request`` or ``asof`` (see the module's docstring).
        time_column: With ``asof``: the labels' time column (timestamp with a zone).
        tolerance_s: With ``asof``: how far back a logged row may be.

    Raises:
        FeatureLogError: a corrupt file, a labels file without the join columns,
            naive label times, no log files.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    logs = _load_logs(folder)
    labels = _read(labels_path, labels=True)
    ids = _id_columns(logs)
    shared = [name for name in ids if name in labels.column_names]
    have = ", ".join(labels.column_names) or "(none)"
    if on == "request":
        if "request_id" not in labels.column_names:
            raise FeatureLogError(
                f"labels file {str(labels_path)!r} has no column 'request_id' (its columns: "
                f"{have}); record the worker's X-Edgefeed-Request-Id answer header with each "
                f"label, or join with --on asof on {', '.join(ids)} and a time column"
            )
        keys = ["request_id", *shared]
        labels = labels.cast(_with_string_keys(labels.schema, keys))
        joined = labels.join(logs, keys, join_type="inner", right_suffix="_log")
    else:
        if not shared:
            raise FeatureLogError(
                f"labels file {str(labels_path)!r} has none of the log's id columns "
                f"({', '.join(ids)}; its columns: {have}); add them to join --on asof"
            )
        keys = [*shared, time_column]
        if time_column not in labels.column_names:
            raise FeatureLogError(
                f"labels file {str(labels_path)!r} has no column {time_column!r} (its columns: "
                f"{have}); name the labels' time column with --time-column"
            )
        kind = labels.schema.field(time_column).type
        if not pa.types.is_timestamp(kind) or kind.tz is None:
            raise FeatureLogError(
                f"labels column {time_column!r} is {kind}, not a timestamp with a time zone; "
                "write the label times as timestamps with a zone (UTC) so they compare with "
                "the logs' read times"
            )
        utc = pa.timestamp("us", tz="UTC")
        labels = labels.cast(_with_string_keys(labels.schema, shared)).set_column(
            labels.schema.get_field_index(time_column),
            time_column,
            labels.column(time_column).cast(utc),
        )
        logs = logs.rename_columns(
            [time_column if name == "read_time" else name for name in logs.column_names]
        )
        logs = logs.append_column("read_time", logs.column(time_column))
        clash = [n for n in logs.column_names if n in labels.column_names and n not in keys]
        logs = logs.rename_columns([f"{n}_log" if n in clash else n for n in logs.column_names])
        joined = labels.sort_by(time_column).join_asof(
            logs.sort_by(time_column),
            on=time_column,
            by=shared,
            tolerance=-round(tolerance_s * 1e6),
        )
        joined = joined.filter(joined["request_id"].is_valid())
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(out.name + ".tmp")
    pq.write_table(joined, staging)
    staging.replace(out)
    return JoinReport(
        out,
        joined.num_rows,
        labels.num_rows,
        labels.num_rows - _matched(joined, labels, keys),
        tuple(keys),
    )


def _matched(joined: pa.Table, labels: pa.Table, keys: list[str]) -> int:
    """Labels that found a row (a label may find several: a request of many items)."""
    present = [k for k in keys if k in joined.column_names]
    groups = int(joined.select(present).group_by(present).aggregate([]).num_rows)
    return min(int(labels.num_rows), groups)


def _with_string_keys(schema: pa.Schema, keys: list[str]) -> pa.Schema:
    """``schema`` with the key columns as strings (the log's ids are strings)."""
    import pyarrow as pa

    return pa.schema(
        [field.with_type(pa.string()) if field.name in keys else field for field in schema],
        metadata=schema.metadata,
    )
