"""``fsdp``: FSDP2 (``fully_shard``): parameters, gradients and optimizer state sharded.

Each rank keeps 1/N of every parameter (a ``DTensor`` sharded on dim 0). Before a
block's forward its parameters are all-gathered, after its backward the gradients are
reduce-scattered, so a rank holds the full parameters of only the block it is running.

* Wrapping (:func:`shard_model`, applied by
  :func:`gpufleet.parallel.parallelize.parallelize`, which first gives every rank
  rank 0's weights): ``fully_shard`` on each block, then on the root. ``parallel.fsdp.wrap =
  "auto"`` takes the model's blocks (:mod:`gpufleet.parallel.blocks`: the transformer
  blocks of a GPT, the residual blocks of a ResNet); class names
  (``"Block,Embedding"``) pick modules by type instead. One block is the unit of
  communication and of peak memory.
* Mixed precision: with ``bf16-mixed`` (``fp16-mixed``) FSDP all-gathers the parameters
  in that dtype and computes forward and backward in it, reduces gradients in float32,
  and keeps the sharded float32 master weights for the optimizer. The loop's autocast is
  then switched off inside :meth:`FullyShardedDataParallel.forward_backward`: FSDP has
  already cast parameters and inputs at module boundaries, and autocast on top would
  only add per-op casts. The model's outputs are cast back to float32 so the loss is
  computed in float32.
* Evaluation runs on the sharded model, so it needs no more memory than training.
  Every forward all-gathers block by block on every rank, so the ranks run the same
  number of evaluation forwards: the evaluation sampler may give one rank a batch less,
  and that rank repeats a batch whose loss is not counted (``eval_in_lockstep``).
* ``parallel.fsdp.cpu_offload`` keeps the sharded parameters, gradients and optimizer
  state in host memory (the optimizer step runs on the CPU).
* ``parallel.fsdp.reshard_after_forward = false`` keeps each block's gathered
  parameters from forward until its backward (one all-gather less, more memory).
* The mesh (:mod:`gpufleet.parallel.dims`): ``fsdp`` shards over ``dp_shard`` (all
  ranks by default); with ``dp_replicate > 1`` it is HSDP over a 2-D (replicate,
  shard) mesh, the ``hsdp`` preset's default (shard within a node, replicate across
  nodes); with ``tp > 1`` tensor parallelism (:mod:`gpufleet.parallel.tensor`) splits
  the blocks first and FSDP shards the result over the data parallel ranks.
* Checkpoints are sharded: every rank writes its own shards with
  ``torch.distributed.checkpoint`` (see :mod:`gpufleet.train.checkpoint.format`), and they load
  at any world size.

Example:
    >>> from gpufleet.parallel import strategy_names
    >>> "fsdp" in strategy_names()
    True
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from gpufleet.config import ParallelConfig
from gpufleet.errors import ConfigError, did_you_mean
from gpufleet.parallel.base import Strategy
from gpufleet.parallel.dims import ParallelDims, StrategyTraits
from gpufleet.parallel.tensor import without_strided

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

log = logging.getLogger(__name__)

_NEEDS = ("parallel.strategy = 'fsdp' needs torch >= 2.4 (FSDP2's fully_shard and "
          "torch.distributed.checkpoint.state_dict); this is torch {version}. Upgrade torch, "
          "or use parallel.strategy = zero1 or ddp.")


def fsdp_api() -> SimpleNamespace:
    """FSDP2's public names (``torch.distributed.fsdp`` from torch 2.6, the composable
    module before), or a :class:`ConfigError` naming the torch version needed."""
    try:
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            fully_shard,
        )
    except ImportError:
        try:  # torch 2.4 / 2.5
            from torch.distributed._composable.fsdp import (
                CPUOffloadPolicy,
                MixedPrecisionPolicy,
                fully_shard,
            )
        except ImportError as e:
            raise ConfigError(_NEEDS.format(version=torch.__version__)) from e
    try:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_state_dict,
            set_state_dict,
        )
        from torch.distributed.device_mesh import init_device_mesh
    except ImportError as e:
        raise ConfigError(_NEEDS.format(version=torch.__version__)) from e
    return SimpleNamespace(
        fully_shard=fully_shard, MixedPrecisionPolicy=MixedPrecisionPolicy,
        CPUOffloadPolicy=CPUOffloadPolicy, StateDictOptions=StateDictOptions,
        get_state_dict=get_state_dict, set_state_dict=set_state_dict,
        get_model_state_dict=get_model_state_dict, init_device_mesh=init_device_mesh)


class FullyShardedDataParallel(Strategy):
    """The step-time and state hooks of a model that
    :func:`gpufleet.parallel.parallelize.parallelize` sharded with FSDP2 per block
    (:func:`shard_model`, ``[parallel.fsdp]`` options)."""

    name = "fsdp"
    traits = StrategyTraits(rest="dp_shard", dims=frozenset({"dp_replicate", "dp_shard", "tp"}),
                            reduces_in_backward=True, data_parallel="shard")
    saves_on_every_rank = True
    needs_process_group = True
    # Evaluation runs on the sharded model (no full copy): each forward all-gathers.
    eval_in_lockstep = True

    def __init__(self, cfg: ParallelConfig, device: torch.device,
                 precision: Any = None, dims: ParallelDims | None = None) -> None:
        super().__init__(cfg, device, precision, dims)
        self.api = fsdp_api()
        if getattr(precision, "scales_loss", False):
            raise ConfigError(
                "precision.mode = 'fp16-mixed' is not supported with parallel.strategy = "
                "'fsdp': its loss scaler would see only this rank's gradient shard. Use "
                "precision.mode = bf16-mixed (no loss scaling needed) or fp32.")
        # FSDP's mixed-precision policy casts (parallelize passes it to the sharding).
        self.compute_dtype = getattr(precision, "autocast_dtype", None)

    # -- the step --------------------------------------------------------------------
    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        # fully_shard made the model an FSDPModule in place (it changes the module's
        # class); the Strategy interface types it as any module.
        return _gradient_sync_off(cast("FSDPModule", model))

    def forward_backward(self, model: nn.Module, batch: Any, loss_fn: Any, precision: Any,
                         loss_scale: float, *args: Any, **kwargs: Any) -> torch.Tensor:
        # FSDP's mixed-precision policy already casts; autocast on top would double up.
        if self.compute_dtype is not None:
            precision = _WithoutAutocast(precision)
        return super().forward_backward(model, batch, loss_fn, precision, loss_scale,
                                        *args, **kwargs)

    # -- state -----------------------------------------------------------------------
    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """This rank's shards of model and optimizer state (DTensors, keyed by parameter
        name); :func:`gpufleet.train.checkpoint.sharded.save_sharded_checkpoint` writes them."""
        msd, osd = self.api.get_state_dict(model, optimizer)
        return without_strided({"model": msd, "optimizer": osd})

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                        state: dict[str, Any]) -> None:
        """Load full (unsharded) state, e.g. a single-file checkpoint of a ``single`` or
        ``ddp`` run; each rank keeps its shards. Sharded checkpoints are loaded by
        :func:`gpufleet.train.checkpoint.sharded.load_sharded_into`."""
        api = self.api
        osd = state["optimizer"]
        if osd.get("state") and all(isinstance(k, int) for k in osd["state"]):
            osd = keyed_by_name(model, optimizer, osd)
        api.set_state_dict(model, optimizer, model_state_dict=state["model"],
                           optim_state_dict=osd,
                           options=api.StateDictOptions(full_state_dict=True))


def shard_model(model: nn.Module, dp_mesh: Any, cfg: ParallelConfig, device: torch.device,
                compute_dtype: torch.dtype | None = None, tp_split: bool = False) -> int:
    """``fully_shard`` each block of ``model`` over ``dp_mesh``, then the root, with the
    ``[parallel]`` ``fsdp_*`` options; returns how many blocks were sharded. A 2-D
    ``dp_mesh`` (replicate, shard) gives HSDP; ``tp_split``: tensor parallelism has
    already split the blocks' matrices."""
    api = fsdp_api()
    common: dict[str, Any] = {"mesh": dp_mesh}
    if tp_split:
        common["shard_placement_fn"] = shard_beside_heads
    if cfg.fsdp.cpu_offload:
        # Pinned host memory makes the copies to the GPU asynchronous (CUDA only).
        common["offload_policy"] = api.CPUOffloadPolicy(pin_memory=device.type == "cuda")
    if compute_dtype is not None:
        common["mp_policy"] = api.MixedPrecisionPolicy(
            param_dtype=compute_dtype, reduce_dtype=torch.float32)
    blocks = blocks_to_shard(model, cfg.fsdp.wrap)
    for block in blocks:
        api.fully_shard(block, reshard_after_forward=cfg.fsdp.reshard_after_forward, **common)
    if compute_dtype is not None:  # the loss is computed from float32 outputs
        common["mp_policy"] = api.MixedPrecisionPolicy(
            param_dtype=compute_dtype, reduce_dtype=torch.float32, output_dtype=torch.float32)
    # The root's parameters are gathered in forward and kept for backward.
    api.fully_shard(model, reshard_after_forward=cfg.fsdp.reshard_after_forward, **common)
    return len(blocks)


