"""``zero1``: DDP plus ``ZeroRedundancyOptimizer`` (ZeRO stage 1).

Gradients are all-reduced by DDP as usual; the optimizer state (AdamW's two moments,
twice the parameter bytes) is split across ranks. Each rank steps only the parameters
it owns, then broadcasts them to the others. Parameters are assigned whole to one rank
(greedily by size), so the split is even only up to the size of the largest parameter.

Checkpoints stay single files written by rank 0: saving first gathers ("consolidates")
every rank's part of the optimizer state on rank 0, a collective every rank joins. On
load each rank reads the whole file and keeps its own part, so a checkpoint loads at any
world size, and into ``single`` or ``ddp`` too.

Example:
    >>> from gpufleet.parallel import strategy_names
    >>> "zero1" in strategy_names()
    True
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from gpufleet.config import ParallelConfig
from gpufleet.parallel.base import OptimizerSpec, Strategy
from gpufleet.parallel.ddp import DistributedDataParallel
from gpufleet.parallel.dims import ParallelDims, StrategyTraits

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer


class ZeroRedundancy(Strategy):
    """DDP-wrapped model (replicated by parallelize), optimizer state sharded by
    ``ZeroRedundancyOptimizer``."""

    name = "zero1"
    traits = StrategyTraits(reduces_in_backward=True, consolidates_optimizer=True,
                            data_parallel="replicate")
    needs_process_group = True

    def __init__(self, cfg: ParallelConfig, device: torch.device,
                 precision: Any = None, dims: ParallelDims | None = None) -> None:
        super().__init__(cfg, device, precision, dims)
        self._ddp = DistributedDataParallel(cfg, device, precision, dims)  # same wrapper

    def unwrap(self, model: nn.Module) -> nn.Module:
        return self._ddp.unwrap(model)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return self._ddp.no_sync(model)

    def keeps_optimizer(self) -> bool:
        return False  # it builds its own around the optimizer (or hooks it)

    def setup_optimizer(self, model: nn.Module, spec: OptimizerSpec) -> torch.optim.Optimizer:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        # Parameter groups (weight decay on matrices only) are kept: ZeRO shards each
        # group's parameters and passes the group's options to its local optimizer.
        return ZeroRedundancyOptimizer(spec.param_groups(self.unwrap(model)),
                                       optimizer_class=spec.cls, **spec.kwargs)

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """COLLECTIVE: every rank must call it. Rank 0 gets the whole optimizer state
        (in ``torch.optim`` form); the other ranks get an empty one."""
        _zero(optimizer).consolidate_state_dict(to=0)  # COLLECTIVE: each rank sends its part
        is_main = dist.get_rank() == 0
        return {"model": self.unwrap(model).state_dict(),
                "optimizer": optimizer.state_dict() if is_main else {}}

    def local_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer
                         ) -> dict[str, Any]:
        """The model and this rank's part of the optimizer state (its local optimizer's,
        over the parameters this rank updates), with no collective."""
        return {"model": self.unwrap(model).state_dict(),
                "optimizer": _zero(optimizer).optim.state_dict()}

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                        state: dict[str, Any]) -> None:
        """Every rank loads the whole state; the optimizer keeps this rank's part."""
        self.unwrap(model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])


def _zero(optimizer: torch.optim.Optimizer) -> ZeroRedundancyOptimizer:
    """The ``ZeroRedundancyOptimizer`` :meth:`ZeroRedundancy.setup_optimizer` built, which
    the Strategy interface hands back typed as any optimizer. A cast, not an isinstance
    check: ``torch.distributed.optim`` takes seconds to import, so only setup_optimizer
    imports it."""
    return cast("ZeroRedundancyOptimizer", optimizer)
