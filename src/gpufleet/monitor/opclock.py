"""The time a CPU step spends inside its operators, sampled: what the rest of the step's
compute phases is, is host overhead (Python between the operators, the dispatcher).

On a CPU every operator runs on the calling thread, so a phase's clock holds both the
arithmetic and the Python around it. :class:`OpClock` tells them apart on a sampled
step: it runs that step (from its first data wait to its end) under a
``TorchDispatchMode`` that reads the clock around every ATen operator and adds the time
inside to the phase that runs (forward, backward, optimizer; data and what runs between
steps are not split). The step accounting (:mod:`gpufleet.monitor.accounting`) then
takes, from each log interval's phase times, the sample's time inside operators as the
compute part and the rest as ``host``.

What a sample costs: the mode's Python for every operator of one step (about 15 µs an
operator on the machine of ``benchmarks/RESULTS.md``, twice a tiny step). So samples are
spaced by their own cost: after a sample that made its step ``x`` seconds longer than
the step before (at least :data:`MIN_COST` of its length), the next waits until the run
has spent ``x / BUDGET`` seconds more (:data:`BUDGET`: 0.5% of the run's time). That
cost falls in the host part of the log interval that held the sample; between samples,
each interval uses the newest one.

Not sampled: communication operators (``c10d``: their time is the collectives' wait,
which :mod:`gpufleet.monitor.arrival` measures), CUDA (an operator returns once its
kernel is queued: the time inside is the launch, not the work) and compiled models
(torch.compile runs a step eagerly while a dispatch mode is active). There ``host``
stays None.

Example:
    >>> clock = OpClock()
    >>> clock.take()  # nothing sampled yet: not measured
    [-1.0, -1.0, -1.0, 0.0, 0.0, 0.0]
"""

from __future__ import annotations

import time
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

from gpufleet.core.callbacks import Callback
from gpufleet.core.phases import Phase

#: What each rank adds to the log interval's table: seconds inside operators per step in
#: forward, backward and the optimizer step (of the newest sample; -1: none yet), and
#: the operators that sample dispatched in each of them.
OPS = ("ops_forward", "ops_backward", "ops_optimizer", "count_forward", "count_backward",
       "count_optimizer")
#: The share of the run's time the samples may cost.
BUDGET = 0.005
#: The least share of its step's length a sample is taken to cost.
MIN_COST = 0.05
#: Steps done before the first sample: the first steps allocate, and the FLOP count
#: (on the second step) runs under a mode of its own.
FIRST_STEP = 3
_BUCKET = {Phase.FORWARD: 0, Phase.BACKWARD: 1, Phase.OPTIMIZER: 2}
_SKIPPED_NAMESPACES = ("c10d", "_c10d_functional", "_dtensor")


class _Timing(TorchDispatchMode):
    """Adds each operator's time to the bucket its clock names."""

    def __init__(self, clock: OpClock) -> None:
        super().__init__()
        self.clock = clock

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        bucket = self.clock.bucket
        if bucket < 0 or func.namespace in _SKIPPED_NAMESPACES:
            return func(*args, **(kwargs or {}))
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.clock.inside[bucket] += time.perf_counter() - start
        self.clock.count[bucket] += 1
        return out


class OpClock(Callback):
    """Samples the time inside operators of one step now and then (see the module docs).

    Args:
        budget: the share of the run's time the samples may cost (:data:`BUDGET`).
        first_step: steps done before the first sample (:data:`FIRST_STEP`).
    """

    def __init__(self, budget: float = BUDGET, first_step: int = FIRST_STEP) -> None:
        self.budget, self.first_step = budget, first_step
        self.bucket = -1  # the phase that runs: 0-2 (_BUCKET), -1 another
        self.inside = [0.0, 0.0, 0.0]
        self.count = [0, 0, 0]
        self._mode: _Timing | None = None
        self._newest: list[float] | None = None  # the newest sample's OPS row
        self._last_end = 0.0  # perf_counter at the last step's end
        self._last_step_s = 0.0  # the last unsampled step's length
        self._due = 0.0  # perf_counter after which the next sample may start
        self._steps = 0
        self._off = False

    def on_phase(self, trainer: Any, phase: Phase) -> None:
        mode = self._mode
        if mode is not None:
            if phase is Phase.END:
                self._stop()
            else:
                self.bucket = _BUCKET.get(phase, -1)
            return
        if phase is Phase.END:
            now = time.perf_counter()
            if self._last_end:
                self._last_step_s = now - self._last_end
            self._last_end = now
            self._steps += 1
        elif (phase is Phase.DATA and self._steps >= self.first_step and not self._off
              and time.perf_counter() >= self._due):
            self._start(trainer)

    def _start(self, trainer: Any) -> None:
        # Under torch.compile a dispatch mode makes the step run eagerly: not sampled.
        # (Looked at here, not at the start: a Fleet loop sets its model up later.)
        if trainer.config.perf.compile or _compiled(trainer.model):
            self._off = True
            return
        self.inside, self.count, self.bucket = [0.0, 0.0, 0.0], [0, 0, 0], -1
        self._mode = _Timing(self)
        self._mode.__enter__()

    def _stop(self) -> None:
        mode, self._mode, self.bucket = self._mode, None, -1
        if mode is not None:
            mode.__exit__(None, None, None)
        now = time.perf_counter()
        took = now - self._last_end if self._last_end else 0.0
        # What the sample cost: its step's excess over the step before, at least
        # MIN_COST of its length (a noisy machine can make the step before as long).
        extra = max(took - self._last_step_s, MIN_COST * took) if self._last_step_s else took
        self._due = now + extra / self.budget
        self._last_end = now
        self._steps += 1
        self._newest = [*self.inside, *map(float, self.count)]

    def drop(self) -> None:
        """End a sample under way without keeping it (a step raised; a run recovered
        in process starts its steps again)."""
        mode, self._mode, self.bucket = self._mode, None, -1
        if mode is not None:
            mode.__exit__(None, None, None)
        self._last_end = 0.0

    def on_exception(self, trainer: Any, error: BaseException) -> None:
        self.drop()

    def on_fit_end(self, trainer: Any, result: Any) -> None:
        self.drop()

    def take(self) -> list[float]:
        """The newest sample's :data:`OPS` row (seconds per step inside operators in
        forward, backward and the optimizer step, then the operators counted in each),
        or -1 seconds when nothing was sampled yet."""
        if self._newest is None:
            return [-1.0, -1.0, -1.0, 0.0, 0.0, 0.0]
        return list(self._newest)


def _compiled(model: Any) -> bool:
    """Whether ``model`` is, or holds, a module torch.compile wrapped."""
    modules = model.modules() if hasattr(model, "modules") else ()
    return any(type(m).__name__ == "OptimizedModule" for m in modules)
