"""The training loop.

Read :meth:`Trainer.fit` top to bottom: one optimizer step is ``grad_accum`` micro-steps
of data → forward/backward, then unscale → clip → step → zero_grad. Every host-device
sync and every collective in the loop is marked with ``SYNC`` or ``COLLECTIVE``; there
is no sync per step, only one per log interval (unless fp16 loss scaling is on or the
optimizer is not fused; see :mod:`gpufleet.fault.nonfinite`).
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from gpufleet.config import Config
from gpufleet.core.callbacks import Callback
from gpufleet.core.phases import Phase, PhaseAnnouncer
from gpufleet.core.tree import batch_size_of, tokens_of
from gpufleet.errors import ConfigError
from gpufleet.fault.crash import write_crash_report
from gpufleet.monitor.metrics import flops_metrics, phase_metrics
from gpufleet.procs import forget_process
from gpufleet.train.evalmetrics import EvalMetric
from gpufleet.train.evaluator import Evaluator
from gpufleet.train.perf import to_channels_last
from gpufleet.train.result import FitResult
from gpufleet.train.setup import TrainerSetup

log = logging.getLogger(__name__)

_NO_COUNT = contextlib.nullcontext()  # reusable: stands for "FLOPs already counted"


class Trainer(TrainerSetup):
    """Trains ``model`` on ``train_data`` as ``cfg`` says, on every rank of the job.

    Args:
        cfg: the run configuration (see :mod:`gpufleet.config`).
        model: your ``nn.Module``; built identically on every rank (DDP broadcasts
            rank 0's weights anyway).
        train_data: a map-style ``Dataset``; each item (or collated batch) is
            ``(inputs, target)``, a tuple of model arguments, or a dict of them.
        eval_data: optional evaluation ``Dataset``.
        loss_fn: ``loss(model_output, target)``; omit when the model returns its loss.
        callbacks: extra :class:`Callback` objects.
        eval_metrics: ``{name: fn(output, target)}`` evaluated besides ``eval.metrics``
            (see :mod:`gpufleet.train.evalmetrics`).

    Example:
        >>> trainer = Trainer(Config(), model, dataset, loss_fn=F.mse_loss)  # doctest: +SKIP
        >>> result = trainer.fit()  # doctest: +SKIP
    """

    def __init__(self, cfg: Config, model: nn.Module, train_data: Dataset,
                 eval_data: Dataset | None = None, *, loss_fn: Any = None,
                 callbacks: list[Callback] | tuple[Callback, ...] = (),
                 eval_metrics: Mapping[str, Any] | None = None) -> None:
        super().__init__(cfg, model, train_data, eval_data, loss_fn, list(callbacks))
        self.eval_metrics += [EvalMetric(name, fn) for name, fn in (eval_metrics or {}).items()]
        self.evaluator = None if self.eval_loader is None else Evaluator(
            self.eval_loader, self.model, self.strategy, self.precision, self.loss_fn,
            self.eval_metrics, device=self.device, pin_memory=self.pin_memory,
            channels_last=self.cfg.perf.channels_last, max_batches=self.cfg.run.eval_batches,
            data_copies=self.data_copies)

    # -- the loop --------------------------------------------------------------------
    def fit(self) -> FitResult:
        try:
            result = self._fit()
            forget_process(self.run_dir)  # a clean end leaves nothing to clean up
            return result
        except ConfigError:
            # A config or code mistake (its message names the fix), not a crash: no
            # report, and nothing is left running to clean up.
            forget_process(self.run_dir)
            raise
        except Exception as e:
            # Fatal (OOM, a failed collective, a bug): leave a report in the run
            # directory that says where and why, then fail as before.
            write_crash_report(self.view, e)
            raise
        finally:
            if self.watchdog is not None:
                self.watchdog.stop()
            if self.run_lock is not None:
                self.run_lock.release()
            if self.preemption is not None:
                self.preemption.close()

    def _fit(self) -> FitResult:
        cfg, model, opt = self.cfg, self.model, self.optimizer
        strategy, precision, cbs = self.strategy, self.precision, self.callbacks
        guard = self.nonfinite  # None when fault.skip_nonfinite is off
        accum, max_steps = cfg.optim.grad_accum, self.max_steps  # steps or epochs
        loss_scale = 1.0 / accum
        phase = self._phases = PhaseAnnouncer(cbs.phase_listeners, self.view)
        # The strategy calls this where backward begins (None: nobody listens).
        mark = phase.marker(Phase.BACKWARD) if phase else None
        cbs.on_fit_start(self.view)
        # Running sum of micro-batch losses, kept on the device: adding to it does not
        # wait for the GPU. It is read once per log interval.
        loss_sum = torch.zeros((), device=self.device)
        micro_steps = 0
        interval_start = time.perf_counter()
        model.train()
        while self.step < max_steps:
            # ---- forward/backward over grad_accum micro-batches ------------------------
            step_loss: torch.Tensor | None = None  # this step's loss summed over micro-steps
            # FLOPs of a step are counted once, on the first (torch's FLOP counter).
            counting = self._flop_counter() if self.flops_per_step is None else _NO_COUNT
            with counting:
                for micro in range(accum):
                    with phase(Phase.DATA):
                        batch = self.next_batch()
                    with phase(Phase.FORWARD):  # backward is announced by `mark`
                        args = (model, batch, self.loss_fn, precision, loss_scale, mark)
                        # Gradients are all-reduced on the last micro-step only (DDP
                        # no_sync); the loss is scaled by 1/accum so the sum equals one
                        # big batch's mean.
                        if micro == accum - 1:
                            # COLLECTIVE (ddp): the gradient all-reduce runs in buckets
                            # during this backward.
                            loss = strategy.forward_backward(*args)
                        else:
                            with strategy.no_sync(model):
                                loss = strategy.forward_backward(*args)
                    step_loss = loss if step_loss is None else step_loss + loss
            if counting is not _NO_COUNT:
                self.flops_per_step = counting.get_total_flops()
            # ---- optimizer step ------------------------------------------------------
            phase.announce(Phase.OPTIMIZER)
            precision.unscale(opt)  # true gradient sizes before clipping
            if guard is not None:
                # COLLECTIVE (fault.skip_nonfinite): with a fused optimizer, the ranks
                # agree on the device whether this step's loss or gradients (as backward
                # left them) are non-finite, and the optimizer skips by itself.
                guard.inspect(model, step_loss, opt)
            if cfg.optim.clip_value:
                torch.nn.utils.clip_grad_value_(model.parameters(), cfg.optim.clip_value)
            norm = None
            if cfg.optim.clip_norm:
                # The norm stays a device tensor; it is only read at log time.
                self.grad_norm = norm = strategy.clip_grad_norm(model, cfg.optim.clip_norm)
            # Device path with clipping by norm only: the same COLLECTIVE happens here,
            # on the norms the clip measured before clipping. Without the device path
            # (fp16, ZeRO, an unfused optimizer): COLLECTIVE + SYNC, all ranks agree on
            # the host to skip a step that is not finite.
            skip = guard is not None and guard.should_skip(model, step_loss, norm, opt)
            if not skip:
                precision.step(opt)  # SYNC with fp16 and a non-fused optimizer (found_inf)
                # On the device path a skipped step's loss is added too (no host read
                # here); the guard takes it out again at the log interval.
                loss_sum += step_loss
                micro_steps += accum
            if not skip:
                self.scheduler.step()
            else:
                with warnings.catch_warnings():
                    # The schedule follows the step count, skipped steps included, so
                    # torch's warning about a scheduler step without an optimizer step
                    # does not apply.
                    warnings.filterwarnings("ignore", "Detected call of `lr_scheduler")
                    self.scheduler.step()
            opt.zero_grad()  # frees the gradients (set_to_none is the default)
            strategy.after_optimizer_step(model, self.step)
            self.step += 1
            if skip:
                guard.report(self.step, self.env.is_main)  # stops after too many in a row
            phase.announce(Phase.END)
            cbs.on_step_end(self.view, self.step)
            # ---- once per log interval: reduce and report -----------------------------
            if self.step % cfg.log.every == 0 or self.step == max_steps:
                phase.announce(Phase.LOG)
                now = time.perf_counter()
                self._log_interval(loss_sum, micro_steps, now - interval_start)
                loss_sum.zero_()
                micro_steps = 0
                interval_start = time.perf_counter()
            # Evaluation and checkpoints are timed apart from training throughput.
            if cfg.run.eval_every and self.step % cfg.run.eval_every == 0 \
                    and self.step < max_steps and self.eval_loader is not None:
                with phase(Phase.EVAL):
                    self.evaluate()
                interval_start = time.perf_counter()
            if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0:
                with phase(Phase.CHECKPOINT):
                    self.save_checkpoint()
                interval_start = time.perf_counter()
            # COLLECTIVE (one int on the CPU, every fault.preempt_check_every steps): a
            # SIGTERM/SIGUSR1/SIGINT on any rank stops every rank after this same step.
            if self.preemption is not None and self.preemption.should_stop(self.step):
                self._stop_for_preemption()
                break
        return self._finish()

    def _stop_for_preemption(self) -> None:
        """Checkpoint the step just finished; the run then ends without evaluating."""
        from gpufleet.fault.preempt import signal_name

        self.result.preempted = signal_name(self.preemption.received)
        if self.env.is_main:
            log.warning("%s received: stopping after step %d with a checkpoint",
                        self.result.preempted, self.step)
        if self._saved_step != self.step:
            self.save_checkpoint()  # COLLECTIVE

    def _flop_counter(self) -> Any:
        """torch's FLOP counter for the first step; off (FLOPs unknown, no MFU) with
        torch.compile, whose graphs the counter does not see through reliably."""
        if self.cfg.perf.compile:
            self.flops_per_step = 0
            return _NO_COUNT
        from gpufleet.monitor.flops import flop_counter

        return flop_counter()

    def next_batch(self) -> Any:
        """The next training batch on the device; epochs roll over by themselves."""
        batch = next(self._batches, None)
        if batch is None:  # end of epoch: the sampler has moved on to the next one
            self.epoch += 1
            self.consumed = 0
            self._batches = self._epoch_iterator()
            batch = next(self._batches)
        self.consumed += self._consume_unit  # samples ("fixed") or batches ("tokens")
        # Sizes come from tensor shapes on the host: no device sync.
        if self._variable_batches:
            self._interval_samples += batch_size_of(batch)
            self._interval_tokens += tokens_of(batch) or 0  # padding included
        else:  # drop_last=True: every batch holds exactly data.batch_size samples
            if self._fixed_tokens is None:
                self._fixed_tokens = tokens_of(batch) or 0
            self._interval_samples += self._consume_unit
            self._interval_tokens += self._fixed_tokens
        # On CPU the loader already made the tensors; on CUDA the DevicePrefetcher has
        # copied them on its side stream (see _epoch_iterator).
        if self.cfg.perf.channels_last:
            return to_channels_last(batch)
        return batch

    def _log_interval(self, loss_sum: torch.Tensor, micro_steps: int, seconds: float) -> None:
        world = self.env.world_size
        counts = torch.tensor([self._interval_samples, self._interval_tokens],
                              dtype=torch.float32, device=self.device)
        self._interval_samples, self._interval_tokens = 0, 0
        parts = [torch.stack([loss_sum.float(), self.grad_norm.float().to(self.device)]),
                 counts]
        guard = self.nonfinite
        skips = guard.pending() if guard is not None else None  # on the device path
        if skips is not None:  # the same on every rank: the sum is world times it
            parts.append(skips)
        if self.phase_timer is not None:
            # Every rank fills its own row of a [world, phases] table; the sum below
            # hands every rank the whole table (the straggler view) in the same message.
            host, _ = self.phase_timer.take()
            table = torch.zeros(world, len(host), dtype=torch.float32)
            table[self.env.rank] = torch.tensor(host)
            parts.append(table.flatten().to(self.device))
        stats = torch.cat(parts)
        # COLLECTIVE + SYNC, once per log interval: mean loss over ranks and micro-steps,
        # the exact global sample and token counts, and every rank's phase times.
        self.strategy.all_reduce(stats)
        values = stats.tolist()
        loss_total, norm_total, samples, tokens = values[:4]
        rest = values[4:]
        if skips is not None:
            loss_total = guard.settle([v / world for v in rest[:len(skips)]],
                                      self._last_log_step, self.env.is_main, loss_total)
            # The skipped steps' losses are out of loss_total: out of the count too.
            micro_steps -= guard.interval_skipped * self.cfg.optim.grad_accum
            rest = rest[len(skips):]
        # Pipeline stages read the same samples: count each once.
        samples, tokens = samples / self.data_copies, tokens / self.data_copies
        # Skipped steps add no loss; an interval of skipped steps only has none.
        loss = loss_total / (micro_steps * world) if micro_steps else float("nan")
        self._train_time += seconds
        self._samples_seen += samples
        metrics: dict[str, Any] = {
            "step": self.step, "epoch": self.epoch, "loss": loss,
            "lr": self.scheduler.get_last_lr()[0], "grad_norm": norm_total / world,
            "samples_per_s": samples / seconds if seconds > 0 else 0.0,
            "step_time_s": seconds / max(1, self.step - self._last_log_step),
        }
        self._last_log_step = self.step
        if guard is not None and guard.interval_skipped:
            metrics["skipped_steps"] = guard.interval_skipped  # the same on all ranks
            guard.interval_skipped = 0
        if tokens:
            metrics["tokens_per_s"] = tokens / seconds if seconds > 0 else 0.0
            self._tokens_seen += tokens
        if self.phase_timer is not None:
            metrics.update(phase_metrics(rest, world, self.env.rank,
                                         self.phase_timer.device_times()))
        if self.device.type == "cuda":  # the allocator's own counter: no sync
            metrics["mem_peak_gb"] = torch.cuda.max_memory_reserved(self.device) / 2**30
        if self.flops_per_step and seconds > 0:
            metrics.update(flops_metrics(self.flops_per_step, metrics["step_time_s"],
                                         self.peak_flops))
        self.result.losses.append((self.step, loss))
        self.callbacks.on_log(self.view, self.step, metrics)

    def evaluate(self) -> float | None:
        """Evaluate now (:class:`~gpufleet.train.evaluator.Evaluator`), record the result
        and tell the callbacks; the loss, or None without evaluation data."""
        if self.evaluator is None:
            return None
        value, metrics, count = self.evaluator.run()  # COLLECTIVE + SYNC
        self.result.eval_losses.append((self.step, value))
        if metrics:
            self.result.eval_metrics.append((self.step, metrics))
        self.callbacks.on_eval(self.view, self.step, {"step": self.step, "eval_loss": value,
                                                      "eval_samples": count,
                                                      "eval_metrics": metrics})
        return value

    def _finish(self) -> FitResult:
        result, phase = self.result, self._phases
        if self.eval_loader is not None and not result.preempted and (
                not result.eval_losses or result.eval_losses[-1][0] != self.step):
            with phase(Phase.EVAL):
                self.evaluate()
        if self.cfg.checkpoint.save_final and self._saved_step != self.step:
            with phase(Phase.CHECKPOINT):
                self.save_checkpoint()
        result.steps = self.step
        result.epochs = self.epochs_done
        result.skipped_steps = self.nonfinite.skipped if self.nonfinite is not None else 0
        result.train_time_s = self._train_time
        if self._train_time > 0:
            result.samples_per_s = self._samples_seen / self._train_time
            if self._tokens_seen:
                result.tokens_per_s = self._tokens_seen / self._train_time
        self.callbacks.on_fit_end(self.view, result)
        result.callback_errors = dict(self.callbacks.failures)
        if self.env.is_main and self.cfg.monitor.report:
            self._write_report()
        return result

    def _write_report(self) -> None:
        """report.html for the run (not essential: a failure is reported, not raised)."""
        from gpufleet.monitor.report import write_report

        try:
            write_report(self.run_dir)  # logs where it went
        except Exception as e:
            log.error("the HTML report could not be written: %s: %s", type(e).__name__, e)
