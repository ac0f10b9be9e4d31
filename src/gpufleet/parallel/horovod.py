"""``horovod``: Horovod's ring all-reduce through its ``DistributedOptimizer``.

For clusters that already run Horovod. Start the job with Horovod's own launcher, one
process per GPU, and no ``--nproc`` (Horovod starts the processes and wires them up)::

    horovodrun -np 4 -H host1:2,host2:2 gpufleet train --strategy horovod ...

What the strategy does, in order: ``hvd.init()`` and pin this process to GPU
``hvd.local_rank()``; build the optimizer, wrap it in ``hvd.DistributedOptimizer``
(gradients all-reduced by hooks during backward, averaged over ranks) and broadcast
rank 0's parameters and optimizer state so every rank starts identical. Clipping calls
``optimizer.synchronize()`` first so the norm is taken over the averaged gradients, and
the step that follows runs under ``skip_synchronize()``.
Reductions of the loop's statistics use ``hvd.allreduce``.

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
from typing import Any

import torch
from torch import nn

from gpufleet.errors import GpufleetError
from gpufleet.parallel.base import OptimizerSpec, Strategy

log = logging.getLogger(__name__)

INSTALL = ("HOROVOD_WITH_PYTORCH=1 pip install horovod[pytorch] (add HOROVOD_GPU_OPERATIONS="
           "NCCL for GPUs; it builds against the installed torch)")


def horovod_available() -> bool:
    """Whether ``horovod.torch`` can be imported here (without importing it)."""
    try:
        return importlib.util.find_spec("horovod.torch") is not None
    except ModuleNotFoundError:  # no `horovod` package at all
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

    def __init__(self, cfg: Any, device: torch.device, precision: Any = None) -> None:
        self.hvd = _import_hvd()
        self.hvd.init()
        if device.type == "cuda":
            device = torch.device("cuda", self.hvd.local_rank())
            torch.cuda.set_device(device)
        super().__init__(cfg, device, precision)
        self._optimizer: Any = None
        self._skip: Any = None  # the open skip_synchronize() context between clip and step
        if self.hvd.rank() == 0:
            log.info("horovod: %d rank(s), %d on this node", self.hvd.size(),
                     self.hvd.local_size())

    def setup_optimizer(self, model: nn.Module, spec: OptimizerSpec) -> torch.optim.Optimizer:
        hvd = self.hvd
        optimizer = spec.build(model)
        # COLLECTIVE: rank 0's weights and optimizer state to every rank.
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        optimizer = hvd.DistributedOptimizer(optimizer,
                                             named_parameters=model.named_parameters(),
                                             op=hvd.Average)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        self._optimizer = optimizer
        return optimizer

    def data_shard(self, rank: int, world_size: int) -> tuple[int, int]:
        return self.hvd.rank(), self.hvd.size()

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        # Horovod reduces in backward hooks; accumulation steps still reduce each time,
        # which is correct (averages add up) but not free.
        return contextlib.nullcontext()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        if self._optimizer is not None:
            self._optimizer.synchronize()  # COLLECTIVE: finish the gradient all-reduce
            # The step must not reduce again; the context ends after the step.
            self._skip = self._optimizer.skip_synchronize()
            self._skip.__enter__()
        return super().clip_grad_norm(model, max_norm)

    def after_optimizer_step(self, model: nn.Module, step: int) -> None:
        if self._skip is not None:
            self._skip.__exit__(None, None, None)
            self._skip = None

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.hvd.size() > 1:
            ops = {"sum": self.hvd.Sum, "max": self.hvd.Max, "min": self.hvd.Min}
            tensor.copy_(self.hvd.allreduce(tensor, op=ops[op]))  # COLLECTIVE
        return tensor
