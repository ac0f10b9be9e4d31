"""Data parallelism applied to a module: DDP replication, FSDP2 sharding, or one process
driving several GPUs (step 5 of :func:`gpufleet.parallel.parallelize.parallelize`).

Which one a run gets is decided by :func:`data_parallel_kind` from the mesh degrees and
the strategy's ``traits.data_parallel`` (the preset's own kind holds at degree 1 too:
a one-rank ``ddp`` run is still a DDP module). The strategies keep the step-time and
state hooks that go with each (``no_sync``, ``state_dict``, ...).

Example:
    >>> from gpufleet.parallel.dims import ParallelDims, StrategyTraits
    >>> data_parallel_kind(StrategyTraits(data_parallel="replicate"), ParallelDims(tp=2),
    ...                    pipelined=False)
    'shard'
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gpufleet.config import ParallelConfig
from gpufleet.parallel.dims import ParallelDims, StrategyTraits
from gpufleet.parallel.fsdp import shard_model

# Rank 0's buffers (BatchNorm statistics) to every rank before each forward. Newer torch
# names the option forward_sync_buffers and warns on the old name; the buffers are then
# also synced when DDP is built, which gpufleet's identically seeded models do not mind.
_SYNC_BUFFERS = ("forward_sync_buffers" if "forward_sync_buffers"
                 in inspect.signature(DDP.__init__).parameters else "broadcast_buffers")


def data_parallel_kind(traits: StrategyTraits, dims: ParallelDims, pipelined: bool) -> str:
    """What keeps the data parallel ranks in step: ``"shard"`` (FSDP2), ``"replicate"``
    (DDP), ``"threads"`` (``nn.DataParallel``) or ``""`` (nothing wraps the module).

    Data parallelism is applied when ``dp > 1`` or the preset's own kind asks for it.
    It is FSDP2 when the preset shards, when ``dp_shard > 1``, and also for plain
    replicas of a tensor parallel split or of a pipeline stage: torch's DDP cannot hold
    DTensor parameters, and FSDP2 over a (``dp_replicate``, ``dp_shard`` = 1) mesh
    all-reduces the gradients as DDP does.
    """
    kind = traits.data_parallel
    if kind == "threads":  # one process drives every GPU
        return "threads"
    if kind == "optimizer":  # its optimizer reduces the gradients (horovod)
        return ""
    if not (dims.dp > 1 or kind in ("replicate", "shard")):
        return ""
    if kind == "shard" or dims.dp_shard > 1 or dims.tp > 1 or pipelined:
        return "shard"
    return "replicate"


def replicate(model: nn.Module, cfg: ParallelConfig, device: torch.device) -> DDP:
    """``model`` (already on ``device``, or on several devices by a device map)
    wrapped in torch's ``DistributedDataParallel`` with the ``[parallel.ddp]`` bucket,
    graph and communication-hook options.
    COLLECTIVE: DDP broadcasts rank 0's parameters and buffers."""
    devices = {p.device for p in model.parameters()}
    ddp = DDP(
        model,
        # None on CPU (the module stays where it is, gloo reduces host tensors) and for
        # a module over several devices (torch's DDP then leaves the placement as it is).
        device_ids=[device.index] if device.type == "cuda" and len(devices) <= 1 else None,
        bucket_cap_mb=cfg.ddp.bucket_cap_mb,
        static_graph=cfg.ddp.static_graph,
        gradient_as_bucket_view=cfg.ddp.gradient_as_bucket_view,
        find_unused_parameters=cfg.ddp.find_unused_parameters,
        # The buffers' option has one of two names, by torch version (_SYNC_BUFFERS).
        **{_SYNC_BUFFERS: cfg.ddp.broadcast_buffers},  # type: ignore[arg-type]
    )
    register_comm_hook(ddp, cfg.ddp.comm_hook, cfg.ddp.powersgd_rank,
                       cfg.ddp.powersgd_start_step)
    return ddp


def register_comm_hook(ddp: DDP, name: str, powersgd_rank: int = 1,
                       powersgd_start_step: int = 10) -> None:
    """Compress ``ddp``'s gradient all-reduce with one of torch's communication hooks.

    ``fp16``/``bf16`` halve the bytes on the wire (gradients are cast, summed, cast
    back); ``powersgd`` sends a rank-``powersgd_rank`` approximation of each gradient
    matrix with error feedback, after ``powersgd_start_step`` plain steps. ``none``
    keeps DDP's own all-reduce.

    Example:
        >>> register_comm_hook(ddp_model, "bf16")  # doctest: +SKIP
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "none":
        return
    if name == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=powersgd_rank,
            start_powerSGD_iter=powersgd_start_step)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return
    hooks = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}
    ddp.register_comm_hook(None, hooks[name])


def shard(model: nn.Module, mesh: Any, dims: ParallelDims, cfg: ParallelConfig,
          device: torch.device, compute_dtype: torch.dtype | None = None) -> int:
    """FSDP2 over the data parallel part of ``mesh``: ``fully_shard`` on each block, then
    the root (in place); returns how many blocks were sharded.

    The shard group is ``mesh["dp_shard"]``; with ``dp_replicate > 1`` the mesh is
    2-D (replicate, shard): HSDP, or plain replicas when ``dp_shard = 1``.
    ``compute_dtype``: the dtype FSDP gathers parameters and computes in (its
    mixed-precision policy), None to leave casting to autocast.
    """
    dp_mesh = mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else mesh["dp_shard"]
    return shard_model(model, dp_mesh, cfg, device, compute_dtype, tp_split=dims.tp > 1)


class AutocastReplica(nn.Module):
    """Runs the wrapped module's forward under autocast with the run's dtype.

    DataParallel runs each replica in its own thread, and autocast's dtype is per thread:
    torch's replica threads re-enter autocast with the default dtype (float16), not the
    caller's (e.g. bfloat16). Entering it inside the replica keeps the run's dtype.
    """

    def __init__(self, module: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.module = module
        self.dtype = dtype

    def forward(self, *args, **kwargs):
        with torch.autocast("cuda", dtype=self.dtype):
            return self.module(*args, **kwargs)


def replicate_in_threads(model: nn.Module, dtype: torch.dtype | None) -> nn.DataParallel:
    """``model`` (on ``cuda:0``) under ``nn.DataParallel`` over every visible GPU, each
    replica's forward under autocast in ``dtype`` (None: no autocast). Inputs go to
    ``cuda:0``; DataParallel scatters them along dim 0 every forward."""
    return nn.DataParallel(AutocastReplica(model, dtype) if dtype is not None else model)
