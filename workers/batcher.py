"""Dynamic batching with deadlines, a bounded queue and graceful drain.

One :class:`DynamicBatcher` per model. Requests wait in a FIFO queue; a single
dispatcher task forms batches the way Triton's dynamic batcher does:

* a batch never exceeds ``max_batch_size`` rows;
* when the queue holds enough rows for a preferred batch size, the largest
  such batch goes at once; otherwise the dispatcher waits for more requests,
  at most until the oldest has queued ``max_queue_delay_s`` (or until waiting
  longer would make a queued request miss its deadline), then sends what it has;
* batches run one at a time on a dedicated thread, so the event loop keeps
  accepting, parsing and queueing the next batch meanwhile.

Deadlines: each request may carry one. At admission the batcher estimates when
the request would finish (the batches ahead of it plus its own, from measured
forward times) and refuses it at once if that is past its deadline; at dispatch
it refuses requests that can no longer finish in time. A request is never
served late: a result that arrives after its deadline is refused too.

Backpressure: the queue holds at most ``max_queue_size`` requests; past that
:class:`QueueFullError` (HTTP 429) says when to retry. While draining new
requests get :class:`DrainingError` (HTTP 503) and queued ones still complete.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from workers.exceptions import (
    DeadlineExceededError,
    DrainingError,
    ModelExecutionError,
    QueueFullError,
    WorkerConfigError,
    retry_after_header,
)

__all__ = ["BatchResult", "BatcherStats", "BatchingConfig", "DynamicBatcher"]

Execute = Callable[[Sequence[tuple[np.ndarray, ...]]], tuple[list[np.ndarray], float]]
Estimate = Callable[[int], float]


@dataclass(frozen=True, slots=True)
class BatchingConfig:
    """How a model's requests are batched.

    Attributes:
        max_batch_size: Most rows in one forward pass (1 disables batching).
        preferred_batch_sizes: Row counts sent as soon as they are available.
        max_queue_delay_s: Longest a request waits for others to join its batch.
        adaptive_delay: Also cap that wait at the estimated forward pass of what
            is queued: a partner joining saves at most one forward pass, so
            waiting longer than one costs more than it can save (a 0.3 ms model
            waits at most 0.3 ms, not 2 ms). Under load the queue fills while a
            batch runs and batches go at once, as before. False: always wait up
            to ``max_queue_delay_s`` (Triton's rule).
        max_queue_size: Most requests waiting; beyond it requests get 429.
        default_deadline_s: Budget of a request that names none (None: no deadline).
        inline_forward_s: Batches whose estimated forward pass is at most this
            run on the event loop's thread instead of the model thread: for a
            small model the hand-off to a thread and back (and the two threads
            taking turns with the GIL) costs more than the forward pass itself.
            0 always uses the model thread. The server applies it on the CPU
            only, to uncompiled models (CUDA graphs belong to their thread).
            A model whose forward pass can block (waits on a lock or I/O)
            needs 0.
    """

    max_batch_size: int = 32
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_s: float = 0.002
    adaptive_delay: bool = True
    max_queue_size: int = 256
    default_deadline_s: float | None = None
    inline_forward_s: float = 0.001

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise WorkerConfigError(f"max_batch_size {self.max_batch_size} must be >= 1")
        bad = [s for s in self.preferred_batch_sizes if not 1 <= s <= self.max_batch_size]
        if bad:
            raise WorkerConfigError(
                f"preferred batch sizes {bad} must lie in 1..max_batch_size ({self.max_batch_size})"
            )
        if self.max_queue_delay_s < 0:
            raise WorkerConfigError(f"max_queue_delay_s {self.max_queue_delay_s} must be >= 0")
        if self.inline_forward_s < 0:
            raise WorkerConfigError(f"inline_forward_s {self.inline_forward_s} must be >= 0")
        if self.max_queue_size < 1:
            raise WorkerConfigError(f"max_queue_size {self.max_queue_size} must be >= 1")
        if self.default_deadline_s is not None and self.default_deadline_s <= 0:
            raise WorkerConfigError(
                f"default_deadline_s {self.default_deadline_s} must be > 0 or None"
            )


@dataclass(frozen=True, slots=True)
class BatchResult:
    """What one request got back from its batch.

    Attributes:
        output: The request's output rows.
        model_s: Forward time of the whole batch.
        queue_s: Time from admission to dispatch.
        batch_rows: Rows in the batch.
        run_s: Time from dispatch until the batch's outputs were back on the
            event loop (the forward pass plus the hand-offs around it).
        done_at: ``time.perf_counter()`` when the result was set.
    """

    output: np.ndarray
    model_s: float
    queue_s: float
    batch_rows: int
    run_s: float = 0.0
    done_at: float = 0.0


@dataclass(slots=True)
class BatcherStats:
    """Counters since start (read by tests, ``/v1/models`` and metrics).

    Counters only, so the stats never grow with the server's life: ``rows`` is
    the rows run in all batches (``rows / batches`` is the mean batch size); the
    batch-size distribution is the ``edgefeed_worker_batch_rows`` histogram.
    """

    admitted: int = 0
    completed: int = 0
    batches: int = 0
    rejected_full: int = 0
    rejected_draining: int = 0
    rejected_deadline: int = 0
    failed: int = 0
    rows: int = 0


@dataclass(slots=True, eq=False)
class _Pending:
    inputs: tuple[np.ndarray, ...]
    rows: int
    deadline: float | None
    enqueued: float
    future: asyncio.Future[BatchResult]


class DynamicBatcher:
    """Queues requests for one model and runs them in dynamic batches.

    Args:
        execute: Runs a batch (in the batcher's thread): takes each request's
            inputs, returns each request's outputs and the forward time.
        config: Batching parameters.
        estimate: Expected forward seconds for a batch of n rows (for deadlines).
        on_batch: Called on the event loop after each batch with (rows, seconds).
        executor: The one-thread executor batches run on (default: a new one).
            Pass the one the model was prepared and warmed up on: CUDA graphs
            captured by ``torch.compile`` belong to the thread that captured them.
        inline: Allow batches under ``config.inline_forward_s`` to run on the
            event loop's thread (needs ``estimate``).
        fastest: Fastest forward time seen for n rows, which decides
            ``inline`` (default: ``estimate``). An estimate that averages
            recent batches grows on a contended machine, and would send small
            batches back to the thread exactly when the hand-off costs most.
    """

    def __init__(
        self,
        execute: Execute,
        config: BatchingConfig,
        estimate: Estimate | None = None,
        on_batch: Callable[[int, float], None] | None = None,
        executor: ThreadPoolExecutor | None = None,
        inline: bool = False,
        fastest: Estimate | None = None,
    ) -> None:
        self._execute = execute
        self.config = config
        self._estimated = estimate is not None
        self._inline = inline and estimate is not None and config.inline_forward_s > 0
        self._estimate = estimate or (lambda rows: 0.0)
        self._fastest = fastest or self._estimate
        self._on_batch = on_batch
        self._queue: collections.deque[_Pending] = collections.deque()
        self._queued_rows = 0
        self._arrival = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._draining = False
        self._running_until: float | None = None
        self._executor = executor or ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="edgefeed-batch"
        )
        self._task: asyncio.Task[None] | None = None
        self.stats = BatcherStats()

    @property
    def queue_depth(self) -> int:
        """Requests waiting (not counting the batch running)."""
        return len(self._queue)

    @property
    def draining(self) -> bool:
        """True once :meth:`drain` has begun."""
        return self._draining

    def start(self) -> None:
        """Start the dispatcher task on the running loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._dispatch_forever(), name="edgefeed-batcher"
            )

    def _estimated_wait(self, rows: int, now: float) -> float:
        """Seconds until a request of ``rows`` rows admitted now would complete."""
        cap = self.config.max_batch_size
        ahead = self._queued_rows + rows
        full, rest = divmod(ahead, cap)
        wait = full * self._estimate(cap) + (self._estimate(rest) if rest else 0.0)
        if rest and not full and not self.config.preferred_batch_sizes:
            wait += self.config.max_queue_delay_s
        if self._running_until is not None:
            wait += max(0.0, self._running_until - now)
        return wait

    def retry_after(self) -> float:
        """Seconds until the queue as it stands has drained (at least 1 ms)."""
        return max(0.001, self._estimated_wait(0, time.monotonic()))

    async def submit(
        self, inputs: tuple[np.ndarray, ...], rows: int, deadline_s: float | None = None
    ) -> BatchResult:
        """Queue one request and wait for its batch.

        Args:
            inputs: The request's input arrays, each with ``rows`` leading rows.
            rows: Row count of the request (at most ``max_batch_size``).
            deadline_s: Budget from now, in seconds (None: the default, if any).

        Raises:
            DrainingError: the batcher is draining.
            QueueFullError: the queue is full.
            DeadlineExceededError: the request cannot finish within its budget.
            ModelExecutionError: its batch failed.
        """
        if self._task is None:
            self.start()
        now = time.monotonic()
        if self._draining:
            self.stats.rejected_draining += 1
            raise DrainingError("worker is draining for shutdown; retry on another worker")
        if len(self._queue) >= self.config.max_queue_size:
            self.stats.rejected_full += 1
            retry = self.retry_after()
            # One truth for when to retry: HTTP's Retry-After, whole seconds (at least
            # 1); the estimated drain time is a fact about the queue, said as such.
            raise QueueFullError(
                f"queue is full ({self.config.max_queue_size} requests waiting, about "
                f"{retry * 1e3:.0f} ms to drain); retry after {retry_after_header(retry)} s",
                retry_after_s=retry,
            )
        if rows < 1 or rows > self.config.max_batch_size:
            raise WorkerConfigError(
                f"request has {rows} rows; batches hold 1..{self.config.max_batch_size}"
            )
        budget = deadline_s if deadline_s is not None else self.config.default_deadline_s
        deadline = None
        if budget is not None:
            deadline = now + budget
            expected = self._estimated_wait(rows, now)
            if now + expected > deadline:
                self.stats.rejected_deadline += 1
                raise DeadlineExceededError(
                    f"deadline of {budget * 1e3:.1f} ms cannot be met: about "
                    f"{expected * 1e3:.1f} ms of queued work and forward pass ahead; "
                    "retry later or with a larger budget"
                )
        future: asyncio.Future[BatchResult] = asyncio.get_running_loop().create_future()
        self._queue.append(_Pending(inputs, rows, deadline, now, future))
        self._queued_rows += rows
        self._idle.clear()
        self._arrival.set()
        self.stats.admitted += 1
        return await future

    def _take_batch(self, target: int) -> list[_Pending]:
        batch: list[_Pending] = []
        rows = 0
        while self._queue and rows + self._queue[0].rows <= target:
            item = self._queue.popleft()
            self._queued_rows -= item.rows
            if item.future.done():  # the caller gave up (client went away)
                continue
            batch.append(item)
            rows += item.rows
        if not batch and self._queue:  # preferred size splits a request: take it whole
            item = self._queue.popleft()
            self._queued_rows -= item.rows
            batch.append(item)
        return batch

    def _ready(self, now: float) -> tuple[float, int]:
        """(0, rows to take) when a batch should go now, else (seconds to wait, 0)."""
        cap = self.config.max_batch_size
        if self._draining or self._queued_rows >= cap:
            return 0.0, cap
        fitting = [p for p in self.config.preferred_batch_sizes if p <= self._queued_rows]
        if fitting:
            return 0.0, max(fitting)
        run = self._estimate(self._queued_rows)
        delay = self.config.max_queue_delay_s
        if self.config.adaptive_delay and self._estimated:
            delay = min(delay, run)
        oldest = self._queue[0]
        wait = oldest.enqueued + delay - now
        # Waiting must not make anyone queued miss a deadline they could still meet.
        for item in self._queue:
            if item.deadline is not None:
                wait = min(wait, item.deadline - run - now)
        return (wait, 0) if wait > 0 else (0.0, cap)

    async def _dispatch_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._queue:
                self._idle.set()
                self._arrival.clear()
                await self._arrival.wait()
                continue
            wait, target = self._ready(time.monotonic())
            if wait > 0:
                self._arrival.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):  # a timer; wait_for would add a task
                        await self._arrival.wait()
                continue
            batch = self._take_batch(target)
            if batch:
                await self._run(loop, batch)

    def _refuse_late(self, batch: list[_Pending], now: float) -> list[_Pending]:
        rows = sum(item.rows for item in batch)
        expected = self._estimate(rows)
        keep: list[_Pending] = []
        for item in batch:
            if item.future.done():
                continue
            if item.deadline is not None and now + expected > item.deadline:
                self.stats.rejected_deadline += 1
                item.future.set_exception(
                    DeadlineExceededError(
                        f"deadline passed while queued ({(now - item.enqueued) * 1e3:.1f} ms "
                        f"waiting, {expected * 1e3:.1f} ms forward pass ahead); refused "
                        "instead of served late"
                    )
                )
            else:
                keep.append(item)
        return keep

    async def _run(self, loop: asyncio.AbstractEventLoop, batch: list[_Pending]) -> None:
        dispatched = time.monotonic()
        batch = self._refuse_late(batch, dispatched)
        if not batch:
            return
        rows = sum(item.rows for item in batch)
        estimate = self._estimate(rows)
        self._running_until = dispatched + estimate
        inputs = [item.inputs for item in batch]
        try:
            if self._inline and self._fastest(rows) <= self.config.inline_forward_s:
                outputs, model_s = self._execute(inputs)
            else:
                outputs, model_s = await loop.run_in_executor(self._executor, self._execute, inputs)
        except asyncio.CancelledError:  # drain timed out with this batch still running
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(
                        DrainingError("worker shut down while this request's batch was running")
                    )
            raise
        except Exception as exc:  # a failing batch fails only its own requests
            self.stats.failed += len(batch)
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(
                        ModelExecutionError(
                            f"forward pass of a batch of {rows} rows failed: "
                            f"{type(exc).__name__}: {exc}"
                        )
                    )
            return
        finally:
            self._running_until = None
        finished = time.monotonic()
        done_at = time.perf_counter()
        self.stats.batches += 1
        self.stats.rows += rows
        if self._on_batch is not None:
            self._on_batch(rows, model_s)
        for item, output in zip(batch, outputs, strict=True):
            if item.future.done():
                continue
            if item.deadline is not None and finished > item.deadline:
                self.stats.rejected_deadline += 1
                item.future.set_exception(
                    DeadlineExceededError(
                        f"forward pass finished {(finished - item.deadline) * 1e3:.1f} ms after "
                        "the deadline; refused instead of served late"
                    )
                )
                continue
            self.stats.completed += 1
            item.future.set_result(
                BatchResult(
                    output,
                    model_s,
                    dispatched - item.enqueued,
                    rows,
                    finished - dispatched,
                    done_at,
                )
            )

    async def drain(self, timeout_s: float = 30.0) -> bool:
        """Stop admitting, finish what is queued, stop the dispatcher.

        Returns:
            True when everything queued completed within ``timeout_s``; else the
            rest got :class:`DrainingError`.
        """
        self._draining = True
        self._arrival.set()
        clean = True
        if self._task is not None:
            try:
                await asyncio.wait_for(self._idle.wait(), timeout=timeout_s)
            except TimeoutError:
                clean = False
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        while self._queue:
            item = self._queue.popleft()
            if not item.future.done():
                item.future.set_exception(
                    DrainingError(
                        f"worker shut down before this request ran (drain timeout {timeout_s} s)"
                    )
                )
        self._queued_rows = 0
        # A batch stuck past the timeout cannot be interrupted; do not wait for it.
        self._executor.shutdown(wait=clean, cancel_futures=True)
        return clean
