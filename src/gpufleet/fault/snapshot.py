"""In-memory snapshots of every rank's training state, replicated to a partner
(``fault.snapshot_every``).

Every N steps, after the optimizer step, each rank copies its whole training state
(model and optimizer state as they live on the rank: its shards under fsdp, its part of
the optimizer under zero1; scheduler, loss scaler, RNG states and the data position)
into a host buffer (:class:`~gpufleet.fault.host_state.HostState`, allocated once and
reused), then sends the copy to its partner rank on the next node and receives its
partner's (:mod:`gpufleet.fault.snapshot_ring`). Host memory per rank is its own state
plus one partner's, reported in the log and in the metrics (``snapshot_mb``).

Off the step's critical path: the training thread copies only what the next step's
forward and backward may change (buffers; RNG states and plain values are taken as
they are), while a background thread copies the parameters and the optimizer state,
which only the next optimizer step changes: the next step waits for that copy only when
it reaches its optimizer step (:meth:`Snapshotter.wait_copied`). The same thread then
does the exchange, overlapping the steps that follow; a snapshot due while the previous
exchange is still going waits for it (``snapshot_wait_s`` in the metrics says how long).

On CUDA the host buffers are pinned; the tensors the next step may change are copied
on the training stream (queued in order before the next step's kernels, no sync), the
others on a side stream that waits for the step to finish, and the next optimizer step
waits (on the device) for the side stream. This path cannot run on a machine without a
GPU and is untested there.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from gpufleet.core.callbacks import Callback
from gpufleet.core.phases import NEXT_STEP, Phase
from gpufleet.fault.host_state import HostState, local_tensor
from gpufleet.fault.snapshot_ring import Held, RingExchange

log = logging.getLogger(__name__)

MB = 1e6

# What a snapshot copies, from the run: (state, storages) where state is the rank's whole
# training state (the live tensors) and storages the data pointers of the tensors that
# change only in the optimizer step (parameters, optimizer state).
Capture = Callable[[], tuple[dict[str, Any], set[int]]]


def storage_of(t: torch.Tensor) -> int:
    """The data pointer of the storage behind ``t`` (a DTensor's local shard's)."""
    return local_tensor(t).untyped_storage().data_ptr()


def optimizer_storages(models: Iterable[torch.nn.Module], optimizers: Iterable[Any]
                       ) -> set[int]:
    """The storages of ``models``' parameters and of ``optimizers``' state (a wrapper's
    inner ``optim``'s, as ZeRO's holds this rank's part): what only an optimizer step
    changes, so a snapshot may copy it while the next step's forward and backward run."""
    tensors: list[torch.Tensor] = []
    for model in models:
        tensors.extend(model.parameters())
    for optimizer in optimizers:
        inner = getattr(optimizer, "optim", optimizer)
        for per_param in inner.state.values():
            tensors.extend(v for v in per_param.values() if isinstance(v, torch.Tensor))
    return {storage_of(t) for t in tensors}


class Snapshotter:
    """This rank's snapshots: its own copy, the partner's copy, the thread that fills
    them.

    Args:
        rank: this rank (the owner of the own copy).
        device: where the training state lives (cuda: pinned buffers, a side stream).
        exchange: the ring partners, or None (one rank: nothing to send).
    """

    def __init__(self, rank: int, device: torch.device,
                 exchange: RingExchange | None = None) -> None:
        self.rank, self.device, self.exchange = rank, device, exchange
        self.own, self.partner = HostState(), HostState()
        self.taken = 0  # snapshots started
        self.finished_step: int | None = None  # the newest copied (and sent) in full
        self.errors: list[str] = []
        # The training thread's time in the latest snapshot (its copies, the wait for
        # the previous exchange and for the background copy), and of it the first wait.
        self.last_blocking_s = 0.0
        self.last_wait_s = 0.0
        self._thread: threading.Thread | None = None
        self._copied = threading.Event()
        self._copied.set()
        self._own_ready = threading.Event()  # the own copy in flight is complete
        self._own_ready.set()
        cuda = device.type == "cuda"
        self._side = torch.cuda.Stream(device) if cuda else None
        self._side_done: Any = None  # the side stream's copies are queued up to here
        self._reported = False

    @property
    def host_bytes(self) -> int:
        """Host memory the snapshots hold: the own copy plus the partner's."""
        return self.own.nbytes + self.partner.nbytes

    def held(self) -> list[Held]:
        """The complete copies this rank holds (for
        :func:`~gpufleet.fault.snapshot_ring.newest_complete`)."""
        return [Held(self.rank, copy.owner, copy.step) for copy in (self.own, self.partner)
                if copy.step is not None]

    def take(self, step: int, state: dict[str, Any], storages: set[int]) -> None:
        """Snapshot ``state`` (this rank's at ``step``): copy what the next step's forward
        may change now, start the thread that copies the rest and sends it."""
        start = time.perf_counter()
        self.wait()  # one snapshot at a time: the previous exchange ends first
        self.last_wait_s = time.perf_counter() - start
        tensors = self.own.fit(state, self.device.type, step, self.rank)
        late = [i for i, t in enumerate(tensors) if storage_of(t) in storages]
        now = sorted(set(range(len(tensors))) - set(late))
        cuda = self._side is not None
        self.own.copy(tensors, now, non_blocking=cuda)  # on the training stream
        events: tuple[Any, ...] = ()
        if cuda:
            events = self._queue_cuda(tensors, late)
            tensors, late = [], []
        self._copied.clear()
        self._own_ready.clear()
        self.taken += 1
        self._thread = threading.Thread(target=self._work, args=(tensors, late, events),
                                        name=f"snapshot-{step}", daemon=True)
        self._thread.start()
        self.last_blocking_s = time.perf_counter() - start

    def _queue_cuda(self, tensors: list[torch.Tensor], late: list[int]) -> tuple[Any, Any]:
        """Queue the copies of what only the optimizer step changes on the side stream,
        after the step's kernels; :meth:`wait_copied` makes the training stream wait.
        Returns the events after which the side stream's and the training stream's
        copies are in host memory."""
        assert self._side is not None
        step_done = torch.cuda.current_stream(self.device).record_event()
        self._side.wait_event(step_done)
        with torch.cuda.stream(self._side):
            self.own.copy(tensors, late, non_blocking=True)
            self._side_done = self._side.record_event()
        # The training stream's copies were queued before this point.
        return self._side_done, torch.cuda.current_stream(self.device).record_event()

    def _work(self, tensors: list[torch.Tensor], late: list[int],
              events: tuple[Any, ...]) -> None:
        """The background thread: the copies that can wait for the next optimizer step,
        then the exchange with the partners."""
        try:
            try:
                self.own.copy(tensors, late)
            except Exception as e:  # never leave the training thread waiting
                self._fail(f"copy failed: {type(e).__name__}: {e}")
                return
            finally:
                self._copied.set()
            for event in events:  # CUDA: the host bytes are all there once both end
                event.synchronize()
            self.own.done()
        finally:
            self._own_ready.set()
        if self.exchange is not None:
            try:
                self.exchange.swap(self.own, self.partner)
            except Exception as e:  # a partner gone: keep training, snapshots stay local
                self._fail(f"the exchange with ranks {self.exchange.target} (send) and "
                           f"{self.exchange.source} (receive) failed: {type(e).__name__}: "
                           f"{e}; snapshots stay on this rank from now on")
                self.exchange = None
                return
        self.finished_step = self.own.step
        if not self._reported:
            self._reported = True
            self._report()

    def _report(self) -> None:
        """Say once what the snapshots hold in host memory and where they go."""
        ex, own = self.exchange, self.own
        where = ("kept on this rank only" if ex is None else
                 f"sent to rank {ex.target}; it holds rank {ex.source}'s copy, "
                 f"{self.partner.nbytes / MB:.1f} MB")
        log.info("snapshot of step %s: rank %d's state is %.1f MB in host memory, %s: "
                 "%.1f MB held in all (%.3f s on the training thread)", own.step, self.rank,
                 own.nbytes / MB, where, self.host_bytes / MB, self.last_blocking_s,
                 extra={"snapshot_mb": self.host_bytes / MB})

    def _fail(self, message: str) -> None:
        self.errors.append(message)
        log.error("snapshot on rank %d: %s", self.rank, message)

    def wait_copied(self) -> None:
        """Before the optimizer step changes the parameters: wait until the snapshot's
        copies of them are done (on CUDA, make the training stream wait for the side
        stream; no host sync)."""
        if self._copied.is_set() and self._side_done is None:
            return
        start = time.perf_counter()
        self._copied.wait()
        self.last_blocking_s += time.perf_counter() - start
        if self._side_done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._side_done)
            self._side_done = None

    def own_copy(self, timeout_s: float) -> HostState | None:
        """This rank's own snapshot, once the copy in flight (not its exchange) is
        complete; None when no complete copy is held after ``timeout_s``."""
        self._own_ready.wait(timeout_s)
        return self.own if self.own.step is not None else None

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for the snapshot in flight (copy and exchange); False when it was still
        running after ``timeout_s``."""
        if self._thread is None:
            return True
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            return False
        self._thread = None
        return True


class SnapshotCallback(Callback):
    """Takes a snapshot every ``every`` steps (see the module docs); built by the run
    when ``fault.snapshot_every`` is set.

    Args:
        every: steps between snapshots.
        capture: gives this rank's state and the storages only the optimizer changes.
        send: send each snapshot to a partner rank (False where every rank holds the
            whole state, ddp: a survivor restores its own copy, and a partner's copy
            would be host memory and network for nothing).
        at_next_step: a snapshot due at a step's end is taken when the next step
            begins (:data:`~gpufleet.core.phases.NEXT_STEP`): your own loop's state is a
            step boundary's only once its own bookkeeping after the optimizer's step
            (its scheduler, its counters) is done.
        rank / world_size / node_rank / local_rank: this rank's place.
        device: where the state lives.
        timeout_s: how long a send or receive may wait for a partner.

    It adds ``snapshot_mb`` (host memory of this rank's two copies), ``snapshot_step``
    (the newest snapshot this rank has copied and sent in full; one still in flight does
    not count), ``snapshot_blocking_s`` and ``snapshot_wait_s`` (the training thread's
    time in the latest snapshot, and of it the wait for the previous exchange) to the
    metrics of each log line; the run puts it before the metric sinks.
    """

    essential = False  # a failed snapshot is reported; training goes on

    def __init__(self, every: int, capture: Capture, *, rank: int, world_size: int,
                 node_rank: int, local_rank: int, device: torch.device,
                 timeout_s: float, send: bool = True, at_next_step: bool = False) -> None:
        self.every, self.capture, self.send = every, capture, send
        self.at_next_step = at_next_step
        self._due: int | None = None  # (at_next_step) the step whose snapshot is due
        self.world_size, self.node_rank, self.local_rank = world_size, node_rank, local_rank
        self.timeout_s = timeout_s
        self.snapshotter = Snapshotter(rank, device)

    def on_fit_start(self, trainer: Any) -> None:
        import torch.distributed as dist

        if self.send and self.world_size > 1 and dist.is_initialized():  # COLLECTIVE
            self.snapshotter.exchange = RingExchange.start(self.node_rank, self.local_rank,
                                                           self.timeout_s)

    def on_step_end(self, trainer: Any, step: int) -> None:
        if step % self.every:
            return
        if self.at_next_step:
            self._due = step
            return
        state, storages = self.capture()
        self.snapshotter.take(step, state, storages)

    def on_phase(self, trainer: Any, phase: Phase) -> None:
        if phase is Phase.OPTIMIZER:
            self.snapshotter.wait_copied()
        elif self._due is not None and phase in NEXT_STEP:
            step, self._due = self._due, None
            state, storages = self.capture()
            self.snapshotter.take(step, state, storages)

    def on_log(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        snap = self.snapshotter
        metrics["snapshot_mb"] = snap.host_bytes / MB
        metrics["snapshot_step"] = snap.finished_step
        metrics["snapshot_blocking_s"] = snap.last_blocking_s
        metrics["snapshot_wait_s"] = snap.last_wait_s

    def rejoin(self, rank: int, world_size: int) -> None:
        """This rank's new place after the ranks left regrouped in process (see
        :mod:`gpufleet.train.recovery.recovery`): the ring of partners is made again over the new
        process group (COLLECTIVE) when ranks are left to send to."""
        import torch.distributed as dist

        self.world_size, self.snapshotter.rank = world_size, rank
        self.snapshotter.exchange = None
        self._due = None  # of a step the restored state is not at
        if self.send and world_size > 1 and dist.is_initialized():
            self.snapshotter.exchange = RingExchange.start(self.node_rank, self.local_rank,
                                                           self.timeout_s)

    def on_fit_end(self, trainer: Any, result: Any) -> None:
        if not self.snapshotter.wait(self.timeout_s):
            log.warning("the snapshot exchange of rank %d did not end within %.0f s; "
                        "leaving it", self.snapshotter.rank, self.timeout_s)
