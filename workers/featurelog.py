"""Logs of what the models saw: the served feature values, per request, in Parquet.

A model that reads features (the ranker) can log, per request, the entity ids,
the feature-set version, the read time, the values it was fed, its prediction
and the request's latency terms (T_data, T_model, T_service), for a sampled
share of its requests. Nothing is written on the request path: a sampled
request appends references to a list (the arrays the model already holds); the
list goes to a writer thread every ``flush_rows`` requests or ``flush_s``
seconds, whichever comes first.

The writer thread appends each batch to a temporary Arrow IPC stream
(``*.arrows.tmp``) and, when the file is closed (``max_file_mb`` of Arrow data
or ``max_file_s`` seconds, or the worker stops), writes it to Parquet under a
temporary name and renames it: a file under its final name (``*.parquet``) is
always complete. A killed worker loses what was still in memory (at most
``flush_rows`` requests, or ``flush_s`` seconds of them, plus the batch being
written at the moment of the kill); the stream's complete batches survive and
the next worker started on the same folder turns them into Parquet.

Residency: the folder sink writes under ``dir/<region>/``, the worker's own
region; ``personal: drop`` leaves the ids and values of personal entity types
out of the log altogether (a log that may then be moved anywhere).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import random
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from workers.exceptions import WorkerConfigError

if TYPE_CHECKING:
    import pyarrow as pa

    from workers.models.base import Prepared

__all__ = [
    "TEMP_SUFFIX",
    "FeatureLogSettings",
    "FeatureLogger",
    "LogLayout",
    "LoggedEntity",
    "recover_leftovers",
]

log = logging.getLogger(__name__)

#: Suffix of a file being written (an Arrow IPC stream); never a finished log.
TEMP_SUFFIX = ".arrows.tmp"
_PARQUET_TEMP = ".parquet.tmp"
_NAME = re.compile(r"^featurelog-.*-p(?P<pid>\d+)-c\d+-\d+$")

PersonalRule = Literal["keep", "drop"]

#: Niceness of the writer thread (Linux): below the event loop's, so serving comes first.
WRITER_NICE = 10


class FeatureLogSettings(BaseModel):
    """``workers.feature_log`` in edgefeed.yaml: what model workers log and where.

    Attributes:
        dir: Folder of the logs; each worker writes under ``dir/<region>/<model>/``.
            Put it on storage of the region itself: a personal entity's log must
            not leave its home region.
        sample_rate: Share of requests logged, 0 to 1 (1: every request).
        max_file_mb: A file is closed once it holds this much Arrow data (its
            Parquet file is smaller: compressed).
        max_file_s: A file is closed once it is this old, even when small.
        flush_rows: Logged requests kept in memory before they go to the writer.
        flush_s: Longest a logged request waits in memory (with ``flush_rows``,
            the most a killed worker loses).
        max_pending: Batches waiting for the writer before new ones are dropped
            (and counted): a slow disk never grows the worker's memory unbounded.
        personal: ``keep``: log personal entity types in the region's folder;
            ``drop``: leave their ids and values out.
        seed: Seed of the sampling (None: random); the same seed samples the
            same requests of the same sequence.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    dir: Path
    sample_rate: float = 1.0
    max_file_mb: float = Field(default=64.0, gt=0)
    max_file_s: float = Field(default=300.0, gt=0)
    flush_rows: int = Field(default=1024, ge=1)
    flush_s: float = Field(default=1.0, gt=0)
    max_pending: int = Field(default=64, ge=1)
    personal: PersonalRule = "keep"
    seed: int | None = None

    @field_validator("sample_rate")
    @classmethod
    def _rate(cls, value: float) -> float:
        if not 0.0 <= value <= 1.0:
            raise ValueError(
                f"sample_rate {value!r} must be between 0 and 1 (the share of requests "
                "logged: 0.01 logs one in a hundred, 1 every request)"
            )
        return value


@dataclass(frozen=True, slots=True)
class LoggedEntity:
    """An entity type whose features a model reads, as its log records them.

    Attributes:
        entity: Entity type (``demo_user``).
        id_column: Column of its ids in the log (``user_id``).
        features: Its features, in the order of the model's input.
        input_index: Which of the request's inputs holds its rows.
        version: Its feature-set (schema) version.
        personal: Whether its data is personal (see ``FeatureLogSettings.personal``).
    """

    entity: str
    id_column: str
    features: tuple[str, ...]
    input_index: int
    version: int = 1
    personal: bool = False

    def column(self, feature: str) -> str:
        """The log's column of one of its features: ``entity.feature``."""
        return f"{self.entity}.{feature}"


