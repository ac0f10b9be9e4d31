"""What :meth:`gpufleet.fleet.Fleet.setup` hands back: your model and your optimizer,
each telling the run when its part of a step begins.

* :class:`FleetModule` wraps the model as the strategy placed it (DDP, FSDP, or the
  module itself): a forward announces the forward phase (evaluation when the module is
  in ``eval()`` mode) and runs under the run's autocast; its inputs and outputs are
  converted as Fabric's precision plugins convert them (:mod:`~gpufleet.fleet.dtypes`:
  floating-point inputs in the autocast or true dtype, outputs in float32), so the loss your
  loop computes outside the forward sees one dtype, not a bf16 output beside an fp32
  target (whose backward CUDA refuses); attributes of your module read through;
  ``state_dict`` is your module's own (no ``module.`` prefix).
* :class:`FleetOptimizer` wraps your optimizer object (as Fabric's wrapper does): its
  ``step`` goes through the run (unscale, the non-finite guard, the step, then the
  step's end); ``.optimizer`` is your own object, which keeps training.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from gpufleet.core.phases import Phase
from gpufleet.errors import ConfigError
from gpufleet.fleet.dtypes import ForwardDtypes


class FleetModule(nn.Module):
    """Your model as the run trains it.

    Args:
        placed: the module the strategy returned (what runs forward and backward).
        original: your own module (its attributes and state dict).
        announce: tells the run which phase begins.
        precision: the run's precision (its autocast wraps each forward).
        device: this rank's device (``.device``, as Fabric's wrapper has it).
        dtypes: what the forward converts (inputs, outputs, the true precisions'
            default dtype), as Fabric's precision plugins.
        whole: what an evaluation forward runs where ``placed`` is one stage of a
            pipeline (the stages one after another, every rank getting the output);
            a training forward is then refused: the strategy's schedule runs it
            (``fleet.forward_backward``). None: ``placed`` runs every forward.
        guard: the context each forward runs in (its collectives, DDP's buffer
            broadcast, meet a lost node there: :mod:`gpufleet.fleet.recovery`).
    """

    def __init__(self, placed: nn.Module, original: nn.Module,
                 announce: Callable[[Phase], None], precision: Any,
                 device: torch.device | None = None,
                 dtypes: ForwardDtypes | None = None,
                 whole: nn.Module | None = None,
                 guard: AbstractContextManager[Any] | None = None) -> None:
        super().__init__()
        self.placed = placed
        # Read on every forward: plain attributes (a submodule's lookup goes through
        # nn.Module.__getattr__); not a second submodule either.
        object.__setattr__(self, "_placed", placed)
        object.__setattr__(self, "_original", original)
        object.__setattr__(self, "_announce", announce)
        object.__setattr__(self, "_precision", precision)
        object.__setattr__(self, "_device", device)
        object.__setattr__(self, "_dtypes", dtypes or ForwardDtypes())
        object.__setattr__(self, "_whole", whole)
        object.__setattr__(self, "_guard", guard or contextlib.nullcontext())

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._announce(Phase.FORWARD if self.training else Phase.EVAL)
        placed = self._placed if self._whole is None else self._whole_forward()
        dtypes = self._dtypes
        args, kwargs = dtypes.convert_input((args, kwargs))
        if self._precision.autocast_dtype is None and dtypes.true is None:  # fp32
            with self._guard:
                return placed(*args, **kwargs)
        with self._precision.autocast(), dtypes.default_dtype(), self._guard:
            out = placed(*args, **kwargs)
        return dtypes.convert_output(out)

    def _whole_forward(self) -> nn.Module:
        """The pipeline's evaluation forward (COLLECTIVE: every stage's output in
        turn); a training forward is refused."""
        if self.training:
            raise ConfigError(
                "this model is one stage of a pipeline (parallel.strategy = 'pipeline'): "
                "a training forward runs as the strategy's schedule of micro-batches over "
                "every stage, which a forward of this rank's stage cannot do. Use loss = "
                "fleet.forward_backward(model, (inputs, target), loss_fn) in place of the "
                "forward and fleet.backward, or call model.eval() for an evaluation "
                "forward (every rank gets the output).")
        return self._whole

    def place(self, placed: nn.Module) -> None:
        """Run ``placed`` from now on: the same module of yours, placed again over a new
        process group (the ranks left after a lost node regrouped)."""
        self.placed = placed
        object.__setattr__(self, "_placed", placed)

    @property
    def module(self) -> nn.Module:
        """Your own module (unwrapped)."""
        return self._original

    @property
    def device(self) -> torch.device:
        """This rank's device, where the model trains (Fabric's ``.device``)."""
        if self._device is not None:
            return self._device
        return next(self._original.parameters(), torch.empty(0)).device

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self._original.state_dict(*args, **kwargs)

    def load_state_dict(self, state: Any, strict: bool = True, assign: bool = False) -> Any:
        return self._original.load_state_dict(state, strict=strict, assign=assign)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # parameters, buffers, submodules
        except AttributeError:
            return getattr(object.__getattribute__(self, "_original"), name)


class FleetOptimizer:
    """Your optimizer as the run steps it: a thin wrapper around your own object (as
    Fabric's), whose ``step`` goes through the run: unscale, the non-finite guard, the
    step, then the step's end. ``.optimizer`` is your object, which keeps training:
    its parameter groups, state and learning rates are the ones the run steps. Its
    class is a subclass of your optimizer's, so ``isinstance`` checks and LR schedulers
    take it; everything else reads through to your object. Nothing of your object is
    patched (see :func:`watch_direct_steps` for a step called on it directly).

    Args:
        optimizer: the optimizer the run steps (yours, or the one the strategy built).
        run_step: ``run_step(optimizer, closure)``: the step through the run.
        on_zero_grad: called before each ``zero_grad``.
        acts: whether ``zero_grad`` acts now (False inside an accumulate block that
            does not synchronise).
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 run_step: Callable[[torch.optim.Optimizer, Any], Any],
                 on_zero_grad: Callable[[], None] | None = None,
                 acts: Callable[[], bool] | None = None) -> None:
        self._optimizer = optimizer
        self._run_step = run_step
        self._on_zero_grad = on_zero_grad
        self._acts = acts
        # isinstance(wrapped, type(optimizer)) holds, as with Fabric's wrapper
        self.__class__ = type("Fleet" + type(optimizer).__name__,
                              (FleetOptimizer, type(optimizer)), {})

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer this wraps (your own object, where the strategy kept it)."""
        return self._optimizer

    def step(self, closure: Any = None) -> Any:
        return self._run_step(self._optimizer, closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._acts is not None and not self._acts():
            return
        if self._on_zero_grad is not None:
            self._on_zero_grad()
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._optimizer.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        try:
            inner = object.__getattribute__(self, "_optimizer")
        except AttributeError:  # not built yet (unpickling, copying)
            raise AttributeError(name) from None
        return getattr(inner, name)


def unwrap_optimizer(optimizer: Any) -> Any:
    """The optimizer a :class:`FleetOptimizer` wraps; any other object as it is."""
    return optimizer.optimizer if isinstance(optimizer, FleetOptimizer) else optimizer


def watch_direct_steps(optimizer: torch.optim.Optimizer, inside: Callable[[], bool],
                       before: Callable[[], None], after: Callable[[], None]) -> None:
    """A step called on your optimizer itself, not through its :class:`FleetOptimizer`
    (a loop that kept its own reference), still marks the optimizer phase and counts as
    the run's step, through torch's own step hooks (``register_step_pre_hook`` and
    ``register_step_post_hook``); ``inside()`` is true while the wrapper is stepping
    (then the run does it already)."""
    optimizer.register_step_pre_hook(lambda *_: None if inside() else before())
    optimizer.register_step_post_hook(lambda *_: None if inside() else after())
