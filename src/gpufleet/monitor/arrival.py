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

Under ``fsdp``/``hsdp`` the collectives sit in forward and backward alike: the time
each rank spends inside them, per phase, is its wait there (see
:mod:`gpufleet.monitor.arrival_hooks`). Under ``pipeline`` the stage's compute is timed
micro-batch by micro-batch; the rest of its forward (the schedule, with its sends and
receives) and of its backward (the loss broadcast) is its wait for the other stages.

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
from gpufleet.monitor.arrival_hooks import (
    BACKWARD,
    BYTES,
    CHUNKS,
    COMPUTE,
    FORWARD,
    Waits,
    time_fsdp,
    time_stage,
)

log = logging.getLogger(__name__)

#: What each rank adds to the log interval's table (mean per step): seconds waiting for
#: other ranks in backward (ddp: at its end), seconds in GC pauses, gradient bytes
#: all-reduced (fsdp: all the bytes its collectives moved), seconds waiting for other
#: ranks in forward (fsdp's all-gathers; pipeline: the schedule's sends and receives),
#: the pipeline stage's micro-batches, and its stage number (-1: not a pipeline).
ARRIVAL = ("wait", "gc", "grad_bytes", "wait_fwd", "chunks", "stage")


class ArrivalTimer(Callback):
    """Measures this rank's wait for the others (see the module docs) and its GC
    pauses. Measures no wait when the model is neither DDP (with no other communication
    hook: compression, local SGD), FSDP2 nor a pipeline stage."""

    phase_marks = True  # reads the loop's phase marks in batches

    def __init__(self) -> None:
        # When each gradient bucket was ready (perf_counter seconds), not yet matched
        # with the end of its backward (the next optimizer mark).
        self._ready: list[float] = []
        self._gc_start = 0.0
        self._sums = [0.0] * 3  # ddp's wait, GC pauses, bucket bytes
        self._steps = 0
        self._hooks = Waits()  # what the fsdp and pipeline hooks add up
        self._spans = [0.0, 0.0]  # pipeline: seconds in forward and in backward phases
        self._last: tuple[Phase | None, float] = (None, 0.0)  # the newest mark read
        self._stage = -1
        #: what is measured: "ddp", "fsdp", "pipeline" or "" (no wait measured)
        self.measures = ""

    @property
    def measures_wait(self) -> bool:
        """Whether this rank's wait for the others is measured."""
        return bool(self.measures)

    # -- hooks ----------------------------------------------------------------------------
    def on_fit_start(self, trainer: Any) -> None:
        self._steps, self._sums = 0, [0.0] * 3
        self._hooks.take()
        self.watch(trainer.model, getattr(trainer, "strategy", None))
        gc.callbacks.append(self._on_gc)

    def watch(self, model: Any, strategy: Any = None) -> None:
        """Time this rank's wait for the others on ``model``: a DDP module without a
        communication hook (also one made anew after an in-process recovery), a
        pipeline stage of ``strategy``, or FSDP2's collectives."""
        self.measures = ""
        stage = getattr(strategy, "pipeline_stage", None)
        if isinstance(model, DDP):
            try:
                model.register_comm_hook(model.process_group, self._allreduce)
                self.measures = "ddp"
            except RuntimeError as e:  # a hook is registered already: DDP takes one
                log.debug("all-reduce arrival not measured: %s", e)
        elif stage is not None:  # its fsdp collectives (dp > 1) count as its compute
            if time_stage(stage, self._hooks):
                self.measures, self._stage = "pipeline", strategy.rank
        elif time_fsdp(model, self._hooks):
            self.measures = "fsdp"

    def on_fit_end(self, trainer: Any, result: Any) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def on_exception(self, trainer: Any, error: BaseException) -> None:
        self.on_fit_end(trainer, None)

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
        """Each optimizer mark ends a backward: ddp's wait is from its last bucket's
        ready time to that mark (buckets after the newest mark stay for the next call).
        A pipeline's forward and backward phases are added up."""
        self._hooks.marks = marks  # the fsdp hooks read the newest mark's phase
        if not marks.count:
            return
        self._hooks.phase = marks.phases[marks.count - 1]
        self._steps += marks.phases[:marks.count].count(Phase.END)
        if self._ready:
            self._match_buckets(marks)
        if self.measures == "pipeline":
            spans = self._spans
            before, since = self._last
            for phase, at in marks:
                if before is Phase.FORWARD:
                    spans[0] += at - since
                elif before is Phase.BACKWARD:
                    spans[1] += at - since
                before, since = phase, at
            self._last = (before, since)

    def _match_buckets(self, marks: PhaseMarks) -> None:
        ready, k, last = self._ready, 0, None
        for phase, at in marks:
            if phase == Phase.OPTIMIZER:
                while k < len(ready) and ready[k] <= at:
                    last, k = ready[k], k + 1
                if last is not None:  # backward (with its all-reduce) just ended
                    self._sums[0] += at - last
                    last = None
        del ready[:k]

    def _on_gc(self, stage: str, info: dict[str, Any]) -> None:
        if stage == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start:
            self._sums[1] += time.perf_counter() - self._gc_start
            self._gc_start = 0.0

    # -- at the log interval ----------------------------------------------------------------
    def take(self) -> list[float]:
        """Mean per step of each :data:`ARRIVAL` value since the last call (``stage``
        as it is); resets. A wait of -1 is not measured: the rules skip it."""
        steps = max(1, self._steps)
        hooks = self._hooks.take()
        ddp_wait, gc_s, ddp_bytes = self._sums
        fwd_s, bwd_s = self._spans
        self._sums, self._steps, self._spans = [0.0] * 3, 0, [0.0, 0.0]
        wait, wait_fwd, nbytes, chunks = -1.0, 0.0, ddp_bytes, 0.0
        if self.measures == "ddp":
            wait = ddp_wait
        elif self.measures == "fsdp":
            wait, wait_fwd, nbytes = hooks[BACKWARD], hooks[FORWARD], hooks[BYTES]
        elif self.measures == "pipeline":
            # The forward phase holds the whole schedule: what is not the stage's own
            # compute is waiting; the backward phase is the loss broadcast.
            wait, wait_fwd, chunks = bwd_s, max(0.0, fwd_s - hooks[COMPUTE]), hooks[CHUNKS]
        means = [v / steps for v in (wait, gc_s, nbytes, wait_fwd, chunks)]
        if not self.measures:
            means[0] = -1.0
        return [*means, float(self._stage)]
