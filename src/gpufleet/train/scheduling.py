"""When each model's LR scheduler steps in :class:`~gpufleet.train.loop.Trainer`: after
every optimizer step (the default), once each time an epoch has been read to its end
(``sched.interval = "epoch"``), or, for one that steps on a metric (torch's
``ReduceLROnPlateau``), after each evaluation with the eval loss every rank agrees on.
"""

from __future__ import annotations

from typing import Any

import torch

from gpufleet.errors import ConfigError


def steps_on_eval(scheduler: Any) -> bool:
    """Whether ``scheduler`` steps on a metric (torch's ``ReduceLROnPlateau``): the run
    steps it with the eval loss after each evaluation, not every step or epoch."""
    return isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


def check_eval_scheduler(scheduler: Any, evaluates: bool) -> None:
    """Refuse a scheduler that steps on a metric where the run gives it none (no eval
    data or ``run.eval_every = 0``), or one that waits for the metric to rise.

    Raises:
        ConfigError: naming what to change.
    """
    if not steps_on_eval(scheduler):
        return
    if not evaluates:
        raise ConfigError(
            "ReduceLROnPlateau steps on a metric: gpufleet steps it with the eval loss "
            "after each evaluation, and this run does not evaluate. Give eval_data and "
            "run.eval_every (the steps between evaluations), or use a scheduler that "
            "steps on its own.")
    if scheduler.mode != "min":
        raise ConfigError(
            f"ReduceLROnPlateau(mode={scheduler.mode!r}): gpufleet steps it with the eval "
            "loss, which is better lower; build it with mode='min'.")


class SchedulerSteps:
    """Steps the schedulers of a run's models (``run.parts``) at their moments.

    Args:
        run: the run; its parts are read at every call (a recovery rebuilds them).
    """

    def __init__(self, run: Any) -> None:
        self.run = run
        # Epochs each scheduler has stepped for (None: they step every optimizer step):
        # its own count of steps, which a resumed scheduler brings back.
        self._epochs = ({p.name: p.scheduler.last_epoch for p in run.parts}
                        if run.cfg.sched.interval == "epoch" else None)

    def after_step(self, part: Any) -> None:
        """After ``part``'s optimizer step (taken or skipped): every step, or once each
        time an epoch has been read to its end; not one that steps on the eval loss."""
        scheduler = part.scheduler
        if steps_on_eval(scheduler):
            return
        if self._epochs is None:
            scheduler.step()
            return
        done = int(self.run.counts.epochs_done)
        while self._epochs[part.name] < done:
            scheduler.step()
            self._epochs[part.name] += 1

    def after_eval(self, loss: float) -> None:
        """After an evaluation: each scheduler that steps on a metric, with ``loss`` (the
        same on every rank, so every rank takes the same lr)."""
        for part in self.run.parts:
            if steps_on_eval(part.scheduler):
                part.scheduler.step(loss)
