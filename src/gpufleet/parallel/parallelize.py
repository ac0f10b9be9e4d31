"""Every model transform of a run, applied in one order, each gated on its degree.

:func:`parallelize` is the one place a model changes between the user's module and
the module the loop calls. The order is fixed, and each step runs only when the plan
(:class:`~gpufleet.parallel.dims.ParallelDims`), the config or the strategy's preset
(:class:`~gpufleet.parallel.dims.StrategyTraits`) asks for it::

    1. tensor parallel      tp > 1: the model's tp_plan(tp_mesh), or the built-in GPT's
                            (rank 0's weights first reach every rank, then the split)
    2. layer options        parallel.sync_batchnorm, parallel.activation_checkpointing
    3. memory format and    perf.channels_last, perf.compile (in place: the state-dict
       compilation          names stay), by blocks or whole (compile_scope)
    4. the pipeline split   pp > 1 (or a pipelined preset): this rank keeps its stage
                            (pipeline_split.keep_stage); steps 5 to 7 then apply to it
    5. device map           a device_map preset (model_parallel): modules placed by
                            parallel.device_map, before data parallelism, so that DDP
                            replicates the placed model (its names and hooks as yours)
    6. data parallel        data_parallel.data_parallel_kind decides, by the degrees and
                            the preset's traits.data_parallel (which holds at degree 1):
                            FSDP2 when dp_shard > 1 or the preset shards (HSDP with
                            dp_replicate > 1 too), and for replicas of a tensor parallel
                            split or of a pipeline stage (a replicate-only mesh, which
                            all-reduces gradients as DDP does); torch's DDP for other
                            replicas (dp_replicate > 1 or a replicating preset);
                            nn.DataParallel for a one-process threads preset
    7. the strategy's hook  Strategy.attach(model, stage): step-time machinery that
                            must hold the final module (the pipeline schedule,
                            local_sgd's communication hook and averager)

The split comes before data parallelism, so each rank shards (or replicates) only the
layers it keeps. The strategy name is a preset
of degrees (``ddp`` puts the ranks on ``dp_replicate``, ``fsdp`` on ``dp_shard``,
``pipeline`` on ``pp``) plus the step-time and state hooks that go with them. The mesh
is built once per run (:attr:`Strategy.mesh`) and sliced by name (``mesh["tp"]``,
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
from gpufleet.parallel.base import Strategy
from gpufleet.parallel.blocks import describe_blocks, find_blocks
from gpufleet.parallel.data_parallel import (
    data_parallel_kind,
    replicate,
    replicate_in_threads,
    shard,
)
from gpufleet.parallel.model_parallel import place_by_device_map
from gpufleet.parallel.pipeline_split import StageSplit, check_pipelinable, keep_stage
from gpufleet.parallel.tensor import apply_tensor_parallel

log = logging.getLogger(__name__)


def parallelize(model: nn.Module, strategy: Strategy, cfg: Any, world_size: int) -> nn.Module:
    """``model`` as the loop calls it: split, wrapped and compiled as the run's plan says.

    Args:
        model: the user's module (any device).
        strategy: the run's strategy; its ``dims`` are the mesh degrees, its ``mesh``
            the one DeviceMesh, its ``traits`` the preset (see the module doc).
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
    model = compile_model(model, cfg.perf, compile_scope(cfg.perf, strategy))
    return distribute(model, strategy)


def compile_scope(perf: PerfConfig, strategy: Strategy) -> str:
    """``perf.compile_scope`` with ``auto`` decided: ``blocks`` when the strategy works
    on the model block by block (FSDP's per-block hooks, a tensor-parallel split, pipeline
    stages, modules placed on several devices), where one whole-model graph would break
    at every block or be split apart; else ``model``: one graph fuses across the blocks
    and the loss head too. On an H200, GPT-2-124M bf16 took 40.0 ms a step in gpufleet
    compiled block by block and 33.9 ms in a hand-written loop compiled whole
    (``benchmarks/mfu.py``); gpufleet compiled whole is not measured yet."""
    if perf.compile_scope != "auto":
        return perf.compile_scope
    dims, traits = strategy.dims, strategy.traits
    pipelined = dims.pp > 1 or traits.pipelined
    by_blocks = (pipelined or traits.device_map  # a model over several devices
                 or data_parallel_kind(traits, dims, pipelined) == "shard")
    return "blocks" if by_blocks else "model"


