"""Numeric precision as an object whose hooks the loop calls; the defaults do nothing.

* ``fp32``: plain float32 everywhere.
* ``bf16-mixed``: float32 weights, matmuls in bfloat16 under autocast. bfloat16 has the
  range of float32, so no loss scaling is needed.
* ``fp16-mixed``: autocast to float16 plus a ``GradScaler``: the loss is multiplied by a
  large factor before backward so small gradients do not flush to zero, gradients are
  divided back before clipping, and a step whose gradients overflowed is skipped while
  the scale shrinks.

Example:
    >>> p = build_precision("bf16-mixed", "cpu")
    >>> with p.autocast():
    ...     pass
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.amp.grad_scaler import OptState

from gpufleet.config import PrecisionConfig
from gpufleet.errors import ConfigError, unknown_choice

_NO_AUTOCAST = contextlib.nullcontext()  # reusable: fp32 enters it every micro-step


class Precision:
    """fp32: every hook is a plain pass-through."""

    name = "fp32"
    #: dtype autocast computes in (None: no autocast)
    autocast_dtype: torch.dtype | None = None
    #: True when backward goes through a loss scaler (``GradScaler``): what sees only a
    #: shard of the gradients (FSDP) or runs backward itself (a pipeline schedule)
    #: cannot use it.
    scales_loss: bool = False

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type

    def autocast(self) -> contextlib.AbstractContextManager:
        return _NO_AUTOCAST

    def backward(self, loss: torch.Tensor, inputs: Any = None,
                 retain_graph: bool | None = None, create_graph: bool = False) -> None:
        """Backward from ``loss`` (into ``inputs`` only, when given: one model of
        several)."""
        loss.backward(inputs=inputs, retain_graph=retain_graph, create_graph=create_graph)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients to their true size before clipping (no-op without scaling)."""

    def forget_unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """The gradients :meth:`unscale` saw were dropped (zeroed before any step): the
        next ones are scaled again (no-op without scaling)."""

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class BF16Mixed(Precision):
    name = "bf16-mixed"
    autocast_dtype = torch.bfloat16

    def autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device_type, dtype=torch.bfloat16)


class FP16Mixed(Precision):
    name = "fp16-mixed"
    autocast_dtype = torch.float16
    scales_loss = True

    def __init__(self, device_type: str, init_scale: float = 65536.0,
                 growth_interval: int = 2000) -> None:
        super().__init__(device_type)
        self.scaler = torch.amp.GradScaler(device_type, init_scale=init_scale,
                                           growth_interval=growth_interval)

    def autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device_type, dtype=torch.float16)

    def backward(self, loss: torch.Tensor, inputs: Any = None,
                 retain_graph: bool | None = None, create_graph: bool = False) -> None:
        self.scaler.scale(loss).backward(inputs=inputs, retain_graph=retain_graph,
                                         create_graph=create_graph)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale ``optimizer``'s gradients, once between its steps (the scaler's own
        record says whether it was: a clip and the step may both ask)."""
        if self.scaler._per_optimizer_states[id(optimizer)]["stage"] is not OptState.UNSCALED:
            self.scaler.unscale_(optimizer)

    def forget_unscale(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler._per_optimizer_states.pop(id(optimizer), None)  # READY again

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        # HOST SYNC unless the optimizer is fused: GradScaler.step reads the found-inf
        # flag to decide whether to skip the step (a fused AdamW takes the flag on the
        # device instead). bf16 needs no scaler and has no such sync.
        self.scaler.step(optimizer)
        self.scaler.update()

    def backoff(self) -> float:
        """The step is skipped on every rank: lower the scale as an overflow would (the
        same on every rank, whatever each one's own gradients held). Returns the scale."""
        scale = self.scaler.get_scale() * self.scaler.get_backoff_factor()
        self.scaler.update(scale)
        return scale

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])


_MODES = {"fp32": Precision, "bf16-mixed": BF16Mixed, "fp16-mixed": FP16Mixed}


def build_precision(mode: str, device_type: str,
                    cfg: PrecisionConfig | None = None) -> Precision:
    """Make the precision object for a resolved ``precision.mode``."""
    if mode not in _MODES:
        raise ConfigError(unknown_choice("precision.mode", mode, _MODES))
    if mode == "fp16-mixed":
        cfg = cfg or PrecisionConfig()
        return FP16Mixed(device_type, cfg.init_scale, cfg.growth_interval)
    return _MODES[mode](device_type)
