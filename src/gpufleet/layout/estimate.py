"""What one rank of a layout holds and moves, measured on a cluster that is not there.

For each pipeline stage, one representative rank joins torch's fake process group
(``rank`` of ``world`` ranks, no peers, every collective a no-op), builds the run's
``DeviceMesh``, builds its stage of the model on the meta device (no memory, no data),
and applies tensor parallelism and FSDP with gpufleet's own functions
(:func:`gpufleet.parallel.tensor.apply_tensor_parallel`,
:func:`gpufleet.parallel.fsdp.shard_model`). Then, per rank:

* parameters, gradients, optimizer state: the local shard sizes of the sharded
  parameters (fp32 master weights and gradients; AdamW keeps 2 states, SGD with momentum 1);
* activations: the tensors autograd saves for backward in one micro-batch's forward
  through the stage (``saved_tensors_hooks`` on fake tensors, under the run's autocast
  as the CPU or, for a plan for GPUs, CUDA applies it: :mod:`gpufleet.layout.saved`),
  times the micro-batches a pipeline schedule keeps in flight;
* buffers: DDP's gradient buckets, or FSDP's gathered blocks (two in flight) and one
  block's unsharded gradients before they are reduce-scattered;
* FLOPs per step: torch's FLOP counter over one forward, times 3 (backward is two
  matmuls per forward matmul), times micro-batches and accumulation;
* communication per step on each mesh dimension: bytes each rank sends with ring
  collectives (all-reduce ``2(n-1)/n``, all-gather and reduce-scatter ``(n-1)/n`` of the
  whole tensor), from the sizes above.

What it leaves out is said in the output: the CUDA context and NCCL buffers (the
device's usable share covers them), the allocator's fragmentation, and temporary
tensors inside a kernel.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gpufleet.config import Config
from gpufleet.errors import ConfigError, GpufleetError
from gpufleet.layout.saved import saved_bytes
from gpufleet.layout.stages import Stage, gpt_stage, sequential_stage
from gpufleet.models.gpt import GPT
from gpufleet.monitor.flops import flop_counter
from gpufleet.parallel.dims import DIMS, ParallelDims

FP32 = 4
COMPUTE_DTYPES = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


@dataclass
class RankEstimate:
    """Memory (bytes), communication (bytes sent per optimizer step, by mesh dimension)
    and FLOPs per optimizer step of one rank."""

    rank: int
    stage: int
    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    flops: float
    in_flight: int = 1
    comm: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """Every byte above: the rank's peak memory estimate."""
        return self.params + self.grads + self.optimizer + self.activations + self.buffers


@dataclass
class LayoutEstimate:
    """A layout's ranks: one representative per pipeline stage (the ranks of one stage
    differ only in which shard they hold)."""

    dims: ParallelDims
    micro_batch: int
    ranks: list[RankEstimate]

    @property
    def peak(self) -> RankEstimate:
        """The rank that needs the most memory."""
        return max(self.ranks, key=lambda r: r.total)


@contextlib.contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """This process as ``rank`` of ``world_size`` in torch's fake process group."""
    # Deferred: torch's fake backend lives in its testing package and registers the
    # "fake" backend on import; only the planner needs it.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise GpufleetError("the planner joins a fake process group of its own and cannot "
                            "run inside a process that already joined one. Run "
                            "`gpufleet plan` as a command of its own.")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def estimate_layout(cfg: Config, dims: ParallelDims, build_model: Any,
                    sample: tuple[torch.Tensor, ...] = (),
                    device_type: str = "cpu") -> LayoutEstimate:
    """Estimate every pipeline stage of ``dims`` for the run ``cfg`` describes.

    Args:
        cfg: the run's config (batch size, accumulation, precision, optimizer, the
            ``[parallel]`` options).
        dims: the layout's degrees.
        build_model: ``build_model()`` returns the model; called on the meta device.
        sample: one batch of inputs for a model other than the built-in GPT (on any
            device; only shapes and dtypes are used).
        device_type: the devices the ranks train on, "cuda" or "cpu": whose autocast
            decides the dtypes of the saved activations under mixed precision.

    Raises:
        ConfigError: a batch that does not divide into the pipeline's micro-batches, or
            a model the layout cannot split.
    """
    par = cfg.parallel
    micro_batch, in_flight = cfg.data.batch_size, 1
    if dims.pp > 1:
        m = par.pipeline.microbatches
        if cfg.data.batch_size % m:
            raise ConfigError(f"data.batch_size = {cfg.data.batch_size} does not split into "
                              f"parallel.pipeline.microbatches = {m}. Make the batch a "
                              "multiple of the micro-batches.")
        micro_batch = cfg.data.batch_size // m
    ranks = []
    per_stage = dims.world_size // dims.pp
    for stage in range(dims.pp):
        if dims.pp > 1:  # micro-batches whose activations a stage holds at once
            m = par.pipeline.microbatches
            in_flight = m if par.pipeline.schedule == "gpipe" else min(dims.pp - stage, m)
        ranks.append(_estimate_rank(cfg, dims, stage * per_stage, stage, build_model,
                                    sample, micro_batch, in_flight, device_type))
    return LayoutEstimate(dims, micro_batch, ranks)


