"""Optimizer and learning-rate schedule from the ``[optim]`` section."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
from typing import Any

import torch
from torch import nn

from gpufleet.config import OptimConfig
from gpufleet.config.schema import AUTO
from gpufleet.parallel import OptimizerSpec

log = logging.getLogger(__name__)


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


# (lr, weight_decay, beta2) by kind of model, for the optimizer settings left at -1.
DEFAULTS: dict[str, tuple[float, float, float]] = {
    "gpt": (3e-3, 0.1, 0.95),  # the built-in GPT: nanoGPT-style pre-training
    "transformers": (5e-5, 0.0, 0.999),  # Transformers Trainer's fine-tuning defaults
    "model": (1e-3, 0.01, 0.999),  # torch.optim.AdamW's defaults
    "sgd": (0.1, 1e-4, 0.999),  # torchvision's classification reference recipe
}


def model_kind(model: nn.Module) -> str:
    """``gpt`` (gpufleet's GPT), ``transformers`` (a PreTrainedModel) or ``model``."""
    from gpufleet.models.gpt import GPT

    if isinstance(model, GPT):
        return "gpt"
    if any(c.__module__.startswith("transformers.") and c.__name__ == "PreTrainedModel"
           for c in type(model).__mro__):
        return "transformers"
    return "model"


def fill_optimizer_defaults(cfg: OptimConfig, model: nn.Module) -> OptimConfig:
    """``cfg`` with the settings left at -1 (lr, weight_decay, beta2) set for ``model``.

    Example:
        >>> fill_optimizer_defaults(OptimConfig(), nn.Linear(2, 2)).lr
        0.001
    """
    kind = "sgd" if cfg.name == "sgd" else model_kind(model)
    lr, decay, beta2 = DEFAULTS[kind]
    chosen = {key: value for key, value in
              (("lr", lr), ("weight_decay", decay), ("beta2", beta2))
              if getattr(cfg, key) == AUTO}
    if not chosen:
        return cfg
    words = {"gpt": "the built-in GPT", "transformers": "a Transformers model",
             "model": "your model (torch's AdamW defaults)", "sgd": "sgd"}
    log.info("optimizer defaults for %s: %s (set optim.<key> to change)", words[kind],
             ", ".join(f"{k}={v:g}" for k, v in chosen.items()))
    return dataclasses.replace(cfg, **chosen)


def optimizer_spec(cfg: OptimConfig, device_type: str) -> OptimizerSpec:
    """What to build; the strategy builds it (sharded strategies need the class).
    ``cfg`` has its defaults filled (:func:`fill_optimizer_defaults`)."""
    if AUTO in (cfg.lr, cfg.weight_decay, cfg.beta2):
        raise ValueError("optimizer_spec needs concrete settings: call "
                         "fill_optimizer_defaults(cfg, model) first")
    if cfg.name == "adamw":
        kwargs: dict[str, Any] = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2)}
        cls: type[torch.optim.Optimizer] = torch.optim.AdamW
    else:
        kwargs = {"lr": cfg.lr, "momentum": cfg.momentum}
        cls = torch.optim.SGD
    # The fused kernel does the whole update in one launch per parameter group, and
    # takes the non-finite flag on the device (gpufleet.train.nonfinite): no host sync.
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
