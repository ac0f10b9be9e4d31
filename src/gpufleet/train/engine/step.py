"""One optimizer step and one end of a run, for both loops: :class:`OptimizerStep`,
:func:`finish` and :func:`abort`.

The built-in loop (:class:`~gpufleet.train.loop.Trainer`) and your own loop under
:class:`~gpufleet.fleet.Fleet` (through :class:`~gpufleet.fleet.steps.StepTracker`)
make the same calls, in this order, for each model whose loss the step has::

    prepare      unscale (true gradient sizes) → the non-finite guard looks at the
                 gradients as backward left them (guard.inspect)
    clip         by value, then by global norm (the norm kept for the log line)
    decide       whether every rank skips the step (guard.should_skip)
    step_or_skip the optimizer's step through the precision, or none;
                 account: the step's loss into the log interval (a step taken)
    schedule     the LR scheduler, taken or skipped step alike (by the run's policy)
    zero_grad    the gradients freed

and once for the whole step, :meth:`OptimizerStep.end`: the strategy's hook after the
optimizer step (local SGD's step count) → ``state.step += 1`` → a skipped step reported (it
stops the run after too many in a row) → ``Phase.END`` → the callbacks'
``on_step_end``.

What differs between the loops is a parameter here, not a second copy:

* the built-in loop hands :class:`OptimizerStep` its :class:`SchedulerSteps` and
  ``zero_grad=True``: it steps the schedulers and zeroes the gradients itself. Your
  loop calls ``scheduler.step()`` and ``optimizer.zero_grad()`` itself:
  ``schedules=None, zero_grad=False``.
* the built-in loop's step is ``precision.step(optimizer)``; yours is the call your
  loop made (``optimizer.step(closure)``), handed in as ``take``.
* the built-in loop's loss is the sum of its ``grad_accum`` micro-steps; yours arrives
  through ``fleet.backward`` and counts the backward passes it had (``count``); the
  clip, in your loop, is your ``clip_gradients`` call, before the step's call.

At the end, :func:`finish` fills the result the same way for both (steps, epochs,
skipped steps, training time, samples and tokens per second, callback errors) and tells
the callbacks; :func:`abort` tells them the run failed. Each loop closes its run itself
(in a ``finally``) and keeps its own policy: the built-in loop's last evaluation and
checkpoint, your loop's last log interval.

Every host-device sync is marked ``SYNC`` and every collective ``COLLECTIVE``; in the
default configuration (a fused optimizer, no fp16) a step here has no host sync.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gpufleet.core.phases import Phase
from gpufleet.monitor.report_cli import write_at_end

if TYPE_CHECKING:
    from gpufleet.train.engine.interval import LogInterval
    from gpufleet.train.engine.result import FitResult
    from gpufleet.train.engine.view import RunLike
    from gpufleet.train.scheduling import SchedulerSteps


class OptimizerStep:
    """The optimizer step of a run on this rank, piece by piece in one order.

    Args:
        run: the run (its strategy, state, phases, callbacks and view are read).
        interval: the log interval the step's loss and clip norm go to (None until
            your loop's first step builds it; set :attr:`interval` then).
        schedules: steps the run's schedulers after each model's step (the built-in
            loop); None where the loop steps its scheduler itself (your loop).
        zero_grad: zero each model's gradients after its step (the built-in loop);
            False where the loop calls ``optimizer.zero_grad()`` itself.

    Example:
        >>> step = OptimizerStep(run, interval, SchedulerSteps(run))  # doctest: +SKIP
        >>> step.end(step.step_parts(run.parts, {"model": loss}, 1))  # doctest: +SKIP
    """

    def __init__(self, run: RunLike, interval: LogInterval | None,
                 schedules: SchedulerSteps | None = None, zero_grad: bool = True) -> None:
        self.run = run
        #: where the step's loss and norm go (your loop's is made at its first step)
        self.interval = interval
        self.schedules = schedules
        self.zero_grad = zero_grad

    def _log_interval(self) -> LogInterval:
        assert self.interval is not None, "the log interval is set before the first step"
        return self.interval

    # -- each model's step, in order ----------------------------------------------------
    def prepare(self, model: nn.Module | None, optimizer: torch.optim.Optimizer,
                precision: Any, guard: Any, step_loss: torch.Tensor | None) -> None:
        """Unscale, then let ``guard`` (None: no guard, or it saw this step already)
        see the gradients as backward left them (``model`` and ``step_loss`` are read
        only then)."""
        precision.unscale(optimizer)  # true gradient sizes before clipping (once a step)
        if guard is not None and guard.inspects:
            # COLLECTIVE (fault.skip_nonfinite): with a fused optimizer, the ranks agree
            # on the device whether this step's loss or gradients (as backward left them)
            # are non-finite, and the optimizer skips by itself (when the clip by norm
            # measures the gradients, this happens on its norms, in decide()). Off the
            # device path the guard decides here: COLLECTIVE + SYNC.
            guard.inspect(model, step_loss, optimizer)

    def clip(self, model: nn.Module, clip_value: float | None, max_norm: float | None,
             norm_type: float = 2.0, record: bool = True) -> torch.Tensor | None:
        """Clip by value (``clip_value``), then by global norm (``max_norm``); None
        leaves either out. Returns the norm before clipping (a device tensor), kept for
        the log line when ``record``."""
        if clip_value is not None:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip_value)
        if max_norm is None:
            return None
        # COLLECTIVE where the mesh spreads the gradients (sharded, tensor parallel,
        # pipeline stages). The norm stays a device tensor; it is only read at log time.
        norm = self.run.strategy.clip_grad_norm(model, max_norm, norm_type)
        if record:
            self._log_interval().grad_norm = norm
        return norm

    def decide(self, model: nn.Module | None, optimizer: torch.optim.Optimizer, guard: Any,
               step_loss: torch.Tensor, norm: torch.Tensor | None) -> bool:
        """Whether every rank skips this step on the host (a guard watches a model:
        without one, none)."""
        # Device path with clipping by norm only: the guard's COLLECTIVE happens here, on
        # the norms the clip measured before clipping. Without the device path (fp16,
        # ZeRO, an unfused optimizer): COLLECTIVE + SYNC, all ranks agree on the host to
        # skip a step that is not finite.
        return guard is not None and model is not None and \
            guard.should_skip(model, step_loss, norm, optimizer)

    def step_or_skip(self, optimizer: torch.optim.Optimizer, precision: Any, skip: bool,
                     step_loss: torch.Tensor | None, count: int,
                     take: Callable[[], Any] | None = None) -> Any:
        """The optimizer's step, unless ``skip``: ``take()`` (your loop's own call) or
        the precision's step; then the step's loss into the log interval, as the loss of
        ``count`` backward passes (0: none, nothing added). Returns what the step
        returned (None when skipped)."""
        if skip:
            return None
        # A loss scaler steps through the precision: SYNC with fp16 and a non-fused
        # optimizer (found_inf).
        out = precision.step(optimizer) if take is None else take()
        if count and step_loss is not None:
            # On the device path a skipped step's loss is added too (no host read here);
            # the guard takes it out again at the log interval.
            self._log_interval().add(step_loss, count)
        return out

    def schedule(self, part: Any, skip: bool) -> None:
        """``part``'s scheduler after its step, taken or ``skip``-ped, where this
        engine steps schedulers (the built-in loop)."""
        if self.schedules is None:
            return  # your loop steps its scheduler itself
        if not skip:
            self.schedules.after_step(part)
            return
        with warnings.catch_warnings():
            # The schedule follows the step count, skipped steps included, so torch's
            # warning about a scheduler step without an optimizer step does not apply.
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler")
            self.schedules.after_step(part)

    def after_clip(self, model: nn.Module | None, optimizer: torch.optim.Optimizer,
                   precision: Any, guard: Any, step_loss: torch.Tensor,
                   norm: torch.Tensor | None, count: int, part: Any = None,
                   take: Callable[[], Any] | None = None) -> tuple[bool, Any]:
        """What follows the clip, in order: decide → step or skip → schedule (``part``'s
        scheduler) → zero_grad. Returns whether the step was skipped, and what the
        optimizer's step returned."""
        skip = self.decide(model, optimizer, guard, step_loss, norm)
        out = self.step_or_skip(optimizer, precision, skip, step_loss, count, take)
        self.schedule(part, skip)
        if self.zero_grad:
            optimizer.zero_grad()  # frees the gradients (set_to_none is the default)
        return skip, out

    def part_step(self, part: Any, step_loss: torch.Tensor, count: int,
                  clip_value: float | None, max_norm: float | None,
                  norms: list[torch.Tensor]) -> bool:
        """One model's whole step (``part``: its model, optimizer, precision, guard and
        scheduler): prepare → clip → :meth:`after_clip`. Returns whether it was skipped;
        the clip's norm, when measured, goes to ``norms``."""
        model, opt, precision, guard = part.model, part.optimizer, part.precision, part.guard
        self.prepare(model, opt, precision, guard, step_loss)
        norm = self.clip(model, clip_value, max_norm)
        if norm is not None:
            norms.append(norm)
        return self.after_clip(model, opt, precision, guard, step_loss, norm, count,
                               part)[0]

    def step_parts(self, parts: Sequence[Any], losses: dict[str, torch.Tensor],
                   count: int, clip_value: float | None = None,
                   max_norm: float | None = None) -> list[Any]:
        """The step of each model of ``parts`` that has a loss in ``losses`` (by name);
        with several, the log line's norm is the norm over all their gradients. Returns
        the guards of the models whose step was skipped, for :meth:`end`."""
        self.run.phases.announce(Phase.OPTIMIZER)
        skipped: list[Any] = []
        norms: list[torch.Tensor] = []
        for part in parts:
            if part.name in losses and self.part_step(part, losses[part.name], count,
                                                      clip_value, max_norm, norms):
                skipped.append(part.guard)
        if len(norms) > 1:  # several models: the norm over all their gradients
            self._log_interval().grad_norm = torch.linalg.vector_norm(torch.stack(norms))
        return skipped

    # -- the step's end -----------------------------------------------------------------
    def end(self, skipped: Iterable[Any]) -> None:
        """The optimizer step is done: the strategy's hook, the step counted, each
        guard in ``skipped`` reports its skip (stops the run after too many in a row),
        then ``Phase.END`` and the callbacks' ``on_step_end``."""
        run = self.run
        state = run.state
        # No collective: local_sgd counts the step for its averaging hook, Horovod ends a
        # skipped step's context.
        run.strategy.after_optimizer_step(run.model, state.step)
        state.step += 1
        for guard in skipped:
            guard.report(state.step, run.env.is_main)  # stops after too many in a row
        run.phases.announce(Phase.END)
        run.callbacks.on_step_end(run.view, state.step)


