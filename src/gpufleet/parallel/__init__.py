"""Parallel strategies behind one interface, looked up by name.

Example:
    >>> from gpufleet.parallel import strategy_names
    >>> strategy_names()  # doctest: +NORMALIZE_WHITESPACE
    ['single', 'dp', 'ddp', 'pipeline', 'local_sgd', 'model_parallel', 'horovod', 'fsdp', 'zero1',
     'hsdp']
"""

from __future__ import annotations

import torch

from gpufleet.errors import ConfigError, unknown_choice
from gpufleet.parallel.base import OptimizerSpec, Strategy
from gpufleet.parallel.dims import ParallelDims

__all__ = ["OptimizerSpec", "ParallelDims", "Strategy", "build_strategy", "register",
           "strategy_class", "strategy_names"]

_REGISTRY: dict[str, type[Strategy]] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    """Add a strategy class to the registry under ``cls.name`` (usable as a decorator)."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"strategy name {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls
    return cls


def strategy_names() -> list[str]:
    """The registered strategy names, in registration order."""
    return list(_REGISTRY)


def strategy_class(name: str) -> type[Strategy]:
    """The class registered as ``name`` (its ``traits`` say what it asks of a run)."""
    if name not in _REGISTRY:
        raise ConfigError(unknown_choice("parallel.strategy", name, _REGISTRY))
    return _REGISTRY[name]


def build_strategy(name: str, cfg, device: torch.device, precision=None,
                   dims: ParallelDims | None = None) -> Strategy:
    """Make the strategy called ``name`` for ``device`` over the mesh degrees ``dims``.

    A name is a preset: ``ddp`` over a tensor parallel split (``dims.tp > 1``) keeps its
    replicas in step with FSDP2 over the replicate dimension (torch's DDP cannot hold
    the split's DTensor parameters), with the step and state hooks that go with it.
    """
    cls = strategy_class(name)
    if dims is not None and dims.tp > 1 and cls.traits.tp_by_replicate_mesh:
        from gpufleet.parallel.fsdp import ReplicatedTensorParallel

        cls = ReplicatedTensorParallel
    return cls(cfg, device, precision, dims)


def _register_builtins() -> None:
    from gpufleet.parallel.ddp import DistributedDataParallel
    from gpufleet.parallel.dp import DataParallel
    from gpufleet.parallel.fsdp import FullyShardedDataParallel, HybridShardedDataParallel
    from gpufleet.parallel.horovod import Horovod
    from gpufleet.parallel.local_sgd import LocalSGD
    from gpufleet.parallel.model_parallel import ModelParallel
    from gpufleet.parallel.pipeline import PipelineParallel
    from gpufleet.parallel.single import SingleDevice
    from gpufleet.parallel.zero import ZeroRedundancy

    for cls in (SingleDevice, DataParallel, DistributedDataParallel, PipelineParallel,
                LocalSGD, ModelParallel, Horovod, FullyShardedDataParallel, ZeroRedundancy,
                HybridShardedDataParallel):
        register(cls)


_register_builtins()
