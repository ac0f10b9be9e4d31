"""``horovod``: Horovod's ring all-reduce through its ``DistributedOptimizer``.

For clusters that already run Horovod. Start the job with Horovod's own launcher, one
process per GPU, and no ``--nproc`` (Horovod starts the processes and wires them up)::

    horovodrun -np 4 -H host1:2,host2:2 gpufleet train --strategy horovod ...

What the strategy does, in order: ``hvd.init()`` (the trainer has already pinned the
process to GPU ``HOROVOD_LOCAL_RANK``); build the optimizer, wrap it in
``hvd.DistributedOptimizer`` (gradients all-reduced by hooks during backward, averaged
over ranks; with gradient accumulation only the last backward of a step reduces) and
broadcast rank 0's parameters (and optimizer state, if it has any) so every rank starts
identical. After the last backward of a step it waits for the all-reduce
(``optimizer.synchronize()``), so loss-scale unscaling, clipping and the non-finite
check all see the averaged gradients, and the step that follows runs under
``skip_synchronize()``. Reductions of the loop's statistics use ``hvd.allreduce``.

gpufleet's own book-keeping (one run directory, RNG states, the watchdog's heartbeats)
still goes through a small Gloo process group, whose address the ranks agree on through
Horovod (:func:`gpufleet.launch.init_process_group`).

Horovod is optional: without it, building the strategy raises an error naming the
install step.

Example:
    >>> horovod_available() in (True, False)
    True
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from gpufleet.errors import ConfigError, GpufleetError
from gpufleet.launch.env import DistEnv
from gpufleet.launch.process_group import HOROVOD_INSTALL as INSTALL
from gpufleet.parallel.base import OptimizerSpec, Strategy
from gpufleet.parallel.dims import StrategyTraits

log = logging.getLogger(__name__)

def horovod_available() -> bool:
    """Whether ``horovod.torch`` can be imported here (without importing it)."""
    try:
        return importlib.util.find_spec("horovod.torch") is not None
    except ImportError:  # no `horovod` package at all, or one that fails to import
        return False


def _import_hvd() -> Any:
    try:
        import horovod.torch as hvd  # optional dependency
    except ImportError as e:
        raise GpufleetError(
            f"parallel.strategy = 'horovod' needs Horovod's PyTorch API, which is not "
            f"installed here ({e}). Install it with: {INSTALL}; then start the run with "
            "horovodrun -np N gpufleet train --strategy horovod. Or use --strategy ddp, "
            "which needs nothing extra.") from e
    return hvd


class Horovod(Strategy):
    """Data parallel with Horovod's ``DistributedOptimizer`` (launched by ``horovodrun``)."""

    name = "horovod"
    # Horovod reduces the gradients and the loop's statistics; the process group only
    # carries gpufleet's book-keeping, which needs no NCCL communicator beside Horovod's.
    traits = StrategyTraits(backend="gloo", ranks_started_elsewhere=True,
                            data_parallel="optimizer")

    def __init__(self, cfg: Any, device: torch.device, precision: Any = None,
                 dims: Any = None) -> None:
        self.hvd = _import_hvd()
        self.hvd.init()  # the device is already this rank's: its local rank's GPU
        world = DistEnv.detect().world_size
        if self.hvd.size() != world:
            raise ConfigError(
                f"parallel.strategy = 'horovod' in a job of {world} ranks, but Horovod sees "
                f"{self.hvd.size()}: ranks that another launcher (--nproc, torchrun, srun) "
                "started cannot find each other through Horovod, so each would train alone. "
                f"Start them with Horovod's launcher: horovodrun -np {world} gpufleet train "
                "--strategy horovod ... (without --nproc).")
        super().__init__(cfg, device, precision, dims)
        self._optimizer: Any = None
        self._accumulating = False  # inside no_sync: a micro-step that is not the last
        self._skip: Any = None  # the open skip_synchronize() context until the step ends
        if self.hvd.rank() == 0:
            log.info("horovod: %d rank(s), %d on this node", self.hvd.size(),
                     self.hvd.local_size())

    def keeps_optimizer(self) -> bool:
        return False  # it builds its own around the optimizer (or hooks it)

    def setup_optimizer(self, model: nn.Module, spec: OptimizerSpec) -> torch.optim.Optimizer:
        hvd = self.hvd
        optimizer = spec.build(model)
        # COLLECTIVE: rank 0's weights and optimizer state to every rank.
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        optimizer = hvd.DistributedOptimizer(optimizer,
                                             named_parameters=model.named_parameters(),
                                             op=hvd.Average,
                                             backward_passes_per_step=spec.accumulation)
        if optimizer.state_dict()["state"]:
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        # A new optimizer has no state to share. Horovod would create it by a step with
        # zero gradients, which is not neutral: AdamW's weight decay shrinks the weights
        # and the bias correction starts one step late. (A resumed run's state comes
        # from the checkpoint, which every rank loads.)
        self._optimizer = optimizer
        return optimizer

    def data_shard(self, rank: int, world_size: int) -> tuple[int, int]:
        return self.hvd.rank(), self.hvd.size()

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        # Horovod's hooks count the backward passes themselves (backward_passes_per_step)
        # and reduce on the last; this only tells forward_backward not to wait yet.
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    def forward_backward(self, model: nn.Module, batch: Any, loss_fn: Callable[..., Any],
                         precision: Any, loss_scale: float,
                         mark: Callable[[], None] | None = None) -> torch.Tensor:
        loss = super().forward_backward(model, batch, loss_fn, precision, loss_scale, mark)
        if not self._accumulating and self._optimizer is not None:
            # COLLECTIVE: wait for the gradient all-reduce the hooks started, before
            # anything reads the gradients; the step must then not reduce again.
            self._optimizer.synchronize()
            self._skip = self._optimizer.skip_synchronize()
            self._skip.__enter__()
        return loss

    def after_optimizer_step(self, model: nn.Module, step: int) -> None:
        # Runs after every step, taken or skipped as non-finite.
        if self._skip is not None:
            self._skip.__exit__(None, None, None)
            self._skip = None

    def reduces(self) -> bool:
        return self.hvd.size() > 1

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", group: Any = None
                   ) -> torch.Tensor:
        """Reduce ``tensor`` in place over every Horovod rank; ``group`` must be None
        (Horovod's allreduce knows no ``torch.distributed`` process group)."""
        if group is not None:
            raise ConfigError(
                f"all_reduce(group={group!r}) under parallel.strategy = 'horovod': Horovod "
                "reduces over every rank and takes no torch.distributed process group. "
                "Leave group=None, or use --strategy ddp for reductions over a group.")
        if self.reduces():
            ops = {"sum": self.hvd.Sum, "max": self.hvd.Max, "min": self.hvd.Min}
            tensor.copy_(self.hvd.allreduce(tensor, op=ops[op]))  # COLLECTIVE
        return tensor
