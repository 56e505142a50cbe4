"""Where and how a model runs: device, precision, compilation, warm-up, transfers.

The same ``torch.nn.Module`` runs everywhere; only this module knows about the
hardware. On CUDA it uses half precision (fp16 or bf16), pinned host memory with
non-blocking copies, and ``torch.compile(mode="reduce-overhead")`` (CUDA graphs)
with batches padded to a few fixed sizes so the captured graphs are reused. On
the CPU it runs fp32 or int8 dynamic quantization of the ``Linear`` layers.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

try:
    import torch
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        "the model workers need PyTorch: pip install torch==2.13.0 'edgefeed[workers]'"
    ) from exc

from workers.exceptions import WorkerConfigError

__all__ = [
    "DeviceName",
    "ModelRunner",
    "Precision",
    "RuntimeConfig",
    "quantize_int8",
    "resolve_device",
    "resolve_precision",
]

DeviceName = Literal["auto", "cpu", "cuda"]
Precision = Literal["auto", "fp32", "fp16", "bf16", "int8"]
CompileMode = Literal["auto", "on", "off"]

log = logging.getLogger(__name__)

_FLOAT_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def resolve_device(device: DeviceName | str) -> torch.device:
    """``auto`` is CUDA when a GPU is visible, else the CPU.

    Raises:
        WorkerConfigError: ``cuda`` asked for but no GPU is visible, or an unknown name.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        return torch.device("cpu")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise WorkerConfigError(
                f"device {device!r} asked for but torch sees no CUDA GPU "
                f"(torch {torch.__version__}); use --device cpu or auto"
            )
        return torch.device(device)
    raise WorkerConfigError(f"device {device!r} is not one of: auto, cpu, cuda, cuda:N")


def resolve_precision(precision: Precision | str, device: torch.device) -> str:
    """``auto`` is fp16 on CUDA and fp32 on the CPU; int8 is CPU-only, fp16/bf16 CUDA-only.

    Raises:
        WorkerConfigError: the precision does not exist or does not fit the device.
    """
    if precision == "auto":
        return "fp16" if device.type == "cuda" else "fp32"
    if precision not in ("fp32", "fp16", "bf16", "int8"):
        raise WorkerConfigError(
            f"precision {precision!r} is not one of: auto, fp32, fp16, bf16, int8"
        )
    if precision == "int8" and device.type != "cpu":
        raise WorkerConfigError(
            "precision 'int8' (dynamic quantization) runs on the CPU only; use fp16 or bf16 on CUDA"
        )
    if precision in ("fp16", "bf16") and device.type != "cuda":
        raise WorkerConfigError(
            f"precision {precision!r} needs a CUDA device; on the CPU use fp32 or int8"
        )
    return precision


@dataclass(frozen=True, slots=True)
class RuntimeConfig:
    """How to run a model.

    Attributes:
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
        precision: ``auto`` (fp16 on CUDA, fp32 on CPU), fp32, fp16, bf16, int8.
        compile: ``auto`` compiles with CUDA graphs on CUDA only; ``on`` also on
            the CPU (needs a C++ compiler, slow start); ``off`` never.
        max_batch_rows: The largest batch the runner must handle.
        bucket_sizes: Batch sizes warmed up (and, with static shapes, padded
            to); default: powers of two up to ``max_batch_rows`` plus it.
        cpu_threads: ``torch.set_num_threads`` for the forward pass (None: torch's default).
    """

    device: str = "auto"
    precision: str = "auto"
    compile: CompileMode = "auto"
    max_batch_rows: int = 32
    bucket_sizes: tuple[int, ...] = ()
    cpu_threads: int | None = None


def default_buckets(max_rows: int, extra: Sequence[int] = ()) -> tuple[int, ...]:
    """Powers of two up to ``max_rows``, plus ``max_rows`` and ``extra``, sorted."""
    sizes = {1 << i for i in range(int(math.log2(max_rows)) + 1)} | {max_rows, *extra}
    return tuple(sorted(s for s in sizes if 1 <= s <= max_rows))


def quantize_int8(module: torch.nn.Module) -> torch.nn.Module:
    """An int8 copy of ``module``: dynamic quantization of its ``Linear`` layers
    (weights int8, activations quantized per batch), as ``precision="int8"`` serves it.
    ``module`` itself is left as it is."""
    # torch.ao.quantization warns (DeprecationWarning, and a UserWarning for the
    # quantized tensor constructors) that it will move to torchao; it still ships
    # in torch 2.x with fbgemm int8 GEMM kernels, which is what a CPU worker wants.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*quantize.*deprecated", category=UserWarning)
        from torch.ao.quantization import quantize_dynamic

        quantized: torch.nn.Module = quantize_dynamic(  # type: ignore[no-untyped-call]
            module, {torch.nn.Linear}, dtype=torch.qint8
        )
    return quantized


