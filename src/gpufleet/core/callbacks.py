"""Hooks where monitoring, checkpointing and displays attach to the loop.

Every method is a no-op by default. The hot path only calls :meth:`Callback.on_phase`
on callbacks that override it, so an unused hook costs nothing per step; a callback
with ``phase_marks = True`` reads the phases in batches instead
(:meth:`Callback.on_phase_marks`), which costs a step only the marks' clock reads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, ClassVar

from gpufleet.core.outside import from_outside
from gpufleet.core.phases import Phase, PhaseMarks

log = logging.getLogger(__name__)


class Callback:
    """Subclass and override what you need. Runs on every rank; check
    ``view.env.is_main`` for things that should happen once.

    Every hook's first argument is the run's read-only view
    (:class:`gpufleet.train.engine.view.RunView`: step, epoch, config, env, run_dir, result,
    phase, ...), named ``trainer`` here as it was before there was a view.

    A callback with ``essential = False`` (a metrics sink, a remote logger) may fail
    without stopping training: its error is reported, counted, and the run goes on.
    Only errors of its own making are contained: one that reaches it from outside (a
    DataLoader worker's death raised from a signal handler, a collective's or CUDA's
    failure, running out of memory, Ctrl-C) stops the run at once, as itself
    (:func:`gpufleet.core.outside.from_outside`).
    """

    essential: ClassVar[bool] = True
    #: True: the callback hears the phases through :meth:`on_phase_marks` only, in
    #: batches, never through :meth:`on_phase` (which stays for direct calls).
    phase_marks: bool = False

    def on_fit_start(self, trainer: Any) -> None:
        """After setup (and resume), before the first step."""

    def on_phase(self, trainer: Any, phase: Phase) -> None:
        """A phase begins (:class:`~gpufleet.core.phases.Phase`, equal to its name):
        data, forward, backward, optimizer, end (of the step), then log, eval or
        checkpoint when those run. Called several times per micro-step; keep it to a
        clock read."""

    def on_phase_marks(self, trainer: Any, marks: PhaseMarks) -> None:
        """With ``phase_marks = True``: the phases that began since the last call and
        when (iterate ``marks`` for ``(phase, perf_counter seconds)``). Called when log,
        eval or checkpoint begins, when the buffer is full, before :meth:`on_fit_end`,
        and once before the first step with no marks (the buffer, to keep for reading
        from a thread under ``marks.lock``)."""

    def on_step_end(self, trainer: Any, step: int) -> None:
        """After optimizer step ``step`` (1-based count of steps done). No metrics here:
        reading them would force a host-device sync."""

    def on_log(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        """Every ``log.every`` steps, with metrics already reduced across ranks."""

    def on_eval(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        """After an evaluation, with exact cross-rank metrics."""

    def on_user_log(self, trainer: Any, step: int, values: dict[str, float]) -> None:
        """Numbers your own loop logged (``Fleet.log``/``log_dict``), on rank 0 only, as
        they were given (not reduced across ranks), at ``step``."""

    def on_checkpoint(self, trainer: Any, step: int, path: str) -> None:
        """After a checkpoint was written."""

    def on_fit_end(self, trainer: Any, result: Any) -> None:
        """After the last step, the final evaluation and the final checkpoint."""

    def on_exception(self, trainer: Any, error: BaseException) -> None:
        """The run failed with ``error`` (an exception, ``KeyboardInterrupt`` too), which
        is raised again after this; :meth:`on_fit_end` is not called. Let go of what the
        callback holds beyond the run (threads, open files, process-wide hooks), so that
        a process that goes on (a notebook) keeps none of it. An error raised here is
        logged, never raised in place of ``error``."""


class CallbackList:
    """Dispatches each hook to the callbacks that override it, looked up once."""

    # Each hook of _HOOKS, set in __init__: calls every callback that overrides it.
    on_fit_start: Callable[..., None]
    on_phase: Callable[..., None]
    on_phase_marks: Callable[..., None]
    on_step_end: Callable[..., None]
    on_log: Callable[..., None]
    on_eval: Callable[..., None]
    on_user_log: Callable[..., None]
    on_checkpoint: Callable[..., None]
    on_fit_end: Callable[..., None]
    on_exception: Callable[..., None]

    def __init__(self, callbacks: list[Callback]) -> None:
        self.callbacks = list(callbacks)
        # name -> first error, for each non-essential callback that failed (the summary
        # names them: a sink that logged nothing must not go unnoticed).
        self.failures: dict[str, str] = {}
        for hook in _HOOKS:
            base = getattr(Callback, hook)
            owners = [c for c in self.callbacks if getattr(type(c), hook, base) is not base]
            listeners = [getattr(c, hook) if c.essential and hook != "on_exception"
                         else _tolerant(c, getattr(c, hook), self.failures) for c in owners]
            if hook == "on_log":  # once per log interval: each callback's time is kept
                self.log_seconds: dict[str, float] = {}
                listeners = [_timed(type(c).__name__, fn, self.log_seconds)
                             for c, fn in zip(owners, listeners)]
            setattr(self, hook, _dispatcher(listeners))
            if hook == "on_phase":
                # The loop calls these directly, with no dispatcher in between; those
                # that read the marks in batches are not called per phase.
                self.phase_listeners = [c for c in owners
                                        if not getattr(c, "phase_marks", False)]
            elif hook == "on_phase_marks":
                #: what the phase announcer hands the marks to
                self.mark_readers = [fn for c, fn in zip(owners, listeners)
                                     if getattr(c, "phase_marks", False)]


_HOOKS = ("on_fit_start", "on_phase", "on_phase_marks", "on_step_end", "on_log", "on_eval",
          "on_user_log", "on_checkpoint", "on_fit_end", "on_exception")


def _dispatcher(listeners: list[Any]) -> Callable[..., None]:
    def call(*args: Any) -> None:
        for fn in listeners:
            fn(*args)

    return call


def _timed(name: str, fn: Any, seconds: dict[str, float]) -> Any:
    """``fn`` adding its run time to ``seconds[name]`` (what the slow-logging rule reads)."""
    seconds[name] = 0.0

    def call(*args: Any) -> None:
        start = time.perf_counter()
        try:
            fn(*args)
        finally:
            seconds[name] += time.perf_counter() - start

    return call


def _tolerant(callback: Callback, fn: Any, record: dict[str, str]) -> Any:
    """``fn`` with its own errors reported instead of raised (the 1st, then every 100th)
    and the first one kept in ``record`` under the callback's name; an error from outside
    the callback (:func:`from_outside`) is raised as it is, except in ``on_exception``,
    where the run's error is already on its way."""
    name = type(callback).__name__
    failures = 0

    def call(*args: Any) -> None:
        nonlocal failures
        try:
            fn(*args)
        except Exception as e:
            if fn.__name__ != "on_exception" and from_outside(e):
                raise  # the run's error, not the callback's: it stops the run
            failures += 1
            record.setdefault(getattr(callback, "name", name),
                              f"{fn.__name__}: {type(e).__name__}: {e}"[:300])
            if failures == 1 or failures % 100 == 0:
                after = ("" if fn.__name__ == "on_exception" else
                         " Training goes on without it.")
                log.error("%s failed in %s (%d time(s) so far): %s: %s.%s", name,
                          fn.__name__, failures, type(e).__name__, e, after)

    return call
