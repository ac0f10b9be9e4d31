"""A micro-batch run by the strategy itself: :class:`FleetSchedule`, the
``forward_backward`` of :class:`~gpufleet.fleet.Fleet`.

Most strategies leave the forward and backward to your loop (``loss = loss_fn(model(x),
y)``; ``fleet.backward(loss)``). A pipeline cannot: each rank holds one stage of the
model, and a training step is a schedule (GPipe or 1F1B) that feeds micro-batches
through the stages and runs their backward passes itself. ``fleet.forward_backward``
hands one batch to the strategy's own forward and backward, the call ``fit``'s loop
makes for every micro-batch (:meth:`gpufleet.parallel.base.Strategy.forward_backward`):

* under ``pipeline`` the schedule runs over this rank's stage
  (``parallel.pipeline.schedule``, ``parallel.pipeline.microbatches``); the first stage
  feeds the inputs, the last computes the loss from the target, and every rank gets
  the loss back (one broadcast of a scalar);
* under every other strategy it is the forward and the precision's backward your loop
  would write, so a loop written with it runs under any strategy unchanged.

The optimizer's step, ``clip_gradients``, ``no_backward_sync``, ``accumulate`` and the
non-finite guard work on the result as after :meth:`~gpufleet.fleet.Fleet.backward`.
Under ``pipeline`` a training forward of the set-up model is refused (the stage alone
cannot compute it); an evaluation forward (``model.eval()``) runs the stages one after
another and gives every rank the model's output.

Example:
    >>> # fleet = Fleet(strategy="pipeline", devices=2)  (2 stages)
    >>> # model, optimizer = fleet.setup(nn.Sequential(...), optimizer)
    >>> # loss = fleet.forward_backward(model, (x, y), F.mse_loss)
    >>> # optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gpufleet.fleet.accumulate import Accumulation
from gpufleet.fleet.part import FleetPart
from gpufleet.fleet.steps import StepTracker
from gpufleet.fleet.wrappers import FleetModule
from gpufleet.train.engine.batches import make_loss_fn


class FleetSchedule(FleetPart):
    """``forward_backward`` of :class:`~gpufleet.fleet.Fleet` (a part of it)."""

    _steps: StepTracker
    _accumulation: Accumulation  # Fleet(gradient_accumulation_steps=)

    def forward_backward(self, model: nn.Module, batch: Any,
                         loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
                         ) -> torch.Tensor:
        """Forward and backward of ``batch`` as the run's strategy runs them (under
        ``pipeline``: its schedule of micro-batches over this rank's stage). COLLECTIVE
        under ``pipeline`` (every rank of the pipeline calls it with the same batch).

        Args:
            model: the model :meth:`setup` returned.
            batch: ``(inputs, target)`` (a pipeline needs this shape, with the batch
                size a multiple of ``parallel.pipeline.microbatches``), or under other
                strategies any batch ``fit`` takes.
            loss_fn: ``loss_fn(output, target)`` (e.g. ``F.cross_entropy``); None when
                the model computes its own loss (``model(inputs, target)``; under a
                pipeline, its ``pipeline_loss(output, target)`` hook).

        Returns:
            The batch's loss, detached (under ``pipeline`` the mean over the
            micro-batches, the same on every rank). With
            ``Fleet(gradient_accumulation_steps=N)`` the backward took it divided by N,
            as :meth:`backward` does.

        Raises:
            TypeError: ``model`` was not set up by this Fleet.
        """
        self._rank_run()
        if not isinstance(model, FleetModule):
            raise TypeError(f"forward_backward got a {type(model).__name__} that was not "
                            "set up: pass the model fleet.setup returned "
                            "(model, optimizer = fleet.setup(model, optimizer)).")
        every = self._accumulation.every
        return self._steps.forward_backward(model, batch, make_loss_fn(loss_fn),
                                            1.0 / every if every > 1 else 1.0)
