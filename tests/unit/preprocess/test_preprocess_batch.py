from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest

from preprocess import (
    CorruptInputError,
    InputTooLargeError,
    Limits,
    PreprocessError,
    PreprocessPool,
    WorkerCrashedError,
    get_profile,
    preprocess_batch,
    preprocess_image,
    read_input,
)
from preprocess.batch import BatchResult

PROFILE = get_profile("imagenet-224")


def test_pool_matches_in_process_and_stacks(hd_jpegs: dict[str, bytes], tmp_path: Path) -> None:
    names = sorted(hd_jpegs)
    paths = []
    for name in names:
        path = tmp_path / f"{name}.jpg"
        path.write_bytes(hd_jpegs[name])
        paths.append(path)
    serial = preprocess_batch([hd_jpegs[n] for n in names], PROFILE)
    with PreprocessPool(2) as pool:
        parallel = pool.map(paths, PROFILE)
        again = pool.map([str(p) for p in paths[:2]], PROFILE)
    assert len(parallel) == len(names) and not parallel.errors
    for a, b in zip(serial, parallel, strict=True):
        assert a is not None and b is not None
        np.testing.assert_array_equal(a, b)
    stacked = parallel.stack()
    assert stacked.shape == (len(names), 3, 224, 224)
    np.testing.assert_array_equal(stacked[0], preprocess_image(hd_jpegs[names[0]], PROFILE))
    assert len(again) == 2


def test_stack_refuses_failures_and_ragged_shapes() -> None:
    with pytest.raises(PreprocessError, match="1 of 2 inputs failed"):
        BatchResult((np.zeros(2), None), {1: CorruptInputError("bad")}).stack()
    with pytest.raises(PreprocessError, match="differ in shape"):
        BatchResult((np.zeros(2), np.zeros(3))).stack()


def test_read_input_limits_and_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "big.jpg"
    path.write_bytes(b"x" * 101)
    with pytest.raises(InputTooLargeError):
        read_input(path, Limits(max_input_bytes=100))
    assert read_input(path, Limits(max_input_bytes=101)) == b"x" * 101
    with pytest.raises(CorruptInputError, match="cannot read"):
        read_input(tmp_path / "missing.jpg")


def _kill_self(_: object) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_dying_worker_becomes_a_typed_error(
    rocket_jpg: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    with PreprocessPool(1) as pool:
        monkeypatch.setattr("preprocess.batch._one_packed", _kill_self)
        result = pool.map([rocket_jpg], PROFILE, on_error="collect")
        assert isinstance(result.errors[0], WorkerCrashedError)
        monkeypatch.undo()
        # The pool rebuilt itself.
        assert not pool.map([rocket_jpg], PROFILE).errors
