"""What :meth:`gpufleet.fleet.Fleet.setup` hands back: your model and your optimizer,
each telling the run when its part of a step begins.

* :class:`FleetModule` wraps the model as the strategy placed it (DDP, FSDP, or the
  module itself): a forward announces the forward phase (evaluation when the module is
  in ``eval()`` mode) and runs under the run's autocast, and its floating-point outputs
  come back in float32 under mixed precision (as Fabric returns them), so the loss your
  loop computes outside the forward sees one dtype, not a bf16 output beside an fp32
  target (whose backward CUDA refuses); attributes of your module read through;
  ``state_dict`` is your module's own (no ``module.`` prefix).
* :func:`hook_step` replaces ``optimizer.step`` on the optimizer object itself (it stays
  a ``torch.optim.Optimizer``: your LR scheduler takes it as it is), so that a step goes
  through the run: unscale, the non-finite guard, the step, then the step's end.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gpufleet.core.phases import Phase
from gpufleet.core.tree import map_tensors


class FleetModule(nn.Module):
    """Your model as the run trains it.

    Args:
        placed: the module the strategy returned (what runs forward and backward).
        original: your own module (its attributes and state dict).
        announce: tells the run which phase begins.
        precision: the run's precision (its autocast wraps each forward).
    """

    def __init__(self, placed: nn.Module, original: nn.Module,
                 announce: Callable[[Phase], None], precision: Any) -> None:
        super().__init__()
        self.placed = placed
        # Read on every forward: plain attributes (a submodule's lookup goes through
        # nn.Module.__getattr__); not a second submodule either.
        object.__setattr__(self, "_placed", placed)
        object.__setattr__(self, "_original", original)
        object.__setattr__(self, "_announce", announce)
        object.__setattr__(self, "_precision", precision)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._announce(Phase.FORWARD if self.training else Phase.EVAL)
        if self._precision.autocast_dtype is None:  # fp32: no autocast to enter
            return self._placed(*args, **kwargs)
        with self._precision.autocast():
            out = self._placed(*args, **kwargs)
        return float32_outputs(out)

    @property
    def module(self) -> nn.Module:
        """Your own module (unwrapped)."""
        return self._original

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self._original.state_dict(*args, **kwargs)

    def load_state_dict(self, state: Any, strict: bool = True, assign: bool = False) -> Any:
        return self._original.load_state_dict(state, strict=strict, assign=assign)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # parameters, buffers, submodules
        except AttributeError:
            return getattr(object.__getattribute__(self, "_original"), name)


def float32_outputs(value: Any) -> Any:
    """``value`` with its bf16 and fp16 tensors as float32 (other dtypes, float64 too, as
    they are), through tuples (named ones too), lists, mappings and dataclasses (a
    Transformers ``ModelOutput`` is both), as Fabric converts a mixed-precision forward's
    output. Containers are new ones of the same type (see
    :func:`~gpufleet.core.tree.map_tensors`), never changed in place: a list or dict the
    model keeps and returns stays the model's.

    Example:
        >>> out = float32_outputs({"h": (torch.ones(1, dtype=torch.bfloat16),), "n": 3})
        >>> out["h"][0].dtype, out["n"]
        (torch.float32, 3)
    """
    return map_tensors(value, _as_float32)


def _as_float32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float() if tensor.dtype in (torch.bfloat16, torch.float16) else tensor


def hook_step(optimizer: torch.optim.Optimizer,
              run_step: Callable[[torch.optim.Optimizer, Callable[..., Any], Any], Any]
              ) -> None:
    """Make ``optimizer.step(closure)`` call ``run_step(optimizer, original_step,
    closure)``; a call from inside ``run_step`` (the precision's step) reaches the
    original step."""
    original = optimizer.step
    busy = False

    def step(self: torch.optim.Optimizer, closure: Any = None) -> Any:
        nonlocal busy
        self._opt_called = True  # what an LR scheduler checks (torch warns otherwise)
        if busy:  # the run's own call, through the precision
            return original(closure) if closure is not None else original()
        busy = True
        try:
            return run_step(self, original, closure)
        finally:
            busy = False

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]  # already tracked
    optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]


def hook_zero_grad(optimizer: torch.optim.Optimizer, on_zero: Callable[[], None]) -> None:
    """Make ``optimizer.zero_grad(...)`` call ``on_zero()`` first."""
    original = optimizer.zero_grad

    def zero_grad(self: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        on_zero()
        original(set_to_none)

    optimizer.zero_grad = types.MethodType(zero_grad, optimizer)  # type: ignore[method-assign]