def distribute(model: nn.Module, strategy: Strategy) -> nn.Module:
    """Steps 4 to 7 (see the module doc): the pipeline split, the device map, data
    parallelism and the strategy's :meth:`~Strategy.attach`, with the strategy's
    ``[parallel]`` options. Returns the module the loop calls. COLLECTIVE when the run
    has several ranks.

    Example:
        >>> from gpufleet.config import ParallelConfig
        >>> from gpufleet.parallel import build_strategy
        >>> single = build_strategy("single", ParallelConfig(), torch.device("cpu"))
        >>> distribute(nn.Linear(2, 1), single)
        Linear(in_features=2, out_features=1, bias=True)
    """
    cfg, dims, device, traits = strategy.cfg, strategy.dims, strategy.device, strategy.traits
    stage: StageSplit | None = None
    if dims.pp > 1 or traits.pipelined:
        check_pipelinable(strategy.precision)
        # COLLECTIVE (the first time): the mesh, when the pipelines are its rows.
        mesh = strategy.mesh if dims.world_size > dims.pp else None
        stage = keep_stage(model, dims, mesh, cfg.pipeline.split, device)
        model = stage.module
    else:
        model = model.to(device)
    if traits.device_map:  # before data parallel: DDP replicates the placed modules
        model = place_by_device_map(model, cfg.device_map, device)
    kind = data_parallel_kind(traits, dims, pipelined=stage is not None)
    # (Without a process group, a rank that joins live ones: sharded or replicated over
    # their mesh when it does.)
    if kind == "shard" and dist.is_initialized():
        if stage is None and dims.tp == 1:  # with tp, step 1 broadcast before the split
            broadcast_weights(model)  # every rank starts from rank 0's weights, as in DDP
        blocks = shard(model, strategy.mesh, dims, cfg, device, strategy.compute_dtype)
        if stage is None:
            log.info("%s: %d block(s) sharded one by one over %s, then the root",
                     strategy.name, blocks, dims.describe())
    elif kind == "replicate" and dist.is_initialized():
        model = replicate(model, cfg, device)
    elif kind == "threads":
        model = replicate_in_threads(model, getattr(strategy.precision, "autocast_dtype", None))
    strategy.attach(model, stage)
    return model


def broadcast_weights(model: nn.Module) -> None:
    """Rank 0's parameters and buffers to every rank (COLLECTIVE; nothing alone)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor.detach(), src=0)


def compile_model(model: nn.Module, perf: PerfConfig, scope: str) -> nn.Module:
    """Memory format and compilation, before the model is wrapped.

    ``nn.Module.compile`` compiles in place: each module keeps its class and its
    state-dict names, so checkpoints load with or without compilation, and DDP or FSDP
    wrap the compiled module as they would any other. With ``scope = "blocks"`` (see
    :func:`compile_scope`) each of the model's blocks (:func:`gpufleet.parallel.blocks.find_blocks`,
    the units FSDP shards one by one) is compiled on its own: one small graph that the
    blocks share once it is compiled, and FSDP's per-block hooks sit between graphs
    instead of breaking one.
    """
    if perf.channels_last:
        # Module.to takes memory_format (torch's documented call); its stubs omit it.
        model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    if not perf.compile:
        return model
    mode = None if perf.compile_mode == "default" else perf.compile_mode
    blocks = find_blocks(model) if scope == "blocks" else []
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
