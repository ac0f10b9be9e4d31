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
from gpufleet.models import model_preset
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


#: What each preset fills in for the settings left at -1/auto.
PRESET_VALUES: dict[str, dict[str, Any]] = {
    # The optimizer exactly as torch builds it (lr 1e-3), nothing around it.
    "none": {"lr": 1e-3, "weight_decay": 0.0, "beta2": 0.999, "momentum": 0.0,
             "clip_norm": 0.0, "warmup_steps": 0, "decay": "constant", "min_lr_ratio": 0.0},
    # nanoGPT-style pre-training of the built-in GPT.
    "gpt": {"lr": 3e-3, "weight_decay": 0.1, "beta2": 0.95, "momentum": 0.9,
            "clip_norm": 1.0, "warmup_steps": 20, "decay": "cosine", "min_lr_ratio": 0.1},
    # The Transformers Trainer's fine-tuning defaults (max_grad_norm 1, linear decay to 0).
    "transformers": {"lr": 5e-5, "weight_decay": 0.0, "beta2": 0.999, "momentum": 0.0,
                     "clip_norm": 1.0, "warmup_steps": 0, "decay": "linear",
                     "min_lr_ratio": 0.0},
}


def fill_optimizer_defaults(cfg: OptimConfig, model: nn.Module) -> OptimConfig:
    """``cfg`` with its preset decided (``auto``: by the kind of ``model``) and every
    setting left at -1/auto taken from that preset; what the user set stays.

    Example:
        >>> filled = fill_optimizer_defaults(OptimConfig(), nn.Linear(2, 2))
        >>> filled.preset, filled.lr, filled.clip_norm, filled.warmup_steps, filled.decay
        ('none', 0.001, 0.0, 0, 'constant')
    """
    preset = cfg.preset
    if preset == "auto":
        preset = model_preset(model)
    values = PRESET_VALUES[preset]
    chosen = {key: value for key, value in values.items()
              if getattr(cfg, key) in (AUTO, -1, "auto")}
    return dataclasses.replace(cfg, preset=preset, **chosen)


def optimizer_spec(cfg: OptimConfig, device_type: str) -> OptimizerSpec:
    """What to build; the strategy builds it (sharded strategies need the class).
    ``cfg`` has its defaults filled (:func:`fill_optimizer_defaults`)."""
    if cfg.preset == "auto":
        raise ValueError("optimizer_spec needs concrete settings: call "
                         "fill_optimizer_defaults(cfg, model) first")
    if cfg.name == "adamw":
        kwargs: dict[str, Any] = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2)}
        cls: type[torch.optim.Optimizer] = torch.optim.AdamW
    else:
        kwargs = {"lr": cfg.lr, "momentum": cfg.momentum}
        cls = torch.optim.SGD
    # The fused kernel does the whole update in one launch per parameter group, and
    # takes the non-finite flag on the device (gpufleet.train.guard.nonfinite): no host sync.
    if _has_fused(cls, device_type):
        kwargs["fused"] = True
    if cfg.preset == "none":  # as torch does it: one group, decay on every parameter
        kwargs["weight_decay"] = cfg.weight_decay
        groups: Any = lambda m: [{"params": [p for p in m.parameters() if p.requires_grad]}]  # noqa: E731
    else:  # the presets decay matrices only (the model's own param_groups when it has one)
        groups = lambda m: param_groups(m, cfg.weight_decay)  # noqa: E731
    return OptimizerSpec(cls, groups, kwargs, accumulation=cfg.grad_accum)


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
    """A ``LambdaLR`` over :func:`lr_factor`, stepped once per optimizer step (a
    :class:`ConstantSchedule` when the factor is always 1: no warm-up, no decay)."""
    if not cfg.warmup_steps and cfg.decay == "constant":
        return ConstantSchedule(optimizer, lambda step: 1.0)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, cfg, max_steps))


class ConstantSchedule(torch.optim.lr_scheduler.LambdaLR):
    """``LambdaLR`` at a factor of 1.0 whose steps only count.

    Every step of it would set each group's learning rate to the rate already set, so a
    step adds one to its step counters and leaves the rates alone: a few attribute
    writes instead of torch's per-step recomputation (about 10 µs of CPU per optimizer
    step). Its state (``last_epoch``, the base and last rates) is ``LambdaLR``'s, so
    checkpoints written with either load into the other.

    Example:
        >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        >>> sched = ConstantSchedule(opt, lambda step: 1.0)
        >>> sched.step(); sched.step()
        >>> sched.last_epoch, sched.get_last_lr()
        (2, [0.1])
    """

    def step(self, epoch: int | None = None) -> None:
        if epoch is not None or not self._step_count:  # the constructor's own step
            super().step(epoch)
            return
        self._step_count += 1
        self.last_epoch += 1


def describe_schedule(cfg: OptimConfig) -> str:
    """The built-in schedule in words, e.g. ``warm-up 20 steps, cosine to 0.1 x lr``."""
    warm = f"warm-up {cfg.warmup_steps} steps, " if cfg.warmup_steps else ""
    if cfg.decay == "constant":
        return f"{warm}constant lr"
    return f"{warm}{cfg.decay} decay to {cfg.min_lr_ratio:g} x lr"
