"""Device and precision selection, int8 on the CPU, warm-up estimates."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from workers.exceptions import WorkerConfigError
from workers.models import load_served_model
from workers.runtime import ModelRunner, RuntimeConfig, resolve_device, resolve_precision
from workers.synthetic import shape_images
from workers.train_demo import HELD_OUT_SEED


def test_auto_device_is_the_cpu_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(WorkerConfigError, match="torch sees no CUDA GPU"):
        resolve_device("cuda")
    with pytest.raises(WorkerConfigError, match="'tpu' is not one of"):
        resolve_device("tpu")


def test_auto_device_is_cuda_with_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_precision("auto", torch.device("cuda")) == "fp16"


def test_precision_must_fit_the_device() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_precision("auto", cpu) == "fp32"
    assert resolve_precision("int8", cpu) == "int8"
    assert resolve_precision("bf16", cuda) == "bf16"
    with pytest.raises(WorkerConfigError, match=r"'int8' .* runs on the CPU only"):
        resolve_precision("int8", cuda)
    with pytest.raises(WorkerConfigError, match="'fp16' needs a CUDA device"):
        resolve_precision("fp16", cpu)
    with pytest.raises(WorkerConfigError, match="'fp64' is not one of"):
        resolve_precision("fp64", cpu)


def test_int8_classifier_agrees_with_fp32_on_held_out_images() -> None:
    images, labels = shape_images(200, seed=HELD_OUT_SEED)
    model = load_served_model("image-classifier")
    fp32 = ModelRunner(
        model.module, RuntimeConfig(device="cpu", precision="fp32", max_batch_rows=200)
    )
    int8 = ModelRunner(
        load_served_model("image-classifier").module,
        RuntimeConfig(device="cpu", precision="int8", max_batch_rows=200),
    )
    (exact,), _ = fp32.execute([(images,)])
    (quantized,), _ = int8.execute([(images,)])
    assert int8.describe()["precision"] == "int8"
    agreement = (exact.argmax(1) == quantized.argmax(1)).mean()
    assert agreement >= 0.95
    assert abs((exact.argmax(1) == labels).mean() - (quantized.argmax(1) == labels).mean()) <= 0.03
    assert not np.array_equal(exact, quantized), "int8 must actually quantize"


def test_warm_up_runs_every_bucket_and_seeds_the_estimates() -> None:
    model = load_served_model("image-classifier")
    runner = ModelRunner(
        model.module, RuntimeConfig(device="cpu", max_batch_rows=12, bucket_sizes=(6,))
    )
    assert runner.buckets == (1, 2, 4, 6, 8, 12)
    assert runner.estimate(5) == 0.0
    timings = runner.warm_up(model.example_rows)
    assert sorted(timings) == [1, 2, 4, 6, 8, 12]
    assert all(runner.estimate(rows) > 0 for rows in range(1, 13))
    assert runner.bucket_for(5) == 6


def test_failed_compilation_falls_back_to_the_eager_model(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_compile(module, **kwargs):  # type: ignore[no-untyped-def]
        def fail(*args):  # type: ignore[no-untyped-def]
            raise RuntimeError("no C++ compiler")

        return fail

    monkeypatch.setattr(torch, "compile", broken_compile)
    model = load_served_model("image-classifier")
    runner = ModelRunner(model.module, RuntimeConfig(device="cpu", compile="on", max_batch_rows=2))
    assert runner.static_shapes
    runner.warm_up(model.example_rows)
    assert not runner.static_shapes
    outputs, _ = runner.execute([model.example_rows(2)])
    assert outputs[0].shape == (2, 6)


def test_read_only_request_buffers_run_without_warnings() -> None:
    model = load_served_model("image-classifier")
    runner = ModelRunner(model.module, RuntimeConfig(device="cpu", max_batch_rows=2))
    image = shape_images(1, seed=4)[0]
    image.flags.writeable = False  # like np.frombuffer over a request body
    (output,), _ = runner.execute([(image,)])
    assert output.shape == (1, 6)


class _SlowOffMainThread(torch.nn.Module):
    """A linear layer that takes 30 ms on any thread but the main one: a forward pass
    whose warm-up on the model thread was stalled (OpenMP beside a CPU hog)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.03)
        return self.linear(x)


def _rows(n: int) -> tuple[np.ndarray, ...]:
    return (np.ones((n, 4), dtype=np.float32),)


def test_inline_calibration_replaces_a_stalled_warm_up() -> None:
    runner = ModelRunner(_SlowOffMainThread(), RuntimeConfig(device="cpu", max_batch_rows=4))
    with ThreadPoolExecutor(1) as thread:  # as the server warms up: on the model thread
        thread.submit(runner.warm_up, _rows).result()
    assert runner.fastest(4) >= 0.03 and runner.estimate(4) >= 0.03
    timings = runner.calibrate_inline(_rows, limit_s=0.01)
    assert sorted(timings) == [1, 2, 4]
    # What the event loop's thread pays decides what runs there, and the deadline
    # admission estimates with it.
    assert all(runner.fastest(n) < 0.01 and runner.estimate(n) < 0.01 for n in (1, 2, 3, 4))


def test_inline_calibration_stops_at_the_first_bucket_over_the_limit() -> None:
    runner = ModelRunner(_SlowOffMainThread(), RuntimeConfig(device="cpu", max_batch_rows=4))
    with ThreadPoolExecutor(1) as thread:
        thread.submit(runner.warm_up, _rows).result()
    assert list(runner.calibrate_inline(_rows, limit_s=0.0)) == [1]
    assert runner.fastest(1) < 0.03 <= runner.fastest(2)
