"""The one interface every parallel strategy implements.

The training loop talks to a strategy through these methods only, so a new strategy is
a new module plus a registry entry, never a new branch in the loop. Defaults below are
right for anything that keeps one full model replica per rank; a strategy overrides the
few that differ.

The model itself is split, sharded and wrapped by
:func:`gpufleet.parallel.parallelize.parallelize`, by the mesh degrees and the
strategy's :class:`~gpufleet.parallel.dims.StrategyTraits`; a strategy keeps what
happens at step time and to state. How the others differ (each is a small module):

* ``fsdp`` (FSDP2): ``setup_optimizer`` builds the optimizer on the sharded (DTensor)
  parameters; ``no_sync`` uses ``model.set_requires_gradient_sync``;
  ``state_dict``/``load_state_dict`` go through ``torch.distributed.checkpoint`` and
  ``saves_on_every_rank`` is True; ``eval_model`` returns the sharded model (forward
  needs the all-gather on every rank, so evaluation batches must be even).
* ``zero1``: ``setup_optimizer`` builds a ``ZeroRedundancyOptimizer`` from the
  :class:`OptimizerSpec`'s class and arguments; ``state_dict`` consolidates the
  optimizer state on rank 0 first.
* ``pipeline``: :meth:`Strategy.attach` builds the ``torch.distributed.pipelining``
  schedule (GPipe or 1F1B) over this rank's stage; ``forward_backward`` runs it over
  micro-batches and returns the loss on the last stage; ``clip_grad_norm``
  all-reduces the squared norms across stages.
* ``local_sgd``: after a warm-up its DDP communication hook (set in ``attach``) sends
  nothing, and an optimizer step hook runs torch's periodic / hierarchical model
  averager.
* ``horovod``: ``setup_optimizer`` wraps in ``hvd.DistributedOptimizer`` and broadcasts
  the initial state; ``forward_backward`` waits for the gradient all-reduce after the
  last micro-step; ``all_reduce`` uses ``hvd.allreduce``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from gpufleet.config import ParallelConfig
from gpufleet.core.collectives import is_initialized
from gpufleet.core.ring import RING
from gpufleet.errors import ConfigError
from gpufleet.parallel.dims import ParallelDims, StrategyTraits, plan_for
from gpufleet.parallel.grad_norm import (
    EachNorm,
    clip_grads_,
    clip_whole_,
    clip_whole_p_,
    grad_norm,
    spreads_gradients,
)


@dataclass
class OptimizerSpec:
    """How to build the optimizer, kept apart from building it.

    Sharding strategies need the class and arguments rather than an instance
    (``ZeroRedundancyOptimizer`` takes ``optimizer_class``; FSDP2 needs the optimizer
    built after the parameters are sharded).

    Attributes:
        cls: the optimizer class, e.g. ``torch.optim.AdamW``.
        param_groups: maps the (unwrapped) model to its parameter groups.
        kwargs: keyword arguments for ``cls``.
        accumulation: micro-steps (backward passes) per optimizer step; Horovod's
            optimizer needs it to delay its all-reduce to the last one.
    """

    cls: type[torch.optim.Optimizer]
    param_groups: Callable[[nn.Module], list[dict[str, Any]]]
    kwargs: dict[str, Any] = field(default_factory=dict)
    accumulation: int = 1

    def build(self, model: nn.Module) -> torch.optim.Optimizer:
        return self.cls(self.param_groups(model), **self.kwargs)


class Strategy:
    """Base class: one full model replica per rank, no wrapping (what ``single`` is).

    Args:
        cfg: the ``[parallel]`` config section.
        device: this rank's device.
        precision: the run's precision object (FSDP's mixed-precision policy and
            DataParallel's per-replica autocast need it).
    """

    name: ClassVar[str] = "base"
    #: True when every rank writes its own shard of a checkpoint (FSDP), False when
    #: rank 0 writes the whole state. A class default, which a strategy may set per
    #: instance (a pipeline with dp or tp > 1), as it may :attr:`eval_in_lockstep`.
    saves_on_every_rank: bool = False
    #: True when the strategy talks to other ranks, so a process group must exist.
    needs_process_group: ClassVar[bool] = False
    #: True when every evaluation forward is a collective (FSDP all-gathers the weights
    #: in it): every rank must then run the same number, and the loop repeats a batch,
    #: uncounted, on ranks whose share of the evaluation set is a batch shorter.
    eval_in_lockstep: bool = False
    #: What the strategy asks of the run (processes, device, backend, mesh degrees);
    #: :func:`gpufleet.parallel.dims.plan_for` reads it.
    traits: ClassVar[StrategyTraits] = StrategyTraits()

    def __init__(self, cfg: ParallelConfig, device: torch.device,
                 precision: Any = None, dims: ParallelDims | None = None) -> None:
        self.cfg = cfg
        self.device = device
        self.precision = precision
        #: The mesh degrees of this run; when not given, the config's degrees over the
        #: ranks of the process group.
        self.dims = dims or plan_for(cfg, self.traits,
                                     dist.get_world_size() if is_initialized() else 1)
        #: The norm of each gradient the last :meth:`clip_grad_norm` measured before
        #: clipping (the non-finite check reads it); None when not measured.
        self.measured: EachNorm | None = None
        self._clip_model: nn.Module | None = None
        self._clip_params: list[nn.Parameter] | None = None
        self._mesh: Any = None
        #: The dtype FSDP's mixed-precision policy gathers parameters in, when the
        #: strategy lets FSDP cast instead of autocast (``fsdp``); None otherwise.
        self.compute_dtype: torch.dtype | None = None

    @property
    def mesh(self) -> Any:
        """The run's one ``DeviceMesh`` over :attr:`dims` (``pp``, ``dp_replicate``,
        ``dp_shard``, ``tp``), built on first use (COLLECTIVE: every rank reads it the
        same time) and shared by every parallelism applied to the model."""
        if self._mesh is None:
            self._mesh = self.dims.build_mesh(self.device.type)
        return self._mesh

    # -- building ------------------------------------------------------------------
    def attach(self, model: nn.Module, stage: Any = None) -> None:
        """Called once by :func:`~gpufleet.parallel.parallelize.parallelize` with the
        module the loop will call, for step-time machinery that must hold that very
        module: ``local_sgd`` puts its communication hook on the DDP wrapper and builds
        its averager, ``pipeline`` builds its schedule over this rank's (sharded)
        stage (``stage``: the :class:`~gpufleet.parallel.pipeline_split.StageSplit`,
        None when the model is not split). The model is never replaced here.
        Default: nothing."""

    def setup_optimizer(self, model: nn.Module, spec: OptimizerSpec) -> torch.optim.Optimizer:
        """Build the optimizer for the wrapped ``model``."""
        return spec.build(self.unwrap(model))

    def keeps_optimizer(self) -> bool:
        """Whether an optimizer built on the placed model's own parameters trains as it
        is (``setup_optimizer`` would only build one like it): own-loop runs then step
        the user's object itself. False where this strategy wraps or hooks it."""
        return True

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's own module (no ``module.`` prefix in its state dict)."""
        return model

    def data_shard(self, rank: int, world_size: int) -> tuple[int, int]:
        """``(shard, shards)``: which part of the data this rank reads: its data parallel
        replica in the mesh. Ranks that differ only in tensor or pipeline position (a
        pipeline's stages, a layer's tensor parallel slices) share one shard."""
        if self.dims.world_size != world_size:  # a strategy built without the run's dims
            return rank, world_size
        return self.dims.dp_rank(rank), self.dims.dp

    def regroup(self, world_size: int, local_world_size: int | None = None) -> None:
        """The process group was made again with ``world_size`` ranks, ``local_world_size``
        of them on each node (the ranks left after a lost node, see
        :mod:`gpufleet.train.recovery.recovery`): the mesh degrees follow it (hsdp shards within
        a node), the mesh is built again on first use, and the clip's choices are made
        again."""
        self.dims = plan_for(self.cfg, self.traits, world_size, local_world_size)
        self._mesh = None
        self._clip_model, self._clip_params, self.measured = None, None, None

    # -- the step --------------------------------------------------------------------
    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Context in which backward does not synchronise gradients across ranks."""
        return contextlib.nullcontext()

    def forward_backward(self, model: nn.Module, batch: Any,
                         loss_fn: Callable[[nn.Module, Any], torch.Tensor],
                         precision: Any, loss_scale: float,
                         mark: Callable[[], None] | None = None) -> torch.Tensor:
        """Forward and backward of one micro-batch; returns the detached, unscaled loss.

        ``loss_scale`` is 1 / grad_accum: the loss is divided before backward so that N
        micro-batches add up to the gradient of one N-times batch. ``mark``, when given,
        is called where backward begins (phase timing).
        """
        if precision.autocast_dtype is None:  # fp32: no autocast to enter
            loss = loss_fn(model, batch)
        else:
            with precision.autocast():
                loss = loss_fn(model, batch)
        if mark is not None:
            mark()
        precision.backward(loss * loss_scale if loss_scale != 1.0 else loss)
        return loss.detach()

    def clip_grad_norm(self, model: nn.Module, max_norm: float,
                       norm_type: float = 2.0) -> torch.Tensor:
        """Clip the global gradient norm; returns the norm before clipping (on device).
        COLLECTIVE when the mesh spreads the gradients over ranks (see
        :mod:`gpufleet.parallel.grad_norm`).

        Where every rank holds every gradient, the norm of each one, measured on the
        way, stays in :attr:`measured` until the next call (None otherwise).

        ``norm_type`` other than 2 (``inf`` too) is taken where every rank holds every
        gradient; where ranks hold pieces of them (sharded, tensor parallel, pipeline
        stages), only the L2 norm is put together, and another raises ConfigError.
        """
        if float(norm_type) != 2.0:
            return self._clip_p_norm(model, max_norm, float(norm_type))
        if model is not self._clip_model:  # decided once: None when ranks hold pieces
            self._clip_model = model
            self._clip_params = None if spreads_gradients(self.dims) else \
                list(model.parameters())
        if self._clip_params is not None:
            norm, self.measured = clip_whole_(self._clip_params, max_norm, self.device)
            return norm
        self.measured = None
        norm = self.grad_norm(model)
        clip_grads_(grads_of(model), max_norm, norm)
        return norm

    def _clip_p_norm(self, model: nn.Module, max_norm: float, norm_type: float
                     ) -> torch.Tensor:
        if spreads_gradients(self.dims):
            raise ConfigError(
                f"clip_gradients(norm_type={norm_type:g}) with parallel.strategy = "
                f"{self.name!r} over {self.dims.describe()}: the ranks hold different "
                "pieces of the gradients, and gpufleet puts their global L2 norm together "
                "only. Use norm_type=2.0 here, or clip by value (clip_val=...).")
        self.measured = None
        return clip_whole_p_(list(model.parameters()), max_norm, norm_type, self.device)

    def grad_norm(self, model: nn.Module) -> torch.Tensor:
        """The global L2 norm of the gradients (on device), without clipping; a
        COLLECTIVE like :meth:`clip_grad_norm`."""
        return grad_norm(grads_of(model), self.device, self.dims)

    def after_optimizer_step(self, model: nn.Module, step: int) -> None:
        """Called after every optimizer step (model averaging hooks in here)."""

    def eval_model(self, model: nn.Module) -> nn.Module:
        """The module to run evaluation on. The unwrapped replica needs no collective per
        forward, so ranks may run different numbers of evaluation batches (see
        ``eval_in_lockstep``)."""
        return self.unwrap(model)

    # -- state -----------------------------------------------------------------------
    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Model and optimizer state as saved in a checkpoint."""
        return {"model": self.unwrap(model).state_dict(), "optimizer": optimizer.state_dict()}

    def local_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer
                         ) -> dict[str, Any]:
        """Model and optimizer state as they live on this rank, with no collective (what
        an in-memory snapshot copies): the live tensors, under fsdp this rank's shards
        (DTensors), under zero1 this rank's part of the optimizer state."""
        return {"model": self.unwrap(model).state_dict(), "optimizer": optimizer.state_dict()}

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                        state: dict[str, Any]) -> None:
        self.unwrap(model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    # -- collectives -----------------------------------------------------------------
    def reduces(self) -> bool:
        """Whether :meth:`all_reduce` talks to other ranks (more than one process)."""
        return is_initialized() and dist.get_world_size() > 1

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", group: Any = None
                   ) -> torch.Tensor:
        """Reduce ``tensor`` in place over all ranks (no-op in a single process), or over
        the ranks of ``group`` (a ``torch.distributed`` process group) when given."""
        if group is not None or self.reduces():
            n = RING.enter("all_reduce", tensor.numel() * tensor.element_size())
            dist.all_reduce(tensor, op=_REDUCE_OPS[op], group=group)
            RING.leave(n)
        return tensor


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def grads_of(model: nn.Module) -> Iterator[torch.Tensor]:
    """The gradients that exist (parameters without a gradient are skipped)."""
    return (p.grad for p in model.parameters() if p.grad is not None)


def why_not_in_process(cls: type[Strategy], dims: ParallelDims, reshards: bool) -> str:
    """Why a strategy's state cannot be put together again in the ranks left after a
    lost node ("" when it can): in-process recovery needs every rank to hold the whole
    model and optimizer state (plain replicas, as ddp keeps them), or FSDP2's shards
    that it joins again (``reshards``: fsdp and hsdp), and no state of the strategy's
    own between steps. ``dims``: the run's mesh degrees."""
    traits = cls.traits
    what = f"parallel.strategy = {cls.name!r}"
    if max(dims.tp, dims.pp) > 1 or traits.pipelined:
        return f"{what} splits the model over the ranks (tp {dims.tp}, pp {dims.pp})"
    if not reshards and (traits.data_parallel != "replicate" or dims.dp_shard > 1):
        return f"{what} shards the model and optimizer state over the ranks"
    if traits.consolidates_optimizer:
        return f"{what} shards the optimizer state over the ranks"
    if (cls.attach is not Strategy.attach
            or cls.after_optimizer_step is not Strategy.after_optimizer_step):
        return f"{what} keeps state of its own between steps (averaging, a schedule)"
    return ""