class HybridShardedDataParallel(FullyShardedDataParallel):
    """HSDP: FSDP within a node, whole replicas across nodes (``dp_shard`` = ranks per
    node, ``dp_replicate`` = nodes, unless the config sets them). Each step
    reduce-scatters the gradients inside the node and all-reduces the shards across
    nodes, so only 1/``dp_shard`` of the gradients crosses the slower network."""

    name = "hsdp"
    traits = StrategyTraits(rest="dp_replicate", shard_default_per_node=True,
                            dims=frozenset({"dp_replicate", "dp_shard", "tp"}),
                            reduces_in_backward=True, data_parallel="shard")


class ReplicatedTensorParallel(FullyShardedDataParallel):
    """The ``ddp`` preset with ``tp > 1``: whole (tensor parallel) replicas on
    ``dp_replicate`` that all-reduce their gradients, as DDP does.

    torch's ``DistributedDataParallel`` cannot hold the DTensor parameters tensor
    parallelism leaves, so the replication is FSDP2 over a (``dp_replicate``,
    ``dp_shard`` = 1) mesh: a shard group of one rank keeps every parameter whole, and
    the gradients are all-reduced across the replicas. Checkpoints are then sharded
    (each tensor parallel rank writes its slices), as with ``fsdp`` and ``tp``.
    """

    name = "ddp"
    traits = StrategyTraits(dims=frozenset({"dp_replicate", "tp"}), reduces_in_backward=True,
                            comm_hooks=True, tp_by_replicate_mesh=True,
                            data_parallel="replicate", several_models=True)

    def __init__(self, cfg: ParallelConfig, device: torch.device,
                 precision: Any = None, dims: ParallelDims | None = None) -> None:
        if cfg.ddp.comm_hook != "none":
            raise ConfigError(
                f"parallel.ddp.comm_hook = {cfg.ddp.comm_hook!r} compresses DDP's own "
                "all-reduce, and with parallel.tp > 1 the replicas are kept in step by "
                "FSDP2 over the replicate dimension instead. Set parallel.ddp.comm_hook = "
                "none, or parallel.tp = 1.")
        super().__init__(cfg, device, precision, dims)


