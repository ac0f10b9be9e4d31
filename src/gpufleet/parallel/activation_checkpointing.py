"""Activation checkpointing and SyncBatchNorm: layer options applied before any strategy.

Both are plain functions that change the user's model in place and keep its state-dict
names, so checkpoints load with or without them. The trainer applies them in
``_build_model`` (``[parallel] activation_checkpointing`` and ``sync_batchnorm``), before
``torch.compile`` and before the strategy wraps or splits the model.

Activation checkpointing uses ``torch.utils.checkpoint`` in its non-reentrant form: a
checkpointed module keeps only its inputs in forward and runs its forward a second time
during backward to rebuild the activations. Run as is, that second forward would update
the running statistics of every BatchNorm inside it a second time (and count
``num_batches_tracked`` twice), so the statistics would drift from a run without
checkpointing. Here the BatchNorm buffers are saved before the recomputation and put
back after it: the recomputation uses the same batch statistics (training mode) and
leaves the running statistics exactly as the first forward left them.

Example:
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    >>> apply_activation_checkpointing(net, "BatchNorm1d")
    ['1']
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from gpufleet.errors import ConfigError

log = logging.getLogger(__name__)

_MARK = "_gpufleet_checkpointed"


def apply_activation_checkpointing(model: nn.Module, spec: str) -> list[str]:
    """Recompute the activations of the modules ``spec`` names during backward.

    Args:
        model: the model; changed in place (its state-dict names stay the same).
        spec: ``""`` (off), comma-separated module class names (``"Block,MLP"``), or
            ``"every:K"``: every K-th block (0, K, 2K, ...) of the model's blocks,
            found as :func:`gpufleet.parallel.blocks.find_blocks` says (the rule FSDP's
            ``auto`` wrapping uses too).

    Returns:
        The qualified names of the modules now checkpointed.

    Raises:
        ConfigError: the spec is malformed or names nothing in the model.

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> apply_activation_checkpointing(net, "Linear")
        ['0']
    """
    spec = spec.strip()
    if not spec:
        return []
    names = _every_k(model, spec) if spec.startswith("every:") else _by_class(model, spec)
    modules = dict(model.named_modules())
    for name in names:
        checkpoint_module(modules[name])
    from gpufleet.parallel.blocks import describe_blocks

    log.info("activation checkpointing (%s) on %s", spec, describe_blocks(model, names))
    return names


def checkpoint_module(module: nn.Module) -> nn.Module:
    """Make ``module``'s forward non-reentrant-checkpointed and BatchNorm-safe (in place).

    Example:
        >>> m = checkpoint_module(nn.Linear(2, 2))
        >>> m(torch.ones(1, 2, requires_grad=True)).shape
        torch.Size([1, 2])
    """
    if getattr(module, _MARK, False):
        return module
    forward = module.forward  # the bound method of the class (or an earlier patch)
    # An instance attribute wins over the class's forward; parameters, buffers and
    # state-dict names are untouched.
    module.forward = functools.partial(_checkpointed_forward, module, forward)
    setattr(module, _MARK, True)
    return module


def _checkpointed_forward(module: nn.Module, forward: Callable[..., Any], *args: Any,
                          **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():  # evaluation: nothing to save, nothing to recompute
        return forward(*args, **kwargs)
    calls = [0]

    def run(*a: Any, **k: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:  # the real forward
            return forward(*a, **k)
        with _keep_batchnorm_stats(module):  # the recomputation inside backward
            return forward(*a, **k)

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, **kwargs)


class _keep_batchnorm_stats:
    """Save the running statistics of the BatchNorm layers in ``module`` and restore them
    on exit, so a recomputed forward leaves them as the first forward did."""

    def __init__(self, module: nn.Module) -> None:
        self.norms = [m for m in module.modules()
                      if isinstance(m, _BatchNorm) and m.training and m.track_running_stats]
        self.saved: list[list[torch.Tensor]] = []

    def __enter__(self) -> None:
        self.saved = [[b.clone() for b in _stats(m)] for m in self.norms]

    def __exit__(self, *exc: object) -> None:
        with torch.no_grad():
            for m, saved in zip(self.norms, self.saved, strict=True):
                for buf, old in zip(_stats(m), saved, strict=True):
                    buf.copy_(old)


def _stats(norm: _BatchNorm) -> list[torch.Tensor]:
    return [b for b in (norm.running_mean, norm.running_var, norm.num_batches_tracked)
            if b is not None]


def _by_class(model: nn.Module, spec: str) -> list[str]:
    wanted = [c.strip() for c in spec.split(",") if c.strip()]
    present = {type(m).__name__ for m in model.modules()}
    missing = [c for c in wanted if c not in present]
    if missing:
        from gpufleet.errors import closest_first

        raise ConfigError(
            f"parallel.activation_checkpointing = {spec!r}: the model has no module of "
            f"class {', '.join(map(repr, missing))}. Classes in the model (closest first): "
            f"{', '.join(closest_first(missing[0], sorted(present))[:12])}. Name one of "
            "them, or use 'every:K' for every K-th block.")
    names: list[str] = []
    for name, m in model.named_modules():
        if type(m).__name__ in wanted and not any(name.startswith(p + ".") for p in names):
            names.append(name)  # outermost only: a checkpoint inside a checkpoint is waste
    return names


def _every_k(model: nn.Module, spec: str) -> list[str]:
    k_text = spec.partition(":")[2].strip()
    if not k_text.isdigit() or int(k_text) < 1:
        raise ConfigError(f"parallel.activation_checkpointing = {spec!r}: K must be a whole "
                          "number >= 1, e.g. 'every:2' (every second block).")
    from gpufleet.parallel.blocks import find_blocks

    blocks = find_blocks(model)
    if not blocks:
        raise ConfigError(f"parallel.activation_checkpointing = {spec!r}: the model has no "
                          "blocks (a module repeated inside an nn.ModuleList or "
                          "nn.Sequential) to pick from. Name the block class instead "
                          "(e.g. 'Block').")
    return blocks[::int(k_text)]


def convert_sync_batchnorm(model: nn.Module) -> nn.Module:
    """Replace every BatchNorm layer with ``nn.SyncBatchNorm`` (statistics over all ranks).

    Parameters, buffers and their names carry over, so checkpoints stay compatible.
    Without a process group SyncBatchNorm behaves like BatchNorm. With one, it needs
    the inputs on a GPU.

    Example:
        >>> net = convert_sync_batchnorm(nn.Sequential(nn.Conv2d(1, 2, 1), nn.BatchNorm2d(2)))
        >>> type(net[1]).__name__
        'SyncBatchNorm'
    """
    converted = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    count = sum(isinstance(m, nn.SyncBatchNorm) for m in converted.modules())
    if count == 0:
        log.warning("parallel.sync_batchnorm is on, but the model has no BatchNorm layer")
    else:
        log.info("converted %d BatchNorm layer(s) to SyncBatchNorm", count)
    return converted


def apply_layer_options(model: nn.Module, cfg: Any, device: torch.device,
                        world_size: int) -> nn.Module:
    """Apply ``[parallel] sync_batchnorm`` and ``activation_checkpointing`` to ``model``.

    Args:
        model: the user's model.
        cfg: the ``[parallel]`` section.
        device: this rank's device (SyncBatchNorm across ranks needs a GPU).
        world_size: ranks in the job.

    Example:
        >>> from gpufleet.config import ParallelConfig
        >>> net = apply_layer_options(nn.Linear(2, 2), ParallelConfig(), torch.device("cpu"), 1)
    """
    if cfg.sync_batchnorm:
        if world_size > 1 and device.type == "cpu":
            raise ConfigError(
                "parallel.sync_batchnorm = true needs GPUs: torch's SyncBatchNorm does not "
                f"run on CPU tensors, and this run has {world_size} CPU ranks. Turn it off "
                "(--parallel.sync_batchnorm=false) or train on GPUs.")
        model = convert_sync_batchnorm(model)
    apply_activation_checkpointing(model, cfg.activation_checkpointing)
    return model
