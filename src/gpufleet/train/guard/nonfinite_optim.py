"""What the non-finite guard (:mod:`gpufleet.train.guard.nonfinite`) needs of the optimizer and
of torch's fused check: whether the optimizer skips a step on a device flag, its momentum
made safe to skip, and values the check's kernel takes."""

from __future__ import annotations

from typing import Any

import torch


def takes_found_inf(optimizer: Any, precision: Any) -> bool:
    """Whether ``optimizer`` can skip a step on a device flag (a fused torch optimizer,
    no loss scaler deciding on its own)."""
    if precision.scales_loss or not isinstance(optimizer, torch.optim.Optimizer):
        return False
    if dampened_momentum(optimizer):
        return False  # see prime_momentum
    return bool(optimizer.defaults.get("fused")) and \
        getattr(optimizer, "_step_supports_amp_scaling", False)


def dampened_momentum(optimizer: Any) -> bool:
    """SGD momentum with dampening: a flagged step cannot be skipped on the device."""
    return any(g.get("momentum") and g.get("dampening") for g in optimizer.param_groups)


def prime_momentum(optimizer: torch.optim.Optimizer) -> None:
    """Zero momentum buffers for SGD before its first step.

    Fused SGD allocates them uninitialised on its first step and fills them from the
    gradient, which a flagged step does not do. Starting from zeros, the first update
    (``buf = momentum * 0 + grad``, without dampening) is the same, and a skipped one
    leaves clean zeros.
    """
    for group in optimizer.param_groups:
        if not group.get("momentum") or "dampening" not in group:
            continue
        for p in group["params"]:
            state = optimizer.state[p]
            if state.get("momentum_buffer") is None:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def norms_on(values: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Each value's float32 norm on ``device``: not finite exactly where the value is not
    (a sum of squares in float32 overflows only past 1e19 a value)."""
    return [n.float().to(device) for n in torch._foreach_norm(values)]
