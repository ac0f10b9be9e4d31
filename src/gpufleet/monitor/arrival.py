"""When each rank arrives at the gradient all-reduce, apart from how long it waits there.

DDP's all-reduce runs inside backward, so every rank's backward lasts as long as the
slowest rank's: phase lengths alone cannot tell a rank whose backward (or optimizer step,
or callback, or GC pause) does extra work from the ranks that wait for it. What tells
them apart is the wait itself. :class:`ArrivalTimer` wraps DDP's default all-reduce hook
(the math is unchanged: it calls torch's ``allreduce_hook``) to note when this rank's
last gradient bucket is ready; the time from there to the end of backward is what this
rank waited for the others (plus the last bucket's own transfer). The all-reduce ends at
the same moment on every rank, so the waits are comparable across ranks without
comparing clocks: a rank that waits ``x`` ms less than the others arrived ``x`` ms later.

Each bucket is also noted in this rank's ring of collectives
(:mod:`gpufleet.core.ring`), which hang reports read.

It also adds up garbage-collection pauses (``gc.callbacks``) and the bytes the gradient
buckets carry. Per step that is a clock read per bucket and two per GC pass; the end of
each backward is read from the loop's phase marks (:mod:`gpufleet.core.phases`) in
batches, and the sums are reduced with the phase table once per log interval.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from gpufleet.core.callbacks import Callback
from gpufleet.core.phases import Phase, PhaseMarks
from gpufleet.core.ring import RING

log = logging.getLogger(__name__)

#: What each rank adds to the log interval's table (mean per step): seconds waiting at
#: the end of backward, seconds in GC pauses, gradient bytes all-reduced.
ARRIVAL = ("wait", "gc", "grad_bytes")


class ArrivalTimer(Callback):
    """Measures this rank's wait in the gradient all-reduce and its GC pauses (see the
    module docs). Measures no wait when the model is not a DDP module, or when another
    communication hook (compression, local SGD) is registered already."""

    phase_marks = True  # reads the loop's phase marks in batches

    def __init__(self) -> None:
        # When each gradient bucket was ready (perf_counter seconds), not yet matched
        # with the end of its backward (the next optimizer mark).
        self._ready: list[float] = []
        self._gc_start = 0.0
        self._sums = [0.0] * len(ARRIVAL)
        self._steps = 0
        #: whether the all-reduce wait is measured (a DDP model took the hook)
        self.measures_wait = False

    # -- hooks ----------------------------------------------------------------------------
    def on_fit_start(self, trainer: Any) -> None:
        self._steps, self._sums = 0, [0.0] * len(ARRIVAL)
        self.watch(trainer.model)
        gc.callbacks.append(self._on_gc)

    def watch(self, model: Any) -> None:
        """Time the gradient all-reduce of ``model`` when it is a DDP module without a
        communication hook (also a DDP module made anew after an in-process recovery)."""
        self.measures_wait = False
        if isinstance(model, DDP):
            try:
                model.register_comm_hook(model.process_group, self._allreduce)
                self.measures_wait = True
            except RuntimeError as e:  # a hook is registered already: DDP takes one
                log.debug("all-reduce arrival not measured: %s", e)

    def on_fit_end(self, trainer: Any, result: Any) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _allreduce(self, group, bucket):
        """torch's default all-reduce hook, with the time this bucket was ready noted.
        Unannotated: DDP refuses a hook whose annotations are not its own classes."""
        self._ready.append(time.perf_counter())
        buffer = bucket.buffer()
        nbytes = buffer.numel() * buffer.element_size()
        self._sums[2] += nbytes
        RING.enter("all_reduce", nbytes, bucket.index())  # for hang reports
        return default_hooks.allreduce_hook(group, bucket)

    def on_phase_marks(self, trainer: Any, marks: PhaseMarks) -> None:
        """Each optimizer mark ends a backward: the wait is from its last bucket's
        ready time to that mark. Buckets after the newest mark stay for the next call."""
        ready, k, last = self._ready, 0, None
        if not ready:  # no bucket since the last call (not DDP): only count the steps
            self._steps += marks.phases[:marks.count].count(Phase.END)
            return
        for phase, at in marks:
            if phase == Phase.OPTIMIZER:
                while k < len(ready) and ready[k] <= at:
                    last, k = ready[k], k + 1
                if last is not None:  # backward (with its all-reduce) just ended
                    self._sums[0] += at - last
                    last = None
            elif phase == Phase.END:
                self._steps += 1
        del ready[:k]

    def _on_gc(self, stage: str, info: dict[str, Any]) -> None:
        if stage == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start:
            self._sums[1] += time.perf_counter() - self._gc_start
            self._gc_start = 0.0

    # -- at the log interval ----------------------------------------------------------------
    def take(self) -> list[float]:
        """Mean per step of each :data:`ARRIVAL` value since the last call; resets."""
        steps = max(1, self._steps)
        means = [v / steps for v in self._sums]
        self._sums, self._steps = [0.0] * len(ARRIVAL), 0
        if not self.measures_wait:
            means[0] = -1.0  # not measured (no DDP all-reduce): the rules skip it
        return means