@dataclass(slots=True)
class _Estimate:
    """Exponentially weighted forward time of one bucket size, in seconds, and the
    fastest seen (what the work costs when the machine is not contended)."""

    seconds: float
    alpha: float = 0.2
    fastest: float = float("inf")

    def __post_init__(self) -> None:
        self.fastest = min(self.fastest, self.seconds)

    def update(self, sample: float) -> None:
        self.seconds += self.alpha * (sample - self.seconds)
        self.fastest = min(self.fastest, sample)


@dataclass(slots=True)
class ModelRunner:
    """Runs one model's forward pass on batches of numpy rows.

    ``execute`` is called from one worker thread at a time (the batcher's); the
    estimates it keeps feed the batcher's deadline admission.

    Args:
        module: The model in eval mode, fp32, on the CPU; the runner moves,
            casts, quantizes and compiles it.
        example_rows: Makes ``n`` rows of valid input (a tuple of arrays with
            leading dimension ``n``) for warm-up.
        config: Device and precision.
    """

    module: torch.nn.Module
    config: RuntimeConfig
    device: torch.device = field(init=False)
    precision: str = field(init=False)
    buckets: tuple[int, ...] = field(init=False)
    static_shapes: bool = field(init=False)
    _eager: torch.nn.Module | None = field(init=False, default=None)
    _estimates: dict[int, _Estimate] = field(init=False, default_factory=dict)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.config.max_batch_rows < 1:
            raise WorkerConfigError(
                f"max batch size {self.config.max_batch_rows} must be at least 1"
            )
        self.device = resolve_device(self.config.device)
        self.precision = resolve_precision(self.config.precision, self.device)
        self.buckets = default_buckets(self.config.max_batch_rows, self.config.bucket_sizes)
        if self.device.type == "cpu" and self.config.cpu_threads:
            torch.set_num_threads(self.config.cpu_threads)
        module = self.module
        with contextlib.suppress(NotImplementedError):  # torch.export modules have no eval()
            module.eval()
        if self.precision == "int8":
            module = quantize_int8(module)
        else:
            module = module.to(device=self.device, dtype=_FLOAT_DTYPES[self.precision])
        use_compile = self.config.compile == "on" or (
            self.config.compile == "auto" and self.device.type == "cuda"
        )
        # CUDA graphs replay fixed shapes: pad every batch to a bucket size so a
        # handful of graphs (one per bucket, captured at warm-up) serve all traffic.
        self.static_shapes = use_compile
        if use_compile:
            self._eager = module
            module = torch.compile(module, mode="reduce-overhead", dynamic=False)  # type: ignore[assignment]
        self.module = module

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype floating inputs are cast to before the forward pass."""
        return torch.float32 if self.precision == "int8" else _FLOAT_DTYPES[self.precision]

    def describe(self) -> dict[str, Any]:
        """Device, precision and compilation, for /v1/models and logs."""
        return {
            "device": str(self.device),
            "precision": self.precision,
            "compiled": self.static_shapes,
            "buckets": list(self.buckets),
        }

    @property
    def inline_ok(self) -> bool:
        """True when batches may run on another thread than the one that prepared the
        model: on the CPU, uncompiled (CUDA graphs belong to the capturing thread)."""
        return self.device.type == "cpu" and not self.static_shapes

    def apply_threads(self, threads: int | None = None) -> None:
        """Set the calling thread's torch thread count (OpenMP's is per thread):
        ``threads``, else ``cpu_threads`` when configured."""
        count = threads or self.config.cpu_threads
        if self.device.type == "cpu" and count:
            torch.set_num_threads(count)

    def bucket_for(self, rows: int) -> int:
        """The smallest bucket size holding ``rows`` (rows itself beyond the largest)."""
        for size in self.buckets:
            if size >= rows:
                return size
        return rows

    def estimate(self, rows: int) -> float:
        """Expected forward time in seconds of a batch of ``rows`` rows (0 before warm-up)."""
        with self._lock:
            if not self._estimates:
                return 0.0
            bucket = self.bucket_for(rows)
            if bucket in self._estimates:
                return self._estimates[bucket].seconds
            largest = max(self._estimates)
            return self._estimates[largest].seconds * rows / largest

    def fastest(self, rows: int) -> float:
        """The fastest forward pass seen for ``rows`` rows' bucket, in seconds (0 before
        warm-up): the cost of the work itself, which CPU contention does not inflate.
        Decides whether a batch is small enough to run on the event loop."""
        with self._lock:
            if not self._estimates:
                return 0.0
            bucket = self.bucket_for(rows)
            if bucket in self._estimates:
                return self._estimates[bucket].fastest
            largest = max(self._estimates)
            return self._estimates[largest].fastest * rows / largest

    def warm_up(self, example_rows: Any, rounds: int = 2) -> dict[int, float]:
        """Run every bucket size ``rounds`` times; seed the estimates; return ms per bucket.

        The first calls pay for allocator growth, oneDNN/cuBLAS plan selection and
        (with compile) graph capture, so the first user request does not.
        """
        timings: dict[int, float] = {}
        if self._eager is not None:
            try:
                self._forward([example_rows(self.buckets[0])])
            except Exception:  # compilation needs a toolchain (Triton, a C++ compiler)
                log.warning("torch.compile failed; serving the eager model", exc_info=True)
                self.module, self._eager, self.static_shapes = self._eager, None, False
        for size in self.buckets:
            inputs = example_rows(size)
            fastest = float("inf")
            for _ in range(max(1, rounds)):
                _, elapsed = self._forward([inputs])
                fastest = min(fastest, elapsed)
            with self._lock:
                self._estimates[size] = _Estimate(elapsed, fastest=fastest)
            timings[size] = elapsed * 1e3
        return timings

    def calibrate_inline(
        self, example_rows: Any, limit_s: float, rounds: int = 5
    ) -> dict[int, float]:
        """Time the buckets as the calling thread runs them, smallest first, up to the
        first slower than ``limit_s``; those buckets' estimates become these timings.

        :meth:`warm_up` times batches on the model thread with torch's default
        thread count. Batches under ``inline_forward_s`` run instead on the event
        loop's thread with one torch thread (see the server), and it is their cost
        that decides which batches go there. Beside a CPU hog the two differ by
        orders of magnitude: OpenMP's threads wait at every barrier for a sibling the
        kernel has descheduled, and a 0.2 ms forward pass of the ranker took 60-80 ms
        in warm-up, so every batch went to the model thread and paid that again. A
        thread of its own is preempted now and then, not at every barrier: the
        fastest of ``rounds`` is the work's cost.

        Returns:
            The fastest time per calibrated bucket, in ms.
        """
        timings: dict[int, float] = {}
        for size in self.buckets:
            inputs = example_rows(size)
            samples = sorted(self._forward([inputs])[1] for _ in range(max(1, rounds)))
            timings[size] = samples[0] * 1e3
            with self._lock:
                # The median, not the last sample: one preemption must not set it.
                self._estimates[size] = _Estimate(samples[len(samples) // 2], fastest=samples[0])
            if samples[0] > limit_s:
                break
        return timings

    def execute(self, batch: Sequence[tuple[np.ndarray, ...]]) -> tuple[list[np.ndarray], float]:
        """Forward a batch of requests; return each request's output rows and the forward time.

        Each element of ``batch`` is one request's inputs (a tuple of arrays with
        the same leading row count). Outputs are split back along the rows.
        """
        outputs, elapsed = self._forward(batch)
        rows = sum(int(item[0].shape[0]) for item in batch)
        with self._lock:
            bucket = self.bucket_for(rows)
            if bucket in self._estimates:
                self._estimates[bucket].update(elapsed)
            else:
                self._estimates[bucket] = _Estimate(elapsed)
        sizes = [int(item[0].shape[0]) for item in batch]
        splits = np.cumsum(sizes)[:-1]
        return list(np.split(outputs, splits)), elapsed

    def _to_device(self, array: np.ndarray, rows: int) -> torch.Tensor:
        array = np.ascontiguousarray(array)
        if not array.flags.writeable:  # views of request buffers; torch wants writable memory
            array = array.copy()
        host = torch.from_numpy(array)
        if self.static_shapes and host.shape[0] < self.bucket_for(rows):
            pad = torch.zeros(
                (self.bucket_for(rows) - host.shape[0], *host.shape[1:]), dtype=host.dtype
            )
            host = torch.cat([host, pad])
        if self.device.type == "cuda":
            host = host.pin_memory()
            tensor = host.to(self.device, non_blocking=True)
        else:
            tensor = host
        if tensor.is_floating_point():
            tensor = tensor.to(self.compute_dtype)
        return tensor

    def _forward(self, batch: Sequence[tuple[np.ndarray, ...]]) -> tuple[np.ndarray, float]:
        arity = len(batch[0])
        columns = [
            batch[0][i] if len(batch) == 1 else np.concatenate([item[i] for item in batch])
            for i in range(arity)
        ]
        rows = int(columns[0].shape[0])
        start = time.perf_counter()
        with torch.inference_mode():
            tensors = [self._to_device(column, rows) for column in columns]
            out = self.module(*tensors)
            result = out[:rows].float().cpu().numpy()
        return result, time.perf_counter() - start