def blocks_to_shard(model: nn.Module, wrap: str) -> list[nn.Module]:
    """The modules to shard one by one, innermost first.

    ``"auto"``: the model's blocks, found as :func:`gpufleet.parallel.blocks.find_blocks`
    says (the rule activation checkpointing's ``every:K`` uses too). Otherwise a
    comma-separated list of class names; every module of those classes is sharded.

    Example:
        >>> net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
        >>> [type(m).__name__ for m in blocks_to_shard(net, "auto")]
        ['Linear', 'Linear']
    """
    if wrap.strip() == "auto":
        from gpufleet.parallel.blocks import describe_blocks, find_blocks

        names = find_blocks(model)
        log.info("fsdp auto wrap: %s", describe_blocks(model, names))
        modules = dict(model.named_modules())
        return [modules[n] for n in names]
    names = [n.strip() for n in wrap.split(",") if n.strip()]
    present = {type(m).__name__ for m in model.modules()}
    for name in names:
        if name not in present:
            guess = did_you_mean(name, sorted(present))
            hint = f" Did you mean {guess!r}?" if guess else ""
            raise ConfigError(
                f"parallel.fsdp.wrap: the model has no module of class {name!r}.{hint} "
                f"Its classes: {', '.join(sorted(present))}. Name block classes (comma-"
                "separated), or use 'auto'.")
    # Reversed pre-order: a nested match is sharded before the module that holds it.
    picked = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    return list(reversed(picked))


def shard_beside_heads(param: nn.Parameter) -> Any:
    """FSDP's dimension for a parameter that tensor parallelism already split: dim 1 for
    a head-split q/k/v weight (its rows are split in thirds over ``tp``, and a second
    split of those rows has no layout), torch's default (dim 0) for every other."""
    from torch.distributed.tensor import Shard

    if any(type(p).__name__ == "_StridedShard" for p in getattr(param, "placements", ())):
        return Shard(1)
    return None


@contextlib.contextmanager
def _gradient_sync_off(model: FSDPModule) -> Iterator[None]:
    """Accumulate unsharded gradients locally; the reduce-scatter waits for the
    micro-step that runs outside this context."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


class _WithoutAutocast:
    """The run's precision object with autocast switched off (FSDP casts instead)."""

    def __init__(self, precision: Any) -> None:
        self._inner = precision

    def autocast(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def keyed_by_name(model: nn.Module, optimizer: torch.optim.Optimizer,
                   osd: dict[str, Any]) -> dict[str, Any]:
    """Turn a ``torch.optim`` state dict keyed by parameter index into one keyed by
    parameter name (the form ``set_state_dict`` loads). Indices follow the optimizer's
    parameter groups, which the same model and config build in the same order."""
    names = {p: n for n, p in model.named_parameters()}
    by_index: dict[int, str] = {}
    for saved, group in zip(osd["param_groups"], optimizer.param_groups, strict=True):
        by_index.update(zip(saved["params"], (names[p] for p in group["params"]), strict=True))
    return {"state": {by_index[i]: s for i, s in osd["state"].items()},
            "param_groups": [{**g, "params": [by_index[i] for i in g["params"]]}
                             for g in osd["param_groups"]]}

