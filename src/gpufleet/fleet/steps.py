"""What each step of your own loop goes through: :class:`StepTracker`.

Your loop's calls reach it through :class:`~gpufleet.fleet.Fleet` and the objects
``setup`` hands back: a loader asked for a batch, a forward, ``backward``,
``clip_gradients`` and ``optimizer.step``. It announces each phase to the run's
callbacks (built at the first one: then the loaders are known), keeps the step's loss,
runs the non-finite guard and the optimizer step, ends the step and, every
``log.every`` steps, reduces the log interval over the ranks (the one collective a step
adds, besides the guard's off the device path).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from gpufleet.config import config_to_dict, write_config
from gpufleet.core.callbacks import Callback, CallbackList
from gpufleet.core.phases import NEXT_STEP, Phase
from gpufleet.fleet.loader import SetUpLoaders
from gpufleet.fleet.observed import LoopObservations
from gpufleet.monitor.jsonl import MetricsFile
from gpufleet.monitor.sinks import build_sinks
from gpufleet.procs import forget_process
from gpufleet.train.engine.batches import LossFn
from gpufleet.train.engine.build import attach_callbacks
from gpufleet.train.engine.interval import LogInterval
from gpufleet.train.engine.resilience import recovery_of, steps_again
from gpufleet.train.engine.run import Run
from gpufleet.train.engine.step import OptimizerStep, abort, finish

log = logging.getLogger(__name__)



class StepTracker:
    """Follows your loop's steps on this rank.

    Args:
        run: this rank's run.
        loaders: the loaders your loop sets up (the run's data counts).
        callbacks: yours, heard after the run's own.
    """

    def __init__(self, run: Run, loaders: SetUpLoaders, callbacks: Sequence[Callback],
                 on_preempted: Callable[[], None] | None = None) -> None:
        self.run = run
        self.loaders = loaders
        #: what stops the run for a signal the ranks agreed on (saves, ends, exits)
        self._on_preempted = on_preempted
        self._user_callbacks = list(callbacks)
        #: tells the run which phase begins (builds the monitors the first time)
        self.announce: Callable[[Phase], None] = self._first_announce
        self.interval: LogInterval | None = None
        # The optimizer step the built-in loop takes too; your loop steps its scheduler
        # and zeroes its gradients itself.
        self.engine = OptimizerStep(run, None, schedules=None, zero_grad=False)
        self._step_loss: torch.Tensor | None = None
        self._micro = 0  # backward passes in this step
        self._inspected = False  # the guard saw this step's gradients
        self._zeroed = False  # the primary optimizer's zero_grad ran since it did
        self._early_logs: list[tuple[int, dict[str, float]]] = []  # before the 1st step
        self.busy = False  # a set-up optimizer steps through the run now
        self.finished = False
        #: what the loop did (batch size, accumulation, evaluations), for the diagnosis
        self.observed = LoopObservations(restarts=run.env.restart_count)
        #: the context the optimizer steps run in (a lost node met in their collectives
        #: is recovered there: gpufleet.fleet.recovery.RecoveryGuard)
        self.guard: AbstractContextManager[Any] = contextlib.nullcontext()

    # -- phases -------------------------------------------------------------------------
    def phase_announce(self, phase: Phase) -> None:
        """Announce ``phase`` (a stable function to hand to wrappers and loaders)."""
        if phase == Phase.EVAL:
            self.observed.eval_forward()
        self.announce(phase)

    def on_batch(self) -> None:
        """A loader is asked for its next batch: the data phase (inside evaluation,
        still evaluation)."""
        if self.run.phases.current != Phase.EVAL:
            self.announce(Phase.DATA)

    def _first_announce(self, phase: Phase) -> None:
        """The loop's first step begins: build the monitors, then announce as usual. A
        batch read before any model is set up (a peek at its shapes) begins nothing."""
        if self.run.model is None and self.run.optimizer is None:
            return
        self._begin()
        self.announce(phase)

    def user_log(self, step: int, values: dict[str, float]) -> None:
        """Values your loop logged (rank 0), to the callbacks; before the first step
        they wait for the callbacks to be built."""
        if self.interval is None:
            self._early_logs.append((step, values))
        else:
            self.run.callbacks.on_user_log(self.run.view, step, values)

    def _begin(self) -> None:
        """The run's own callbacks (phase timer, watchdog, system sampler, metrics file,
        advisor, as the built-in loop has them), told the loop has started."""
        run = self.run
        first = self.loaders.loaders[0].loader if self.loaders.loaders else None
        if first is not None:  # the diagnosis reads the batch and worker settings
            run.cfg = dataclasses.replace(run.cfg, data=dataclasses.replace(
                run.cfg.data, batch_size=first.batch_size or run.cfg.data.batch_size,
                num_workers=first.num_workers))
            if run.env.is_main:
                write_config(run.cfg, run.run_dir / "config.toml")
        attach_callbacks(run, self._user_callbacks)  # the run's own, as fit's, then yours
        if run.loop_state is not None:  # the registered state, snapshots on: a lost node
            run.recovery = recovery_of(run, None, run.cfg.dist.backend)  # in process
        self.announce = run.phases.announce
        self.interval = self.engine.interval = LogInterval(run)
        run.callbacks.on_fit_start(run.view)
        if self.observed.restarts:  # the elastic agent restarted the ranks: on record
            for metrics in (cb for cb in run.callbacks.callbacks
                            if isinstance(cb, MetricsFile)):
                metrics.write("restart", {"step": run.state.step,
                                          "restarts": self.observed.restarts})
        for step, values in self._early_logs:
            run.callbacks.on_user_log(run.view, step, values)
        self._early_logs = []

    # -- the step -----------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, retain_graph: bool | None = None,
                 inputs: Any = None, create_graph: bool = False) -> None:
        """The backward phase, the precision's backward, the loss kept."""
        self.announce(Phase.BACKWARD)
        if self._inspected:  # gradients change after the guard saw them (rare loops)
            self._look_again()
        self.run.precision.backward(loss, inputs=inputs, retain_graph=retain_graph,
                                    create_graph=create_graph)
        self._count_backward(loss.detach())

    def forward_backward(self, model: torch.nn.Module, batch: Any, loss_fn: LossFn,
                         loss_scale: float) -> torch.Tensor:
        """One micro-batch through the strategy's own forward and backward (under
        ``pipeline`` its schedule over this rank's stage; elsewhere a forward and the
        precision's backward), as the built-in loop's micro-step runs it. Returns the
        detached loss, unscaled (the same on every rank of a pipeline); the step keeps
        it times ``loss_scale``, as :meth:`backward` keeps what it is handed."""
        run = self.run
        self.announce(Phase.FORWARD)
        if self._inspected:
            self._look_again()
        # COLLECTIVE under pipeline: the schedule's sends and receives, then the last
        # stage's loss broadcast to every rank (one scalar).
        loss = run.strategy.forward_backward(model, batch, loss_fn, run.precision,
                                             loss_scale, self._backward_mark)
        self._count_backward(loss * loss_scale if loss_scale != 1.0 else loss)
        return loss

    def _backward_mark(self) -> None:
        self.announce(Phase.BACKWARD)

    def _count_backward(self, detached: torch.Tensor) -> None:
        """A backward pass was taken with ``detached`` as its loss."""
        self.observed.backward(self._batch_size())
        self._step_loss = detached if self._step_loss is None else self._step_loss + detached
        self._micro += 1

    def _batch_size(self) -> int | None:
        """Samples in the batch a set-up loader handed out last (None: none yet)."""
        read = self.loaders.read_last()
        return read.last_batch[2] if read is not None and read.last_batch else None

    def resumed(self, step: int) -> None:
        """A checkpoint restored the step count: the steps go on from ``step`` (the
        log interval under way counts from there)."""
        self.run.state.step = step
        self.observed.resumed_at(step)
        if self.interval is not None:
            self.interval.first_step = step

    def observe(self) -> None:
        """Hand what the loop did to the diagnosis's facts (no sync)."""
        advisor = self.run.monitors.advisor
        if advisor is None:
            return
        facts, seen = advisor.facts, self.observed
        facts.own_loop = True
        facts.batch_size = seen.batch_size or facts.batch_size
        facts.grad_accum = seen.grad_accum
        facts.eval_every = seen.eval_every
        facts.evaluations = seen.evaluations
        facts.steps = self.run.state.step
        facts.restarts = seen.restarts

    def clip(self, placed: torch.nn.Module, optimizer: torch.optim.Optimizer,
             max_norm: float | None, clip_val: float | None, norm_type: float = 2.0,
             error_if_nonfinite: bool = False) -> torch.Tensor | None:
        """Unscale (and let the guard see the gradients first), then clip.
        ``error_if_nonfinite``: raise on a norm that is not finite where no guard
        watches the step (see :mod:`gpufleet.fleet.grads`)."""
        run = self.run
        self.announce(Phase.OPTIMIZER)
        primary = optimizer is run.optimizer
        if primary:
            self.prepare_step(optimizer)
        else:  # unscaled once between its steps; no guard watches it
            self.engine.prepare(placed, optimizer, run.precision, None, None)
        # COLLECTIVE with sharding (in the engine's clip)
        norm = self.engine.clip(placed, clip_val, max_norm, norm_type,
                                record=primary and self.interval is not None)
        if norm is None or max_norm is None:  # (the engine clips by norm with max_norm only)
            return None
        # The guard skips the step on every rank; fp16's loss scaler skips it and backs off.
        guarded = (primary and run.nonfinite is not None) or run.precision.scales_loss
        if error_if_nonfinite and not guarded and not torch.isfinite(norm):  # SYNC
            raise RuntimeError(
                f"clip_gradients: the total norm of order {norm_type:g} of the gradients "
                "is not finite, and neither the non-finite guard (the first optimizer "
                "set up, with fault.skip_nonfinite on) nor fp16's loss scaler watches "
                "this optimizer's step. Pass error_if_nonfinite=False to step anyway.")
        if primary and self.interval is not None and not run.cfg.optim.clip_norm:
            # the log line shows the norm from now on
            run.cfg = dataclasses.replace(run.cfg, optim=dataclasses.replace(
                run.cfg.optim, clip_norm=float(max_norm)))
        return norm

    def prepare_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Before clipping or stepping: unscale (once between steps), then let the guard
        see the gradients as backward left them (once, unless they change)."""
        run = self.run
        guard = None if self._inspected else run.nonfinite
        self.engine.prepare(run.model, optimizer, run.precision, guard,
                            None if guard is None else self._loss_or_zero())
        if not self._inspected:
            self._inspected, self._zeroed = True, False

    def on_zero_grad(self) -> None:
        """The primary optimizer's ``zero_grad`` ran."""
        self._zeroed = True

    def _look_again(self) -> None:
        """A backward after a clip and before the optimizer's step: the guard looks at
        the gradients again before the step. If they were zeroed since (the loop
        dropped that batch), the step starts anew, without the dropped batch's loss,
        and the new gradients are unscaled again."""
        run = self.run
        self._inspected = False
        if run.nonfinite is not None:
            run.nonfinite.forget_step()
        if self._zeroed or run.model is None or \
                all(p.grad is None for p in run.model.parameters()):
            self._step_loss, self._micro = None, 0
            if run.optimizer is not None:
                run.precision.forget_unscale(run.optimizer)

    def _loss_or_zero(self) -> torch.Tensor:
        if self._step_loss is None:
            return torch.zeros((), device=self.run.device)
        return self._step_loss

    def primary_step(self, optimizer: torch.optim.Optimizer, closure: Any = None) -> Any:
        """The first optimizer's step: the guard, the step, then the step's end (the
        engine's, as the built-in loop's), and every ``log.every`` steps the log line."""
        run, engine = self.run, self.engine
        self.announce(Phase.OPTIMIZER)
        self.prepare_step(optimizer)
        # A loss scaler steps through the precision (None: the engine's precision.step);
        # without one that is the optimizer's own step, called here directly.
        take = None if closure is None and run.precision.scales_loss else \
            (lambda: optimizer.step(closure))
        guard, micro = run.nonfinite, self._micro
        self.observed.step_taken(micro)
        # Your clip_gradients call, if any, ran before: no norm is handed to the guard.
        # The step hooks on your optimizer see this step as the run's own (_stepping).
        # The step's loss is the sum of what its backward passes were handed (with the
        # loss divided by the accumulation, the micro-batches' mean): one loss per step.
        # COLLECTIVE: the guard's flag, the log interval's and the stop's agreements.
        with self.guard:
            with self._stepping():
                skip, out = engine.after_clip(run.model, optimizer, run.precision, guard,
                                              self._loss_or_zero(), None, min(micro, 1),
                                              take=take)
            self._step_done((guard,) if skip else ())
        return out

    def went_on(self) -> None:
        """The ranks left after a lost node went on in process, the registered state
        back at ``run.state.step``: the step under way is dropped (its loss, its
        gradients' unscale, the guard's look at them), the log interval starts again
        from there, and the time since the last step is no step's phase."""
        run = self.run
        self._step_loss, self._micro, self._inspected, self._zeroed = None, 0, False, False
        if run.nonfinite is not None:
            run.nonfinite.forget_step()
        if run.optimizer is not None:
            run.precision.forget_unscale(run.optimizer)
        if self.interval is not None:
            self.interval = self.engine.interval = LogInterval(run)
        self.resumed(run.state.step)
        steps_again(run)

    def _step_done(self, skipped_guards: tuple[Any, ...] = ()) -> None:
        """The primary optimizer stepped (or its step was skipped): the engine's end of
        the step, then the log line when one is due."""
        run = self.run
        self._step_loss, self._micro, self._inspected = None, 0, False
        self.engine.end(skipped_guards)
        if run.state.step % run.cfg.log.every == 0:
            self._log()
        self._agree_on_stopping()

    def _agree_on_stopping(self) -> None:
        """COLLECTIVE every ``fault.preempt_check_every`` steps (one int on the CPU): a
        stop signal on any rank, or a stop asked for (a callback's request_stop), stops
        every rank after this same step. A signal's stop is carried out when the loop
        begins its next step (:meth:`_stop_then_announce`); an asked-for stop is the
        loop's to act on (``fleet.should_stop``)."""
        run, watch = self.run, self.run.monitors.preemption
        if watch is None or not watch.should_stop(run.state.step,
                                                  bool(run.state.stop_reason)):
            return
        if watch.stop_requested:
            if not run.result.stopped_early and run.env.is_main:
                log.warning("the ranks agreed to stop after step %d: %s (fleet.should_stop "
                            "is True)", run.state.step,
                            run.state.stop_reason or "another rank asked")
            run.result.stopped_early = run.state.stop_reason or "another rank asked"
        elif self._on_preempted is not None:
            self.announce = self._stop_then_announce

    def _stop_then_announce(self, phase: Phase) -> None:
        """After the step the ranks agreed to stop at: the loop begins its next step
        (data, a forward, backward, evaluation) with its own bookkeeping of the last
        one done, so the run stops now (saves, ends, raises SystemExit); other phases
        (an optimizer's or a checkpoint's of that step) go on as usual."""
        if phase in NEXT_STEP and self._on_preempted is not None:
            self.announce = self.run.phases.announce
            self._on_preempted()  # raises SystemExit
        self.run.phases.announce(phase)

    def other_step(self, optimizer: torch.optim.Optimizer, closure: Any = None) -> Any:
        """Another optimizer's step (a GAN's second one): unscaled, then stepped; no
        guard watches it, its loss is not the run's and it ends no step."""
        run = self.run
        self.announce(Phase.OPTIMIZER)
        self.engine.prepare(None, optimizer, run.precision, None, None)
        take = None if closure is None else (lambda: optimizer.step(closure))
        with self.guard, self._stepping():
            return self.engine.step_or_skip(optimizer, run.precision, False, None, 0, take)

    @contextlib.contextmanager
    def _stepping(self) -> Iterator[None]:
        self.busy = True
        try:
            yield
        finally:
            self.busy = False

    def inside_step(self) -> bool:
        """A set-up optimizer is stepping through the run now."""
        return self.busy

    def direct_step_begins(self) -> None:
        """Your optimizer's own ``step`` was called (not through what ``setup`` returned):
        the optimizer phase."""
        self.announce(Phase.OPTIMIZER)

    def direct_step_ended(self, primary: bool) -> None:
        """That step ended: for the first optimizer, the run's step ends too (without
        the guard: it watches the steps taken through what ``setup`` returned)."""
        if primary:
            self.observed.step_taken(self._micro)
            if self._micro and self.interval is not None:
                self.interval.add(self._loss_or_zero(), 1)  # one step's loss
            with self.guard:  # COLLECTIVE: the log interval's and the stop's agreements
                self._step_done()

    def _log(self) -> None:
        """The log interval's one all-reduce (COLLECTIVE + SYNC), then the callbacks."""
        run, interval = self.run, self.interval
        assert interval is not None, "steps end only after _begin() built the interval"
        run.phases.announce(Phase.LOG)
        self.observe()
        metrics = interval.close()
        run.result.losses.append((run.state.step, metrics["loss"]))
        run.callbacks.on_log(run.view, run.state.step, metrics)

    # -- the end ------------------------------------------------------------------------
    def abort(self, error: BaseException) -> None:
        """The loop failed with ``error``: the callbacks let go of what they hold
        (``on_exception``), the watchdog stops and the run directory is unlocked; no last
        log interval, no diagnosis."""
        if self.finished:
            return
        self.finished = True
        try:
            if self.interval is not None:  # the callbacks were told the run started
                abort(self.run, error)
        finally:
            self.run.close()

    def end(self, collective: bool) -> None:
        """The last log interval (``collective``: every rank is here), the result, the
        callbacks' end (diagnosis.json), report.html; the watchdog stopped and the run
        directory unlocked, also when this fails."""
        run = self.run
        if self.finished:
            return
        self.finished = True
        try:
            if self.interval is not None:
                if collective and run.state.step % run.cfg.log.every:
                    self._log()  # the steps since the last log line
                self.observe()
                finish(run, run.result)  # the totals, on_fit_end, report.html: as fit's
            elif self._early_logs and run.env.is_main:  # logged, never stepped (eval)
                sinks = CallbackList([MetricsFile(run.run_dir / "metrics.jsonl"),
                                      *build_sinks(run.cfg.monitor.sinks, run.run_dir,
                                                   config_to_dict(run.cfg))])
                sinks.on_fit_start(run.view)
                for step, values in self._early_logs:
                    sinks.on_user_log(run.view, step, values)
                sinks.on_fit_end(run.view, run.result)
            forget_process(run.run_dir)
        finally:
            run.close()
