"""The training loop: :class:`Trainer` trains a :class:`~gpufleet.train.engine.run.Run`.

Read :meth:`Trainer.fit` top to bottom: resume, then per optimizer step ``grad_accum``
micro-steps of data → forward/backward, then unscale → non-finite guard → clip → step →
zero_grad, then what runs between steps (log line, evaluation, checkpoint, preemption).
Every host-device sync and every collective in the loop is marked with ``SYNC`` or
``COLLECTIVE``; there is no sync per step, only one per log interval (unless fp16 loss
scaling is on or the optimizer is not fused; see :mod:`gpufleet.train.guard.nonfinite`).

Example:
    >>> run = build_run(Config(), model, dataset, loss_fn=F.mse_loss)  # doctest: +SKIP
    >>> result = Trainer(run).fit()  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gpufleet.core.phases import Phase
from gpufleet.fault.crash import crash_reported
from gpufleet.fault.preempt import PreemptionWatch, signal_name
from gpufleet.train.checkpoint.checkpointer import Position
from gpufleet.train.checkpoint.keeping import monitored
from gpufleet.train.engine.interval import LogInterval
from gpufleet.train.engine.resilience import steps_again
from gpufleet.train.engine.result import FitResult
from gpufleet.train.engine.run import Run
from gpufleet.train.engine.step import OptimizerStep, abort, finish
from gpufleet.train.recovery.growing import Regroup
from gpufleet.train.recovery.receipts import restart_receipt
from gpufleet.train.scheduling import SchedulerSteps

log = logging.getLogger(__name__)


class Trainer:
    """Trains ``run`` (built by :func:`~gpufleet.train.engine.build.build_run`) on every rank.

    The trainer owns no parts of its own: it changes ``run.state``, the data position
    and the result, and tells the callbacks.
    """

    def __init__(self, run: Run) -> None:
        self.run = run
        self._score: float | None = None  # the latest checkpoint.monitor value
        self._started = False  # the callbacks were told the fit started

    def fit(self) -> FitResult:
        """Resume if there is a checkpoint, train to ``run.max_steps``, evaluate and save
        at the end; the same :class:`FitResult` on every rank."""
        run = self.run
        growing = run.recovery.growing if run.recovery is not None else None
        try:
            if growing is not None and growing.joining is not None:
                # A new rank joins live ones: its callbacks start alone (no group yet, so
                # none of them meets the others), then it takes rank 0's state.
                run.callbacks.on_fit_start(run.view)
                self._started = True
                growing.join()  # COLLECTIVE, with the live ranks at their Regroup
            else:
                self._resume()  # COLLECTIVE with sharded checkpoints
            with crash_reported(run.view):
                while True:
                    try:
                        return self._train()
                    except Regroup:  # new ranks join after this step (the ranks agreed)
                        assert growing is not None, "only a growing run raises Regroup"
                        growing.grow()
                    except Exception as error:  # peers lost: go on without them, or raise
                        if run.recovery is None or not run.recovery.recover(error):
                            raise
        except BaseException as error:  # the run failed (also before or in on_fit_start):
            abort(run, error)  # callbacks let go of what they hold
            raise
        finally:
            self.run.close()

    def _resume(self) -> None:
        """Start the data where the newest checkpoint left it (the run directory's plan
        chose it), with model, optimizer, scheduler, scaler and RNG restored."""
        run = self.run
        at = Position(0, 0, 0)
        began_t, start = time.time(), time.perf_counter()
        if run.resume_from is not None:
            at = run.saver.load(run.resume_from)
            run.state.step = run.state.saved_step = at.step
        seconds = time.perf_counter() - start
        run.stream.start(at.epoch, at.consumed)
        keeper = run.monitors.receipts
        if keeper is not None and run.env.restart_count > 0 and run.env.is_main:
            # The agent restarted the ranks: a receipt (written once the steps re-warm).
            source = Path(run.resume_from) if run.resume_from is not None else None
            keeper.settle(restart_receipt(
                run, source, at.step, run.saver.restored_world or run.env.world_size,
                began_t, seconds), time.perf_counter())

    def _train(self) -> FitResult:
        run, state = self.run, self.run.state
        self.interval = LogInterval(run)
        # What each micro-step hands the strategy; the strategy calls the last one where
        # backward begins (None: nobody listens).
        accum = run.cfg.optim.grad_accum
        # Your training step, where there is one, computes the loss (one model's; the
        # step over several models has its own forward and backward).
        loss_fn = run.loss_fn if run.user_step is None else run.user_step.as_loss_fn()
        self._micro_args = (loss_fn, run.precision, 1.0 / accum,
                            run.phases.marker(Phase.BACKWARD) if run.phases else None)
        # Nothing runs between steps before this step (log, eval, checkpoint, the
        # preemption check): one comparison per step instead of each interval's test.
        next_due = self._next_due(state.step)
        self._next_epoch_save = self._epoch_save_after(run.stream.epochs_done)
        self._schedules = SchedulerSteps(run)
        # The optimizer step both loops share; this loop steps the schedulers and zeroes
        # the gradients itself (an own loop calls them).
        optimizer_step = OptimizerStep(run, self.interval, self._schedules, zero_grad=True)
        clip_value, clip_norm = run.cfg.optim.clip_value or None, run.cfg.optim.clip_norm or None
        first = run.parts[0].name
        for part in run.parts:
            if part.guard is not None:  # decides whether it inspects before the clip
                part.guard.start(part.model, part.optimizer, run.device)
            part.model.train()
        if not self._started:  # once: a run recovered in process keeps its callbacks
            run.callbacks.on_fit_start(run.view)
            self._started = True
        else:  # recovered in process: the time since the last step's marks is no
            steps_again(run)  # step's phase
        forward_backward = (self._forward_backward if len(run.parts) == 1
                            else self._forward_backward_parts)
        # The model's part of a micro-step (_counted puts a counting one in its place).
        self._model_step: Callable[..., torch.Tensor] = run.strategy.forward_backward
        # FLOPs are counted on the second step, not the first: counting slows a step by
        # tens of ms, which would delay the first step's answer (an error, a loss).
        count_after = state.step + 1
        while state.step < run.max_steps:
            if run.user_step is not None:
                run.user_step.step = state.step
            if state.flops_per_step is None and state.step >= count_after:
                step_loss = self._counted(forward_backward)
            else:
                step_loss = forward_backward()
            # For each model with a loss: unscale → guard → clip → step or skip → log
            # interval → schedule → zero_grad; then the step's end (step += 1,
            # Phase.END, on_step_end); each point marked in engine/step.py.
            # COLLECTIVE: the guard's agreed flag (fault.skip_nonfinite, every step, no
            # SYNC on the device path) and the clip's norm where gradients are sharded;
            # SYNC: the guard's host path (fp16, ZeRO, an unfused optimizer).
            losses = step_loss if isinstance(step_loss, dict) else {first: step_loss}
            optimizer_step.end(optimizer_step.step_parts(run.parts, losses, accum,
                                                         clip_value, clip_norm))
            if state.step >= next_due:
                if self._between_steps():
                    break  # preempted, with a checkpoint
                next_due = self._next_due(state.step)
        return self._finish()

    def _forward_backward(self) -> torch.Tensor:
        """``grad_accum`` micro-steps; returns their losses summed (a device tensor)."""
        run = self.run
        announce, model, strategy = run.phases.announce, run.parts[0].model, run.strategy
        args, accum, data = self._micro_args, run.cfg.optim.grad_accum, run.stream
        step_loss: Any = None
        for micro in range(accum):
            announce(Phase.DATA)
            batch = data.next()
            announce(Phase.FORWARD)  # backward is announced by the strategy (`mark`)
            # Gradients are all-reduced on the last micro-step only (DDP no_sync); the
            # loss is scaled by 1/accum so the sum is one big batch's mean.
            if micro == accum - 1:
                # COLLECTIVE (ddp): the gradient all-reduce runs in buckets during this
                # backward.
                loss = self._model_step(model, batch, *args)
            else:
                with strategy.no_sync(model):
                    loss = self._model_step(model, batch, *args)
            step_loss = loss if step_loss is None else step_loss + loss
        return step_loss

    def _forward_backward_parts(self) -> dict[str, torch.Tensor]:
        """``grad_accum`` micro-steps of your step over several models; returns each
        model's losses summed (device tensors; the models that sat the step out are
        missing)."""
        from gpufleet.train.engine.steps import forward_backward_parts, no_sync_all

        run = self.run
        announce, strategy, parts = run.phases.announce, run.strategy, run.parts
        _, precision, scale, mark = self._micro_args
        accum, user_step, data = run.cfg.optim.grad_accum, run.user_step, run.stream
        assert user_step is not None, "a run of several models has your training step"
        step_loss: dict[str, torch.Tensor] = {}
        for micro in range(accum):
            announce(Phase.DATA)
            batch = data.next()
            announce(Phase.FORWARD)
            # As with one model: every wrapped model syncs its gradients on the last
            # micro-step only (COLLECTIVE there, with ddp).
            if micro == accum - 1:
                losses = forward_backward_parts(parts, batch, user_step, precision,
                                                scale, mark)
            else:
                with no_sync_all(strategy, parts):
                    losses = forward_backward_parts(parts, batch, user_step,
                                                    precision, scale, mark)
            for name, loss in losses.items():
                step_loss[name] = loss if name not in step_loss else step_loss[name] + loss
        return step_loss

    def _next_due(self, step: int) -> int:
        """The first step after ``step`` that ends a log interval, or is due for
        evaluation, a checkpoint or the preemption check (or ends the run)."""
        cfg, watch = self.run.cfg, self.run.monitors.preemption
        every = (cfg.log.every, cfg.run.eval_every, cfg.checkpoint.every,
                 watch.check_every if watch is not None else 0)
        due = [step - step % n + n for n in every if n] + [self.run.max_steps]
        if cfg.checkpoint.every_epochs:  # where the epoch being read ends
            due.append(step + self.run.stream.steps_to_epoch_end(cfg.optim.grad_accum))
        return min(due)

    def _between_steps(self) -> bool:
        """The log line, evaluation, checkpoint and preemption check, each when its
        interval is due; True when the run stops for preemption (after a checkpoint).
        Evaluation and checkpoints are timed apart from training throughput."""
        run, cfg, step, phase = self.run, self.run.cfg, self.run.state.step, self.run.phases
        if step % cfg.log.every == 0 or step == run.max_steps:
            phase.announce(Phase.LOG)
            metrics = self.interval.close()  # COLLECTIVE + SYNC
            self._observe(metrics)
            run.result.losses.append((step, metrics["loss"]))
            run.callbacks.on_log(run.view, step, metrics)
        if cfg.run.eval_every and step % cfg.run.eval_every == 0 and step < run.max_steps \
                and run.evaluator is not None:
            with phase(Phase.EVAL):
                self.evaluate()
            self.interval.restart_clock()
        if cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
            with phase(Phase.CHECKPOINT):
                self.save_checkpoint()
            self.interval.restart_clock()
        if cfg.checkpoint.every_epochs and run.stream.epochs_done >= self._next_epoch_save:
            if run.state.saved_step != step:  # not written just above
                with phase(Phase.CHECKPOINT):
                    self.save_checkpoint()
                self.interval.restart_clock()
            self._next_epoch_save = self._epoch_save_after(run.stream.epochs_done)
        # COLLECTIVE (two ints on the CPU, every fault.preempt_check_every steps): a
        # SIGTERM/SIGUSR1/SIGINT, or a stop request (early stopping, a callback), on any
        # rank stops every rank after this same step.
        watch, requested = run.monitors.preemption, bool(run.state.stop_reason)
        growing = run.recovery.growing if run.recovery is not None else None
        grow = (growing is not None and growing.ready is not None
                and step < run.max_steps)  # at the end: nothing left to join for
        if watch is not None and watch.should_stop(step, requested, grow):
            if watch.stop_requested:
                self._stop_on_request()
            else:
                self._stop_for_preemption(watch)
            return True
        if watch is not None and watch.grow_agreed:
            raise Regroup  # a node joins: the live ranks take its ranks in, then go on
        if watch is None and requested:  # one process (at its next due step)
            self._stop_on_request()
            return True
        return False

    def _epoch_save_after(self, epochs_done: float) -> int:
        """The epoch count at which the next checkpoint.every_epochs save is due."""
        n = self.run.cfg.checkpoint.every_epochs
        return (int(epochs_done) // n + 1) * n if n else 0

    def _stop_on_request(self) -> None:
        """End the run after this step, as at its normal end (evaluation, checkpoint)."""
        run = self.run
        reason = run.state.stop_reason or "another rank asked the run to stop"
        run.result.stopped_early = reason
        if run.env.is_main:
            log.warning("stopping after step %d: %s", run.state.step, reason)
        if not run.cfg.checkpoint.save_final and run.state.saved_step != run.state.step:
            self.save_checkpoint()  # COLLECTIVE: a stopped run always ends with one

    def _stop_for_preemption(self, watch: PreemptionWatch) -> None:
        """Checkpoint the step just finished; the run then ends without evaluating.
        ``watch``: the preemption watch that agreed to stop for a signal."""
        run = self.run
        assert watch.received is not None, "should_stop agreed on a stop signal"
        run.result.preempted = signal_name(watch.received)
        if run.env.is_main:
            log.warning("%s received: stopping after step %d with a checkpoint",
                        run.result.preempted, run.state.step)
        if run.state.saved_step != run.state.step:
            self.save_checkpoint()  # COLLECTIVE

    def _counted(self, forward_backward: Any) -> Any:
        """``forward_backward()`` with its FLOPs counted (torch's FLOP counter) into
        ``state.flops_per_step``: with one model, only its forward and backward (not the
        data loading, which the counter would slow down too). Not counted (FLOPs
        unknown, no MFU) with torch.compile, whose graphs the counter does not see
        through reliably."""
        state = self.run.state
        if self.run.cfg.perf.compile:
            state.flops_per_step = 0
            return forward_backward()
        from gpufleet.monitor.flops import flop_counter  # torch's counter: deferred

        if len(self.run.parts) > 1:  # several models: the whole step
            with flop_counter() as counter:
                step_loss = forward_backward()
            state.flops_per_step = counter.get_total_flops()
            return step_loss
        plain, total = self._model_step, 0

        def counted(*args: Any) -> torch.Tensor:
            nonlocal total
            with flop_counter() as counter:  # one per micro-step (entering resets it)
                loss = plain(*args)
            total += counter.get_total_flops()
            return loss

        self._model_step = counted
        try:
            step_loss = forward_backward()
        finally:
            self._model_step = plain
        state.flops_per_step = total
        return step_loss

    def evaluate(self) -> float | None:
        """Evaluate now (:class:`~gpufleet.train.engine.evaluator.Evaluator`, COLLECTIVE + SYNC),
        record the result and tell the callbacks; the loss, or None without eval data."""
        run, step = self.run, self.run.state.step
        if run.evaluator is None:
            return None
        value, metrics, count = run.evaluator.run()
        self._schedules.after_eval(value)
        run.result.eval_losses.append((step, value))
        if metrics:
            run.result.eval_metrics.append((step, metrics))
        record = {"step": step, "eval_loss": value, "eval_samples": count,
                  "eval_metrics": metrics}
        self._observe(record)
        run.callbacks.on_eval(run.view, step, record)
        return value

    def _observe(self, metrics: dict[str, Any]) -> None:
        """Keep the value checkpoint.keep_best ranks checkpoints by, when present."""
        if self.run.cfg.checkpoint.keep_best:
            value = monitored(self.run.cfg.checkpoint.monitor, metrics)
            if value is not None:
                self._score = value

    def save_checkpoint(self) -> None:
        """Save the full training state (COLLECTIVE). A failed write is recorded in the
        result and training goes on."""
        run, state = self.run, self.run.state
        path, error = run.saver.save(
            Position(state.step, run.stream.epoch, run.stream.consumed), run.result.checkpoint,
            score=self._score)
        if error is not None:
            run.result.checkpoint_errors.append(error)
            return
        if run.env.is_main:
            run.callbacks.on_checkpoint(run.view, state.step, str(path))
        run.result.checkpoint = str(path)
        state.saved_step = state.step

    def _finish(self) -> FitResult:
        """The final evaluation and checkpoint (unless this step already had them), the
        result, and the HTML report."""
        run, state, result, phase = self.run, self.run.state, self.run.result, self.run.phases
        if run.evaluator is not None and not result.preempted and (
                not result.eval_losses or result.eval_losses[-1][0] != state.step):
            with phase(Phase.EVAL):
                self.evaluate()
        if run.cfg.checkpoint.save_final and state.saved_step != state.step:
            with phase(Phase.CHECKPOINT):
                self.save_checkpoint()
        # COLLECTIVE with checkpoint.async_save: the background write ends before the run
        # does (also after a preemption signal); a failed one is reported in the result.
        run.saver.finish(result)
        return finish(run, result)  # the totals, on_fit_end, report.html: as Fleet's
