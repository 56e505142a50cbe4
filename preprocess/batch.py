"""Preprocess many images at once, in this process or in a pool of processes.

Decoding and resampling hold the GIL only in part, so CPU parallelism comes
from processes. :class:`PreprocessPool` keeps its processes between calls
(start-up costs a fraction of a second per process); :func:`preprocess_batch`
is the one-call form. A bad image never fails its neighbours: with
``on_error="collect"`` its typed error is returned in its slot.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from preprocess.exceptions import (
    CorruptInputError,
    InputTooLargeError,
    PreprocessError,
    WorkerCrashedError,
)
from preprocess.image import preprocess_image
from preprocess.limits import DEFAULT_LIMITS, Limits
from preprocess.profiles import ImageProfile

__all__ = ["BatchResult", "ImageSource", "PreprocessPool", "preprocess_batch", "read_input"]

ImageSource = bytes | bytearray | memoryview | str | os.PathLike[str]
OnError = Literal["raise", "collect"]


def read_input(source: ImageSource, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """The bytes of ``source`` (bytes as is, or a file path), never more than the limit.

    Raises:
        InputTooLargeError: the file is over ``limits.max_input_bytes``.
        CorruptInputError: the file cannot be read.
    """
    if isinstance(source, bytes | bytearray | memoryview):
        return bytes(source)
    path = Path(source)
    try:
        with path.open("rb") as handle:
            data = handle.read(limits.max_input_bytes + 1)
    except OSError as exc:
        raise CorruptInputError(f"cannot read {str(path)!r}: {exc.strerror or exc}") from None
    if len(data) > limits.max_input_bytes:
        raise InputTooLargeError(
            f"{str(path)!r} is over the limit of {limits.max_input_bytes} bytes "
            "(Limits.max_input_bytes)"
        )
    return data


def _one(
    source: ImageSource, profile: ImageProfile, limits: Limits, fast: bool | None
) -> npt.NDArray[Any] | PreprocessError:
    try:
        return preprocess_image(read_input(source, limits), profile, limits=limits, fast=fast)
    except PreprocessError as exc:
        return exc


def _one_packed(args: tuple[ImageSource, ImageProfile, Limits, bool | None]) -> Any:
    return _one(*args)


@dataclass(frozen=True, slots=True)
class BatchResult:
    """The outcome of a batch, in input order.

    Attributes:
        arrays: One tensor per input, None where the input failed.
        errors: Input index -> the typed error it raised.
    """

    arrays: tuple[npt.NDArray[Any] | None, ...]
    errors: Mapping[int, PreprocessError] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.arrays)

    def __iter__(self) -> Iterator[npt.NDArray[Any] | None]:
        return iter(self.arrays)

    def stack(self) -> npt.NDArray[Any]:
        """All tensors stacked on a new first axis (the model's batch axis).

        Raises:
            PreprocessError: an input failed, or the tensors differ in shape
                (a profile without a crop or letterbox).
        """
        if self.errors:
            index, error = next(iter(sorted(self.errors.items())))
            raise PreprocessError(
                f"{len(self.errors)} of {len(self.arrays)} inputs failed (first: #{index}: "
                f"{error}); drop them before stacking"
            )
        arrays = [a for a in self.arrays if a is not None]
        if len({a.shape for a in arrays}) > 1:
            raise PreprocessError(
                "tensors differ in shape; use a profile with a crop or letterbox to stack"
            )
        return np.stack(arrays)


def _collect(
    results: Sequence[npt.NDArray[Any] | PreprocessError], on_error: OnError
) -> BatchResult:
    errors = {i: r for i, r in enumerate(results) if isinstance(r, PreprocessError)}
    if errors and on_error == "raise":
        raise next(iter(errors.values()))
    return BatchResult(
        tuple(None if isinstance(r, PreprocessError) else r for r in results), errors
    )


class PreprocessPool:
    """A reusable pool of processes that preprocess images.

    Processes start with the ``forkserver`` method, safe in a threaded or
    asyncio server (``fork`` is not). If a process dies (a crash in a native
    decoder, the OOM killer) the inputs in flight get a
    :class:`~preprocess.exceptions.WorkerCrashedError` and the pool restarts.

    Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, workers: int | None = None, *, limits: Limits = DEFAULT_LIMITS) -> None:
        """Args:
        workers: Number of processes (default: the CPUs this process may use).
        limits: Bounds applied to every input.
        """
        count = workers if workers is not None else len(os.sched_getaffinity(0))
        if count < 1:
            raise ValueError(f"workers must be >= 1, got {count}")
        self.workers = count
        self.limits = limits
        self._executor: ProcessPoolExecutor | None = None

    def _pool(self) -> ProcessPoolExecutor:
        if self._executor is None:
            self._executor = ProcessPoolExecutor(
                max_workers=self.workers, mp_context=multiprocessing.get_context("forkserver")
            )
        return self._executor

    def map(
        self,
        sources: Sequence[ImageSource],
        profile: ImageProfile,
        *,
        on_error: OnError = "raise",
        fast: bool | None = None,
    ) -> BatchResult:
        """Preprocess ``sources`` (bytes or paths) with ``profile``, in parallel.

        Raises:
            PreprocessError: the first failed input, when ``on_error="raise"``.
        """
        if not sources:
            return BatchResult(())
        jobs = [(source, profile, self.limits, fast) for source in sources]
        chunk = max(1, len(jobs) // (self.workers * 4))
        try:
            results = list(self._pool().map(_one_packed, jobs, chunksize=chunk))
        except BrokenProcessPool:
            self.close()
            crashed = WorkerCrashedError(
                "a preprocessing process died; retry the inputs one by one to find the culprit"
            )
            results = [crashed] * len(jobs)
        return _collect(results, on_error)

    def close(self) -> None:
        """Stop the processes (idempotent)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def __enter__(self) -> PreprocessPool:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def preprocess_batch(
    sources: Sequence[ImageSource],
    profile: ImageProfile,
    *,
    workers: int | None = 1,
    limits: Limits = DEFAULT_LIMITS,
    on_error: OnError = "raise",
    fast: bool | None = None,
) -> BatchResult:
    """Preprocess many images with one profile.

    Args:
        sources: Encoded images (bytes) or file paths.
        profile: The pipeline to apply.
        workers: 1 runs in this process; N > 1 uses a temporary pool of N
            processes; None uses one per available CPU. Keep a
            :class:`PreprocessPool` instead when calling repeatedly.
        limits: Bounds applied to every input.
        on_error: ``"raise"`` the first error, or ``"collect"`` errors per input.
        fast: Override ``profile.fast``.

    Raises:
        PreprocessError: the first failed input, when ``on_error="raise"``.
    """
    if workers == 1 or len(sources) <= 1:
        return _collect([_one(s, profile, limits, fast) for s in sources], on_error)
    with PreprocessPool(workers, limits=limits) as pool:
        return pool.map(sources, profile, on_error=on_error, fast=fast)