@dataclass(frozen=True, slots=True)
class LogLayout:
    """What a model's log holds: its entities and how to read a request's ids.

    Attributes:
        entities: The entity types it reads, in input order.
        ids: A request's ids per entity (one sequence each, one id per row, or a
            single id standing for every row), from its :class:`Prepared`.
    """

    entities: tuple[LoggedEntity, ...]
    ids: Callable[[Prepared], Sequence[Sequence[str]]]

    @property
    def feature_set_version(self) -> str:
        """``demo_user=1,demo_item=1``: the versions of the vectors the model read."""
        return ",".join(f"{e.entity}={e.version}" for e in self.entities)


# One logged request: request id, read time (unix s), prepared request, outputs,
# T_data, T_model, T_service (s).
_Entry = tuple[str, float, "Prepared", np.ndarray, float, float, float]
_STOP = object()


def _rows_of(ids: Sequence[str], rows: int) -> Sequence[str]:
    """A request's ids, one per row (a single id stands for every row)."""
    return ids if len(ids) == rows else list(ids) * rows


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def recover_leftovers(folder: Path) -> list[Path]:
    """Turn the temporary files that killed writers left in ``folder`` into Parquet.

    Only files of processes no longer alive are touched (a sibling's file is
    live). Each file's complete batches are kept; a batch cut by the kill is
    dropped. A file with no complete batch is removed.

    Returns:
        The Parquet files written.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    written: list[Path] = []
    for claimed in folder.glob(f"*{TEMP_SUFFIX}.recovering-*"):
        pid = claimed.name.rsplit("-", 1)[1]
        if pid.isdigit() and not _pid_alive(int(pid)):  # its recoverer died: try again
            with contextlib.suppress(OSError):
                os.rename(claimed, claimed.with_name(claimed.name.rsplit(".recovering-", 1)[0]))
    for temp in sorted(folder.glob(f"*{TEMP_SUFFIX}")):
        stem = temp.name[: -len(TEMP_SUFFIX)]
        match = _NAME.match(stem)
        if match is None or _pid_alive(int(match["pid"])):
            continue
        claimed = temp.with_name(f"{temp.name}.recovering-{os.getpid()}")
        try:
            os.rename(temp, claimed)  # atomic: two recovering siblings never both win
        except FileNotFoundError:
            continue
        final = folder / f"{stem}.parquet"
        batches: list[pa.RecordBatch] = []
        with (
            contextlib.suppress(pa.ArrowInvalid, OSError, EOFError),
            pa.OSFile(str(claimed), "rb") as source,
        ):
            for batch in pa.ipc.open_stream(source):
                batches.append(batch)
        if batches and not final.exists():
            staging = folder / f"{stem}{_PARQUET_TEMP}"
            pq.write_table(pa.Table.from_batches(batches), staging)
            os.replace(staging, final)
            written.append(final)
            log.warning(
                "feature log: recovered %d rows a stopped writer left in %s into %s",
                sum(b.num_rows for b in batches),
                temp.name,
                final.name,
            )
        claimed.unlink(missing_ok=True)
    for staging in folder.glob(f"*{_PARQUET_TEMP}"):
        match = _NAME.match(staging.name[: -len(_PARQUET_TEMP)])
        if match is not None and not _pid_alive(int(match["pid"])):
            staging.unlink(missing_ok=True)  # a Parquet file cut mid-write: its stream is kept
    return written


class FeatureLogger:
    """Samples one model's requests and writes them to Parquet from a thread.

    Args:
        settings: The ``workers.feature_log`` settings.
        layout: The model's :class:`LogLayout`.
        model: Model name (a folder and a column).
        model_version: Model version (a column).
        region: The worker's region (a folder and a column).
        child: This process's index among ``--processes N`` (in file names).
        clock: Monotonic seconds, for the files' ages (tests pass their own).
        counted: Called with an outcome and a number of requests whenever sampled
            requests are ``written`` (to the open stream), ``dropped`` (the writer
            was ``max_pending`` batches behind) or ``lost`` (a write failed, e.g. a
            full disk); the worker counts them in
            ``edgefeed_worker_feature_log_requests_total``. Called from the event
            loop (dropped) and the writer thread (written, lost).
    """

    def __init__(
        self,
        settings: FeatureLogSettings,
        layout: LogLayout,
        *,
        model: str,
        model_version: str,
        region: str,
        child: int = 0,
        clock: Callable[[], float] = time.monotonic,
        counted: Callable[[str, int], None] | None = None,
    ) -> None:
        self._clock = clock
        self._counted = counted
        self.settings = settings
        self.model = model
        self.model_version = model_version
        self.region = region
        self.child = child
        drop = settings.personal == "drop"
        self.layout = layout
        self.entities = tuple(e for e in layout.entities if not (drop and e.personal))
        self.folder = settings.dir / region / model
        self._rate = settings.sample_rate
        self._rng = random.Random(settings.seed)
        self._buffer: list[_Entry] = []
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=settings.max_pending)
        self._thread: threading.Thread | None = None
        self._timer: Any = None
        self._seq = itertools.count()
        self._sink: Any = None  # the open stream: (path, file, writer, opened, bytes)
        self._schema: pa.Schema | None = None
        #: Requests offered, logged (sampled), dropped (writer behind), and files closed.
        self.offered = 0
        self.sampled = 0
        self.dropped = 0
        self.errors = 0
        self.files: list[Path] = []

    # -- the request path ---------------------------------------------------

    def offer(
        self,
        request_id: str,
        read_time: float,
        prepared: Prepared,
        output: np.ndarray,
        data_s: float,
        model_s: float,
        service_s: float,
    ) -> bool:
        """Log one served request, if sampled. Cheap: no I/O, no conversion.

        Returns:
            Whether it was sampled.
        """
        self.offered += 1
        if self._rate < 1.0 and self._rng.random() >= self._rate:
            return False
        self.sampled += 1
        # The batch's output array may be reused by the next batch: keep a copy
        # of this request's rows (a few floats).
        self._buffer.append(
            (request_id, read_time, prepared, np.array(output), data_s, model_s, service_s)
        )
        if len(self._buffer) >= self.settings.flush_rows:
            self.flush()
        return True

    def flush(self) -> None:
        """Hand the buffered requests to the writer thread (drop them when it is behind)."""
        if not self._buffer:
            return
        batch, self._buffer = self._buffer, []
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += len(batch)
            self._count("dropped", len(batch))
            log.warning(
                "feature log of %s: the writer is %d batches behind; %d requests not logged",
                self.model,
                self.settings.max_pending,
                len(batch),
            )

    def _count(self, outcome: str, requests: int) -> None:
        if self._counted is None:
            return
        try:
            self._counted(outcome, requests)
        except Exception:  # a metric must never cost the log or the request
            log.exception("feature log of %s: counting %s requests failed", self.model, outcome)

    # -- life cycle ------------------------------------------------------------

    def start(self, loop: Any = None) -> None:
        """Start the writer thread (it first recovers leftovers); with ``loop``, flush
        the buffer every ``flush_s`` on it.

        Raises:
            WorkerConfigError: the folder cannot be created.
        """
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise WorkerConfigError(
                f"feature log folder {str(self.folder)!r} cannot be created ({exc.strerror}); "
                "fix workers.feature_log.dir or its permissions"
            ) from None
        self._thread = threading.Thread(
            target=self._run, name=f"edgefeed-featurelog-{self.model}", daemon=True
        )
        self._thread.start()
        if loop is not None:
            self._timer = loop.call_later(self.settings.flush_s, self._tick, loop)

    def _tick(self, loop: Any) -> None:
        self.flush()
        self._timer = loop.call_later(self.settings.flush_s, self._tick, loop)

    def wait_written(self) -> None:
        """Flush, then block until the writer has written every batch handed to it
        (to its open stream; files are renamed when closed)."""
        self.flush()
        self._queue.join()

    def stop_timer(self) -> None:
        """Stop flushing on the event loop (call on the loop's thread)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def close(self) -> None:
        """Flush, close the open file (renamed to its final name) and stop the thread."""
        self.stop_timer()
        self.flush()
        if self._thread is None:
            return
        self._queue.put(_STOP)
        self._thread.join()
        self._thread = None

    # -- the writer thread -------------------------------------------------------

    def _run(self) -> None:
        # Linux gives each thread its own nice value: the writer yields the CPU to the
        # event loop whenever both want it (its batches wait in the queue meanwhile).
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        try:
            recover_leftovers(self.folder)
        except Exception:  # a leftover must never stop logging
            self.errors += 1
            log.exception("feature log: recovering leftovers in %s failed", self.folder)
        while True:
            timeout = None
            if self._sink is not None:
                timeout = max(0.01, self._sink[3] + self.settings.max_file_s - self._clock())
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:
                item = None
            if item is _STOP:
                try:
                    self._close_file()
                except Exception:  # the stream stays on disk: the next start recovers it
                    self.errors += 1
                    log.exception("feature log of %s: closing the last file failed", self.model)
                self._queue.task_done()
                return
            try:
                self._roll_if_due()  # a file past its age takes no more rows
                if item is not None:
                    self._write(self._to_batch(item))
                    self._count("written", len(item))
                    self._roll_if_due()
            except Exception:  # a full disk costs log rows, never the worker
                self.errors += 1
                log.exception("feature log of %s: writing failed; rows lost", self.model)
                self._abandon()
                if item is not None:
                    self._count("lost", len(item))
            finally:
                if item is not None:
                    self._queue.task_done()

    def _roll_if_due(self) -> None:
        if self._sink is None:
            return
        _, _, _, opened, size = self._sink
        too_big = size >= self.settings.max_file_mb * 1024 * 1024
        if too_big or self._clock() - opened >= self.settings.max_file_s:
            self._close_file()

    def _write(self, batch: pa.RecordBatch) -> None:
        import pyarrow as pa

        if self._sink is None:
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
            stem = f"featurelog-{stamp}-p{os.getpid()}-c{self.child}-{next(self._seq):05d}"
            path = self.folder / f"{stem}{TEMP_SUFFIX}"
            sink = pa.OSFile(str(path), "wb")
            writer = pa.ipc.new_stream(sink, batch.schema)
            self._sink = [path, sink, writer, self._clock(), 0]
        path, sink, writer, _, _ = self._sink
        writer.write_batch(batch)
        sink.flush()  # in the OS's hands: survives a SIGKILL of this process
        self._sink[4] = sink.tell()

    def _close_file(self) -> None:
        if self._sink is None:
            return
        import pyarrow as pa
        import pyarrow.parquet as pq

        path, sink, writer, _, _ = self._sink
        self._sink = None
        writer.close()
        sink.close()
        stem = path.name[: -len(TEMP_SUFFIX)]
        final = path.with_name(f"{stem}.parquet")
        staging = path.with_name(f"{stem}{_PARQUET_TEMP}")
        with pa.memory_map(str(path), "r") as source:
            table = pa.ipc.open_stream(source).read_all()
        pq.write_table(table, staging, compression="zstd")
        os.replace(staging, final)  # atomic: the final name only ever holds a whole file
        path.unlink()
        self.files.append(final)

    def _abandon(self) -> None:
        """After a failed write: close what is open and keep the stream for recovery."""
        if self._sink is None:
            return
        _, sink, writer, _, _ = self._sink
        self._sink = None
        with contextlib.suppress(Exception):
            writer.close()
        with contextlib.suppress(Exception):
            sink.close()

    def _to_batch(self, entries: list[_Entry]) -> pa.RecordBatch:
        import pyarrow as pa

        # Arrow builds each column from one value per request (or one in all) and a
        # take(): no Python object per row, so the writer holds the GIL briefly.
        rows = np.fromiter((entry[2].rows for entry in entries), np.int64, len(entries))
        total = int(rows.sum())
        of_request = pa.array(np.repeat(np.arange(len(entries), dtype=np.int32), rows))
        starts = np.repeat(np.cumsum(rows) - rows, rows)

        def constant(value: str) -> pa.Array:
            return pa.array([value], pa.string()).take(pa.array(np.zeros(total, np.int32)))

        columns: dict[str, Any] = {
            "request_id": pa.array([e[0] for e in entries], pa.string()).take(of_request),
            "row": pa.array((np.arange(total) - starts).astype(np.int32)),
            "read_time": pa.array(
                (np.array([e[1] for e in entries]) * 1e6).astype(np.int64),
                pa.timestamp("us", tz="UTC"),
            ).take(of_request),
            "region": constant(self.region),
            "model": constant(self.model),
            "model_version": constant(self.model_version),
            "feature_set_version": constant(self.layout.feature_set_version),
        }
        ids = [self.layout.ids(entry[2]) for entry in entries]
        for position, entity in enumerate(self.layout.entities):
            if entity not in self.entities:
                continue
            mine = [request_ids[position] for request_ids in ids]
            if all(len(one) == 1 for one in mine):  # one id standing for every row
                column = pa.array([one[0] for one in mine], pa.string()).take(of_request)
            else:
                column = pa.array(
                    [i for one, n in zip(mine, rows, strict=True) for i in _rows_of(one, n)],
                    pa.string(),
                )
            columns[entity.id_column] = column
            values = np.concatenate(
                [
                    np.asarray(e[2].inputs[entity.input_index]).reshape(int(n), -1)
                    for e, n in zip(entries, rows, strict=True)
                ]
            ).T.copy()  # one contiguous row per feature: each column is a view
            for j, feature in enumerate(entity.features):
                columns[entity.column(feature)] = pa.array(values[j])
        outputs = [np.asarray(e[3]).reshape(int(n), -1) for e, n in zip(entries, rows, strict=True)]
        prediction = np.concatenate(outputs)
        if prediction.shape[1] == 1:
            columns["prediction"] = pa.array(prediction[:, 0])
        else:
            flat = pa.array(prediction.reshape(-1))
            columns["prediction"] = pa.FixedSizeListArray.from_arrays(flat, prediction.shape[1])
        terms = np.array([(e[4], e[5], e[6]) for e in entries], dtype=np.float32) * 1e3
        for position, name in enumerate(("t_data_ms", "t_model_ms", "t_service_ms")):
            columns[name] = pa.array(terms[:, position]).take(of_request)
        return pa.RecordBatch.from_pydict(columns)
