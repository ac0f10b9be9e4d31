"""Dynamic batching: merge queued requests into one model call, off the event loop.

Each served model has one :class:`DynamicBatcher` with its own worker thread. Requests
queue in arrival order. The worker takes the oldest request and every later one whose
inputs have the same per-sample shapes and datatypes (only those can be concatenated
along the batch dimension), and runs them as one batch as soon as either

- the batch holds ``max_batch_size`` rows, or
- the oldest request has waited ``max_queue_delay_s``.

The outputs are split by rows and each caller gets back exactly its own rows. If a
merged batch fails, its requests are run again one by one, so a bad request fails
alone and does not take its neighbours down with it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from gpufleet.serve.metrics import ServerMetrics

log = logging.getLogger(__name__)

InferFn = Callable[[list[np.ndarray]], list[np.ndarray]]


class ModelError(RuntimeError):
    """The model raised, or returned something that does not fit its batch."""


@dataclass
class _Item:
    inputs: list[np.ndarray]
    rows: int
    key: tuple
    enqueued: float
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class DynamicBatcher:
    """A queue in front of ``fn`` that merges concurrent requests into batches.

    Args:
        fn: the model: a list of input arrays (batch dimension first) to a list of
            output arrays with the same number of rows.
        max_batch_size: most rows per model call (1: no batching).
        max_queue_delay_s: longest the oldest queued request waits for more to join.
        name: the model name (metric label, thread name).
        metrics: where to record queue time, compute time and batch sizes.

    Example:
        >>> b = DynamicBatcher(lambda xs: [xs[0] * 2], max_batch_size=8,
        ...                    max_queue_delay_s=0.001)
        >>> b.submit([np.array([[1, 2]])]).result()[0].tolist()
        [[2, 4]]
        >>> b.close()
    """

    def __init__(self, fn: InferFn, max_batch_size: int, max_queue_delay_s: float,
                 name: str = "model", metrics: ServerMetrics | None = None) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size = {max_batch_size}: must be 1 or more.")
        if max_queue_delay_s < 0:
            raise ValueError(f"max_queue_delay_s = {max_queue_delay_s}: must be >= 0.")
        self.fn, self.name, self.metrics = fn, name, metrics
        self.max_batch_size, self.max_queue_delay_s = max_batch_size, max_queue_delay_s
        self._pending: deque[_Item] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=f"batcher-{name}",
                                        daemon=True)
        self._thread.start()

    def submit(self, inputs: Sequence[np.ndarray]) -> concurrent.futures.Future:
        """Queue one request (every input has the same number of rows, >= 1); the future
        resolves to its outputs or raises :class:`ModelError`."""
        rows = int(inputs[0].shape[0])
        if rows > self.max_batch_size:
            raise ValueError(f"a request of {rows} rows exceeds max_batch_size "
                             f"{self.max_batch_size}")
        key = tuple((a.dtype.str, a.shape[1:]) for a in inputs)
        item = _Item(list(inputs), rows, key, time.monotonic())
        with self._cond:
            if self._closed:
                raise RuntimeError(f"the batcher of model {self.name!r} is closed")
            self._pending.append(item)
            self._cond.notify()
        return item.future

    async def infer(self, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Queue one request and wait for its outputs without blocking the event loop."""
        return await asyncio.wrap_future(self.submit(inputs))

    def close(self, timeout: float = 5.0) -> None:
        """Finish the queued requests, then stop the worker thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:
                    return  # closed and drained
                batch = self._take_batch()
            # A caller that went away (its future cancelled) is dropped here; after this
            # call cancelling is no longer possible, so setting the results is safe.
            batch = [it for it in batch if it.future.set_running_or_notify_cancel()]
            if not batch:
                continue
            try:
                self._run(batch)
            except Exception as e:  # a bug here must not kill the thread and hang callers
                log.exception("batcher of model %r failed", self.name)
                for it in batch:
                    if not it.future.done():
                        it.future.set_exception(ModelError(f"internal error: {e}"))

    def _take_batch(self) -> list[_Item]:
        """The oldest request and the compatible ones behind it, once the batch is full
        or the oldest has waited long enough. Called with the lock held."""
        head = self._pending[0]  # only this thread removes items, so the head stays
        deadline = head.enqueued + self.max_queue_delay_s
        while True:
            rows = sum(it.rows for it in self._pending if it.key == head.key)
            left = deadline - time.monotonic()
            if rows >= self.max_batch_size or left <= 0 or self._closed:
                break
            self._cond.wait(left)
        batch, rows = [], 0
        for it in self._pending:
            if it.key != head.key:
                continue
            if rows + it.rows > self.max_batch_size:
                break
            batch.append(it)
            rows += it.rows
        taken = {id(it) for it in batch}
        self._pending = deque(it for it in self._pending if id(it) not in taken)
        return batch

    def _run(self, batch: list[_Item]) -> None:
        start = time.monotonic()
        if self.metrics is not None:
            for it in batch:
                self.metrics.queue.observe(start - it.enqueued, self.name)
        try:
            outputs = self._call(batch)
        except Exception as e:
            if len(batch) > 1:  # find the request that broke the batch; run each alone
                for it in batch:
                    self._run([it])
                return
            error = e if isinstance(e, ModelError) else ModelError(f"{type(e).__name__}: {e}")
            batch[0].future.set_exception(error)
            return
        offset = 0
        for it in batch:
            it.future.set_result([out[offset:offset + it.rows] for out in outputs])
            offset += it.rows

    def _call(self, batch: list[_Item]) -> list[np.ndarray]:
        rows = sum(it.rows for it in batch)
        if len(batch) == 1:
            inputs = batch[0].inputs
        else:
            inputs = [np.concatenate([it.inputs[i] for it in batch])
                      for i in range(len(batch[0].inputs))]
        t0 = time.perf_counter()
        outputs = self.fn(inputs)
        if self.metrics is not None:
            self.metrics.compute.observe(time.perf_counter() - t0, self.name)
            self.metrics.batch_size.observe(rows, self.name)
        for out in outputs:
            if out.ndim == 0 or out.shape[0] != rows:
                raise ModelError(f"the model returned an output of shape {list(out.shape)} "
                                 f"for a batch of {rows} rows; every output must keep the "
                                 "batch dimension first.")
        return outputs