# -- the run's end ----------------------------------------------------------------------
def finish(run: RunLike, result: FitResult) -> FitResult:
    """The run trained to its end: ``result`` gets its totals (steps, epochs, skipped
    steps, training time, samples and tokens per second), the monitors read the last
    phase marks, the callbacks' ``on_fit_end`` runs (diagnosis.json), their failures go
    into the result, and rank 0 writes report.html. The caller closes the run."""
    state = run.state
    result.steps = state.step
    result.epochs = run.counts.epochs_done
    result.skipped_steps = sum(p.guard.skipped for p in run.parts if p.guard is not None)
    result.train_time_s = state.train_time_s
    if state.train_time_s > 0:
        result.samples_per_s = state.samples / state.train_time_s
        if state.tokens:
            result.tokens_per_s = state.tokens / state.train_time_s
    run.phases.hand_over()  # the monitors read every phase mark
    run.callbacks.on_fit_end(run.view, result)
    result.callback_errors = dict(run.callbacks.failures)
    if run.env.is_main and run.cfg.monitor.report:
        write_at_end(run.run_dir)
    return result


def abort(run: RunLike, error: BaseException) -> None:
    """The run failed with ``error``: the callbacks let go of what they hold
    (``on_exception``); no last log interval, no diagnosis. The caller closes the
    run."""
    run.callbacks.on_exception(run.view, error)
