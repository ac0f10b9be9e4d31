"""Every model transform of a run, applied in one order, each gated on its degree.

:func:`parallelize` is the one place a model changes between the user's module and
the module the loop calls. The order is fixed, and each step runs only when the plan
(:class:`~gpufleet.parallel.dims.ParallelDims`) or the config asks for it::

    1. tensor parallel      tp > 1: the model's tp_plan(tp_mesh), or the built-in GPT's
                            (rank 0's weights first reach every rank, then the split)
    2. layer options        parallel.sync_batchnorm, parallel.activation_checkpointing
    3. memory format and    perf.channels_last, perf.compile (in place: the state-dict
       compilation          names stay), block by block (perf.compile_scope)
    4. data parallel        dp_shard > 1: FSDP (HSDP with dp_replicate > 1 too);
                            dp_replicate > 1: DDP replication (over the tensor parallel
                            split: FSDP2 over a replicate-only mesh, which all-reduces
                            gradients as DDP does)
    5. the pipeline split   pp > 1: this rank keeps its stage (then steps 4's sharding
                            over the stage)

Steps 4 and 5 are the strategy's :meth:`~gpufleet.parallel.base.Strategy.setup_model`:
the strategy name is a preset of degrees (``ddp`` puts the ranks on ``dp_replicate``,
``fsdp`` on ``dp_shard``, ``pipeline`` on ``pp``) plus the step-time and state hooks
that go with them. The mesh is built once per run, by the strategy
(:attr:`Strategy.mesh`), and sliced by name (``mesh["tp"]``,
``mesh["dp_replicate", "dp_shard"]``).

Example:
    >>> # gpufleet train --nproc 8 --strategy ddp --parallel.tp 4   (DDP 2 x TP 4)
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gpufleet.config import PerfConfig
from gpufleet.parallel.activation_checkpointing import apply_layer_options
from gpufleet.parallel.blocks import describe_blocks, find_blocks
from gpufleet.parallel.tensor import apply_tensor_parallel

log = logging.getLogger(__name__)


def parallelize(model: nn.Module, strategy: Any, cfg: Any, world_size: int) -> nn.Module:
    """``model`` as the loop calls it: split, wrapped and compiled as the run's plan says.

    Args:
        model: the user's module (any device).
        strategy: the run's strategy; its ``dims`` are the mesh degrees, its ``mesh``
            the one DeviceMesh, its ``setup_model`` steps 4 and 5 (see the module doc).
        cfg: the run's config (its ``parallel`` and ``perf`` sections are read).
        world_size: ranks in the job.

    Returns:
        The module to train. COLLECTIVE when the run has several ranks.
    """
    device, dims = strategy.device, strategy.dims
    if dims.tp > 1:
        model = model.to(device)
        broadcast_weights(model)  # before the split: every slice comes from one model
        apply_tensor_parallel(model, strategy.mesh["tp"])
    # SyncBatchNorm and activation checkpointing change layers in place (same
    # state-dict names), before compilation and before the model is wrapped.
    model = apply_layer_options(model, cfg.parallel, device, world_size)
    model = compile_model(model, cfg.perf)
    return strategy.setup_model(model)


def broadcast_weights(model: nn.Module) -> None:
    """Rank 0's parameters and buffers to every rank (COLLECTIVE; nothing alone)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor.detach(), src=0)


def compile_model(model: nn.Module, perf: PerfConfig) -> nn.Module:
    """Memory format and compilation, before the model is wrapped.

    ``nn.Module.compile`` compiles in place: each module keeps its class and its
    state-dict names, so checkpoints load with or without compilation, and DDP or FSDP
    wrap the compiled module as they would any other. With ``perf.compile_scope =
    "blocks"`` each of the model's blocks (:func:`gpufleet.parallel.blocks.find_blocks`,
    the units FSDP shards one by one) is compiled on its own: one small graph that the
    blocks share once it is compiled, and FSDP's per-block hooks sit between graphs
    instead of breaking one.
    """
    if perf.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if not perf.compile:
        return model
    mode = None if perf.compile_mode == "default" else perf.compile_mode
    blocks = find_blocks(model) if perf.compile_scope == "blocks" else []
    if blocks:
        modules = dict(model.named_modules())
        for name in blocks:
            modules[name].compile(mode=mode)
        scope = f"each block ({describe_blocks(model, blocks)})"
    else:
        model.compile(mode=mode)
        scope = "the whole model"
    log.info("torch.compile (mode %s) of %s; the first steps are slow while it compiles",
             perf.compile_mode, scope)
    return model
