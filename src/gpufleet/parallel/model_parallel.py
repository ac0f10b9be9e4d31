"""``model_parallel``: one process, the model's layers placed on devices by a map.

The simplest way to fit a model that outgrows one GPU: ``[parallel] device_map`` maps
module-name prefixes to devices, e.g. ``{encoder = "cuda:0", decoder = "cuda:1"}``. Each
mapped module (and everything inside it) moves to its device; modules the map does not
name stay on the run's device (``cuda:0``, or the CPU). A longer prefix wins over a
shorter one. A forward pre-hook on each mapped module moves its tensor inputs to its
device, and a hook on the whole model brings the output back to the run's device,
where the batch and the loss live. Only one device computes at a time (no pipelining);
the ``pipeline`` strategy overlaps the devices with micro-batches. On several ranks
each rank places its replica so and torch's DDP keeps the replicas in step.

Example:
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(2, 4), nn.Linear(4, 1))
    >>> placement(place_by_device_map(net, {"1": "cpu"}, torch.device("cpu")))
    {'0': 'cpu', '1': 'cpu'}
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gpufleet.core.tree import map_tensors
from gpufleet.errors import ConfigError, did_you_mean
from gpufleet.parallel.base import Strategy
from gpufleet.parallel.dims import StrategyTraits

log = logging.getLogger(__name__)


class ModelParallel(Strategy):
    """One process, the model's modules on devices by ``parallel.device_map`` (placed by
    :func:`gpufleet.parallel.parallelize.parallelize` through
    :func:`place_by_device_map`)."""

    name = "model_parallel"
    traits = StrategyTraits(device_map=True)

    # On several ranks the placed model is replicated by torch's DDP (parallelize's
    # data parallel step, after the device map): its prefix and its gradient sync.
    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DDP) else model

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return model.no_sync() if isinstance(model, DDP) else contextlib.nullcontext()

    def describe(self) -> dict[str, Any]:
        """The device map, for the run's report."""
        return {"strategy": self.name, "device_map": dict(self.cfg.device_map)}


def place_by_device_map(model: nn.Module, device_map: dict[str, Any],
                        device: torch.device) -> nn.Module:
    """Move each module ``device_map`` names to its device (the rest to ``device``), with
    hooks that move inputs in and the output back to ``device``; returns ``model``."""
    plan = resolve_device_map(model, device_map)
    model.to(device)  # unmapped modules: the run's device
    for name, where in plan.items():  # shortest prefix first: longer ones override
        module = model.get_submodule(name)
        module.to(where)
        module.register_forward_pre_hook(_move_inputs(where), with_kwargs=True)
    model.register_forward_hook(_move_output(device))
    log.info("model_parallel: %s (the rest on %s)",
             ", ".join(f"{n or '<model>'} -> {d}" for n, d in plan.items()), device)
    return model


def resolve_device_map(model: nn.Module, device_map: dict[str, Any]) -> dict[str, torch.device]:
    """Check ``device_map`` against ``model``; ``{module name: device}``, shortest first.

    Raises:
        ConfigError: the map is empty, names no module of the model, or a device that
            does not exist here.

    Example:
        >>> resolve_device_map(nn.Sequential(nn.Linear(1, 1)), {"0": "cpu"})
        {'0': device(type='cpu')}
    """
    if not device_map:
        raise ConfigError("parallel.strategy = 'model_parallel' needs parallel.device_map, "
                          "e.g. --parallel.device_map='{encoder = \"cuda:0\", decoder = "
                          "\"cuda:1\"}' (module name prefix -> device).")
    names = [n for n, _ in model.named_modules() if n]
    plan: dict[str, torch.device] = {}
    for prefix, where in sorted(device_map.items(), key=lambda item: item[0].count(".")):
        if prefix not in names:
            guess = did_you_mean(prefix, names)
            hint = f" Did you mean {guess!r}?" if guess else ""
            top = [n for n in names if "." not in n]
            raise ConfigError(f"parallel.device_map: the model has no module {prefix!r}."
                              f"{hint} Top-level modules: {', '.join(top)}.")
        plan[prefix] = _device(str(where), prefix)
    return plan


def _device(text: str, prefix: str) -> torch.device:
    try:
        device = torch.device(text)
    except RuntimeError as e:
        raise ConfigError(f"parallel.device_map[{prefix!r}] = {text!r} is not a device "
                          "(e.g. 'cuda:1' or 'cpu').") from e
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = 0 if device.index is None else device.index
        if index >= count:
            raise ConfigError(f"parallel.device_map[{prefix!r}] = {text!r}: this machine has "
                              f"{count} visible CUDA device(s). Use cuda:0..cuda:{count - 1}"
                              if count else
                              f"parallel.device_map[{prefix!r}] = {text!r}: this machine has "
                              "no CUDA device. Map to 'cpu', or run where the GPUs are.")
    return device


def _move_inputs(device: torch.device) -> Any:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return map_tensors(args, move), map_tensors(kwargs, move)

    return hook


def _move_output(device: torch.device) -> Any:
    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        return map_tensors(output, lambda t: t.to(device, non_blocking=True))

    return hook


def placement(model: nn.Module) -> dict[str, str]:
    """``{module name: device}`` of each direct child's first parameter (for reports).

    Example:
        >>> placement(nn.Sequential(nn.Linear(1, 1), nn.ReLU()))
        {'0': 'cpu', '1': '-'}
    """
    out = {}
    for name, child in model.named_children():
        param = next(child.parameters(), None)
        out[name] = str(param.device) if param is not None else "-"
    return out
