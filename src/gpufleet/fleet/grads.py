"""What your loop does to the gradients between backward and the optimizer's step:
:class:`FleetGrads`, the ``no_backward_sync`` and ``clip_gradients`` of
:class:`~gpufleet.fleet.Fleet`, named and shaped as Lightning Fabric's.

``clip_gradients(error_if_nonfinite=True)``, Fabric's default, raises where the norm is
not finite, as torch's ``clip_grad_norm_`` does, except where the step is watched: by
the run's non-finite guard (the first optimizer set up, with ``fault.skip_nonfinite``
on), which has seen the gradients before the clip and skips that step on every rank,
naming the rank and the parameter, instead of the run stopping; or by fp16's loss
scaler, for which an overflow is expected: it skips the step and lowers its scale.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from gpufleet.errors import ConfigError
from gpufleet.fleet.part import FleetPart
from gpufleet.fleet.steps import StepTracker
from gpufleet.fleet.wrappers import FleetModule, unwrap_optimizer


class FleetGrads(FleetPart):
    """``no_backward_sync`` and ``clip_gradients`` of :class:`~gpufleet.fleet.Fleet`
    (a part of it)."""

    _steps: StepTracker

    @contextlib.contextmanager
    def no_backward_sync(self, module: nn.Module, enabled: bool = True) -> Iterator[None]:
        """Backward passes inside do not synchronise gradients across ranks (ddp's
        ``no_sync``): for gradient accumulation, all but the last micro-batch."""
        if not isinstance(module, FleetModule):  # as Fabric's
            raise TypeError("You need to set up the model first before you can call "
                            f"`fleet.no_backward_sync()` (it got a {type(module).__name__} "
                            "that was not set up): pass the model fleet.setup returned, "
                            "model = fleet.setup(model, ...).")
        with self._rank_run().strategy.no_sync(module.placed) if enabled \
                else contextlib.nullcontext():
            yield

    def clip_gradients(self, module: nn.Module, optimizer: torch.optim.Optimizer,
                       clip_val: float | None = None, max_norm: float | None = None,
                       norm_type: float = 2.0, error_if_nonfinite: bool = True
                       ) -> torch.Tensor | None:
        """Clip by value and/or by global norm (unscaled first; the non-finite guard
        looks at the gradients before they are clipped), in Fabric's order of arguments.
        Returns the norm before clipping (a device tensor) when clipping by norm.

        ``norm_type``: the norm's order (``"inf"`` or ``float("inf")``: the largest
        absolute value); other than 2 only where every rank holds every gradient
        (not fsdp, tensor or pipeline parallel). ``error_if_nonfinite``: a norm that is
        not finite raises RuntimeError (a SYNC: the norm is read on the host), unless the
        non-finite guard or fp16's loss scaler watches this optimizer's step: they skip
        the step instead."""
        if max_norm is None and clip_val is None:
            raise ConfigError("clip_gradients needs max_norm=... or clip_val=...")
        try:
            order = float(norm_type)
        except (TypeError, ValueError):
            order = -1.0
        if not order > 0:
            raise ConfigError(f"clip_gradients(norm_type={norm_type!r}): give the norm's "
                              "order, a number above 0 (2.0: L2) or 'inf'.")
        self._rank_run()
        placed = module.placed if isinstance(module, FleetModule) else module
        return self._steps.clip(placed, unwrap_optimizer(optimizer), max_norm, clip_val,
                                norm_type=order, error_if_nonfinite=error_if_nonfinite)