def _estimate_rank(cfg: Config, dims: ParallelDims, rank: int, stage: int, build_model: Any,
                   sample: tuple[torch.Tensor, ...], micro_batch: int, in_flight: int,
                   device_type: str) -> RankEstimate:
    from torch.distributed.device_mesh import init_device_mesh

    from gpufleet.parallel.fsdp import shard_model
    from gpufleet.parallel.tensor import apply_tensor_parallel

    with fake_world(rank, dims.world_size):
        mesh = init_device_mesh("cpu", tuple(getattr(dims, n) for n in DIMS),
                                mesh_dim_names=DIMS)
        with torch.device("meta"):
            model = build_model()
        part = _stage(model, cfg, dims, stage, micro_batch, sample)
        if dims.tp > 1:
            apply_tensor_parallel(part.module, mesh["tp"])
        block_full = max((_local_numel(b) for b in part.blocks), default=0)
        activations, fwd_flops = _forward(part, cfg.precision.mode, device_type)
        if dims.dp_shard > 1:
            dp_mesh = (mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1
                       else mesh["dp_shard"])
            shard_model(part.module, dp_mesh, cfg.parallel, torch.device("cpu"),
                        tp_split=dims.tp > 1)
        local = _local_numel(part.module)
    full = local * dims.dp_shard  # this stage's (tensor parallel) part, unsharded
    compute = 2 if cfg.precision.mode in COMPUTE_DTYPES else FP32
    if dims.dp_shard > 1:  # two gathered blocks in flight, one block's gradients
        buffers = 2 * block_full * compute + block_full * FP32
    else:  # DDP's buckets hold a second copy of the gradients
        buffers = 0 if cfg.parallel.ddp.gradient_as_bucket_view else local * FP32
    micro_steps = ((cfg.parallel.pipeline.microbatches if dims.pp > 1 else 1)
                   * cfg.optim.grad_accum)
    return RankEstimate(
        rank=rank, stage=stage, params=local * FP32, grads=local * FP32,
        optimizer=local * FP32 * _optimizer_states(cfg), activations=activations * in_flight,
        buffers=buffers, flops=3.0 * fwd_flops * micro_steps, in_flight=in_flight,
        comm=_comm(cfg, dims, stage, part, local, full, compute, micro_steps))


def _stage(model: nn.Module, cfg: Config, dims: ParallelDims, stage: int, micro_batch: int,
           sample: tuple[torch.Tensor, ...]) -> Stage:
    if isinstance(model, GPT):
        return gpt_stage(model, stage, dims.pp, micro_batch)
    if not sample:
        raise ConfigError("the planner needs one batch of the data to size a model other "
                          "than the built-in GPT; give --data (or use --model gpt).")
    meta = tuple(torch.empty((micro_batch, *t.shape[1:]), dtype=t.dtype, device="meta")
                 for t in sample)
    if dims.pp == 1:
        from gpufleet.parallel.blocks import find_blocks

        modules = dict(model.named_modules())
        return Stage(model, meta, [modules[n] for n in find_blocks(model)], None, 0)
    return sequential_stage(model, stage, dims.pp, cfg.parallel.pipeline.split, meta)


def _forward(part: Stage, precision: str, device_type: str) -> tuple[int, int]:
    """Bytes autograd saves for backward in one micro-batch on ``device_type`` (see
    :mod:`gpufleet.layout.saved`), and the forward's FLOPs (attention counted in full)."""
    dtype = COMPUTE_DTYPES.get(precision)
    activations = saved_bytes(part.module, part.inputs, dtype, device_type)
    counter = flop_counter()
    with counter:
        part.module(*part.inputs)
    return activations, counter.get_total_flops()


def _comm(cfg: Config, dims: ParallelDims, stage: int, part: Stage, local: int, full: int,
          compute: int, micro_steps: int) -> dict[str, float]:
    """Bytes this rank sends per optimizer step on each mesh dimension (ring costs)."""
    comm: dict[str, float] = {}
    if dims.tp > 1 and part.width is not None:  # 2 all-reduces in forward, 2 in backward
        blocks = len(part.blocks)
        activation = part.tokens * part.width * compute
        comm["tp"] = 4 * blocks * 2 * (dims.tp - 1) / dims.tp * activation * micro_steps
    n = dims.dp_shard
    if n > 1:  # all-gather in forward and (resharded) backward; reduce-scatter once
        gathers = 2 if cfg.parallel.fsdp.reshard_after_forward else 1
        share = (n - 1) / n
        comm["dp_shard"] = (gathers * share * full * compute * micro_steps
                            + share * full * FP32)
    r = dims.dp_replicate
    if r > 1:  # gradients all-reduced across replicas (HSDP: the shards)
        comm["dp_replicate"] = 2 * (r - 1) / r * local * FP32
    if dims.pp > 1 and part.width is not None:  # activations on, gradients back
        sends = (stage < dims.pp - 1) + (stage > 0)
        comm["pp"] = float(sends * part.tokens * part.width * compute * micro_steps)
    return comm


def _local_numel(module: nn.Module) -> int:
    """Elements of the parameters this rank holds (its shard of each sharded one)."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel()
               for p in module.parameters())


def _optimizer_states(cfg: Config) -> int:
    """Tensors the optimizer keeps per parameter (AdamW: 2; SGD: 1 with momentum)."""
    if cfg.optim.name == "sgd":
        return 1 if cfg.optim.momentum else 0
    return 2
