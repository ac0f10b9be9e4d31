"""Optimizer and learning-rate schedule from the ``[optim]`` section."""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from torch import nn

from gpufleet.config import OptimConfig
from gpufleet.parallel import OptimizerSpec


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices (embeddings, linear weights), none on biases and norms.

    A model may define ``param_groups(weight_decay)`` itself; it is used when present.
    """
    own = getattr(model, "param_groups", None)
    if callable(own):
        return own(weight_decay)
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def optimizer_spec(cfg: OptimConfig, device_type: str) -> OptimizerSpec:
    """What to build; the strategy builds it (sharded strategies need the class)."""
    if cfg.name == "adamw":
        kwargs: dict[str, Any] = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2)}
        cls: type[torch.optim.Optimizer] = torch.optim.AdamW
    else:
        kwargs = {"lr": cfg.lr, "momentum": cfg.momentum}
        cls = torch.optim.SGD
    # The fused kernel does the whole update in one launch per parameter group, and
    # takes the non-finite flag on the device (gpufleet.fault.nonfinite): no host sync.
    if _has_fused(cls, device_type):
        kwargs["fused"] = True
    return OptimizerSpec(cls, lambda m: param_groups(m, cfg.weight_decay), kwargs,
                         accumulation=cfg.grad_accum)


def _has_fused(cls: type[torch.optim.Optimizer], device_type: str) -> bool:
    """Whether torch has a fused ``cls`` kernel for ``device_type``."""
    if "fused" not in inspect.signature(cls).parameters:
        return False
    try:
        from torch.optim.optimizer import _get_fused_kernels_supported_devices
    except ImportError:  # older torch: fused on CUDA only
        return device_type == "cuda"
    return device_type in _get_fused_kernels_supported_devices()


def lr_factor(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Multiplier on ``cfg.lr`` for optimizer step ``step`` (0-based).

    Linear warm-up from lr/warmup to lr over ``warmup_steps``, then cosine or linear
    decay to ``min_lr_ratio * lr`` at ``max_steps``.

    Example:
        >>> cfg = OptimConfig(warmup_steps=10, decay="cosine", min_lr_ratio=0.1)
        >>> lr_factor(4, cfg, 100), round(lr_factor(99, cfg, 100), 3)
        (0.5, 0.1)
    """
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.decay == "constant":
        return 1.0
    span = max(1, max_steps - 1 - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.decay == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        shape = 1.0 - progress
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig,
                    max_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` over :func:`lr_factor`, stepped once per optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, cfg, max_steps))
