"""Checkpoints written in the background (``checkpoint.async_save``).

The step's critical path pays only for a copy of the state into host memory
(:func:`to_host`); a thread then writes the copy exactly as a synchronous save would
(temporary name, fsync, SHA-256, atomic rename, then pruning; for a sharded checkpoint
every rank's thread writes its shards, over a process group of the writers' own). One
write is in flight at a time: a second save first waits for the first, so the checkpoint
written last is always complete and verified before another starts. The thread is not a
daemon, so an ending interpreter waits for it; the loop waits for it explicitly at the
end of a run and after a preemption signal (:meth:`BackgroundWriter.wait`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

from gpufleet.core.tree import map_tensors

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

log = logging.getLogger(__name__)


def to_host(obj: Any) -> Any:
    """A copy of ``obj`` whose tensors live in host memory and share nothing with the
    originals (training may change the originals while the copy is written); containers
    (dict, list, tuple) are rebuilt, other values are kept as they are (plain, immutable
    data in a checkpoint's state)."""
    return map_tensors(obj, _host_copy)


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    if _is_dtensor(t):  # a rank's shard: copy the local part, keep its layout
        from torch.distributed.tensor import DTensor

        local = t.to_local().detach().to("cpu", copy=True)
        return DTensor.from_local(local, t.device_mesh, t.placements,
                                  run_check=False, shape=t.shape, stride=t.stride())
    # On a GPU this is a device-to-host copy (a sync point); on the CPU a clone.
    return t.detach().to("cpu", copy=True)


def _is_dtensor(t: torch.Tensor) -> TypeGuard[DTensor]:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.5 keeps it under _tensor; sharded saves need 2.5
        return False
    return isinstance(t, DTensor)


@dataclass
class WriteTimes:
    """How long one checkpoint took: ``blocking_s`` on the training thread (the copy to
    host memory), ``total_s`` until the file was complete under its name."""

    step: int
    blocking_s: float
    total_s: float


class BackgroundWriter:
    """Runs one checkpoint write at a time in a thread of its own.

    Example:
        >>> writer = BackgroundWriter()
        >>> writer.submit(400, lambda: None, blocking_s=0.01)
        >>> writer.wait() is None
        True
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: Exception | None = None
        self.times: list[WriteTimes] = []  # every finished write, oldest first

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, step: int, write: Callable[[], Any], blocking_s: float) -> None:
        """Start ``write()`` in the background after the previous write has finished.

        ``blocking_s`` is what the caller spent on the training thread so far (the copy
        to host memory); it is recorded with the write's total time.

        Raises:
            RuntimeError: the previous write's error was not collected with :meth:`wait`.
        """
        if self.wait() is not None:
            raise RuntimeError("the previous background write failed and nobody "
                               "collected its error with wait()")
        start = time.perf_counter() - blocking_s

        def run() -> None:
            try:
                write()
            except Exception as e:  # a full disk, a lost mount: reported by wait()
                self._error = e
                return
            self.times.append(WriteTimes(step, blocking_s, time.perf_counter() - start))

        # Not a daemon: an interpreter that ends mid-write waits for the file.
        self._thread = threading.Thread(target=run, name=f"checkpoint-{step}", daemon=False)
        self._thread.start()

    def wait(self) -> Exception | None:
        """Wait for the write in flight (if any); returns its error, once, or None."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        return error


class BackgroundSaves:
    """The background writes of one saver (``fit``'s checkpointer, a ``Fleet``): one in
    flight at a time, the newest complete one, and the messages of those that failed.

    Example:
        >>> saves = BackgroundSaves()
        >>> saves.submit(1, Path("ck"), {}, lambda host: None, time.perf_counter(), False)
        >>> saves.collect() is None and saves.written == Path("ck")
        True
    """

    def __init__(self) -> None:
        self.writer = BackgroundWriter()
        self.in_flight: Path | None = None  # the one being written
        self.written: Path | None = None  # the newest one complete on disk
        self.errors: list[str] = []  # each failed write's message, oldest first

    def submit(self, step: int, path: Path, content: Any, save: Callable[[Any], Any],
               start: float, main: bool) -> None:
        """Wait for the write in flight, copy ``content`` into host memory (what blocks
        training) and hand ``save(copy)`` to the writer thread; ``start``: when the
        save began (``time.perf_counter()``); ``main``: this rank logs the write."""
        self.collect()  # a second save waits for the first
        host = to_host(content)  # training may change the live tensors from now on
        blocking = time.perf_counter() - start

        def write() -> None:
            save(host)
            if main:
                log_saved(path, step, time.perf_counter() - start, blocking)

        self.writer.submit(step, write, blocking)
        self.in_flight = path

    def collect(self) -> str | None:
        """Wait for the write in flight, if any; returns its failure's message (also
        logged and kept in :attr:`errors`), or None."""
        if self.in_flight is None:
            return None
        error, path, self.in_flight = self.writer.wait(), self.in_flight, None
        if error is None:
            self.written = path
            return None
        message = (f"checkpoint {path.name} could not be written in the background: "
                   f"{error}. Training goes on; the last good checkpoint is "
                   f"{self.written or 'none'}. Free space in (or fix) the run "
                   "directory's file system.")
        log.error("%s", message)
        self.errors.append(message)
        return message


def log_saved(path: Path, step: int, total_s: float, blocking_s: float | None) -> None:
    """Log a written checkpoint with how long training was blocked (all of ``total_s``
    for a synchronous save); the values also ride on the record for tools."""
    blocking = total_s if blocking_s is None else blocking_s
    how = "" if blocking_s is None else " in the background"
    log.info("checkpoint saved: %s (training blocked %.3f s; written%s in %.3f s)", path,
             blocking, how, total_s,
             extra={"checkpoint_step": step, "checkpoint_blocking_s": blocking,
                    "checkpoint_total_s": total_s})
