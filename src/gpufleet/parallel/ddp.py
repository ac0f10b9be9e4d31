"""``ddp``: ``DistributedDataParallel``, one process per device.

Gradients are all-reduced in buckets while backward is still running, so communication
overlaps compute. :func:`gpufleet.parallel.parallelize.parallelize` wraps the model
(:func:`gpufleet.parallel.data_parallel.replicate`, with the ``[parallel.ddp]`` bucket,
graph and communication-hook options); this strategy keeps the step-time hooks. With
gradient accumulation, the loop enters :meth:`no_sync` on all but the last micro-step so
that the all-reduce runs once per optimizer step.
"""

from __future__ import annotations

import contextlib

from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gpufleet.parallel.base import Strategy
from gpufleet.parallel.dims import StrategyTraits


class DistributedDataParallel(Strategy):
    """Whole replicas in DDP; ``no_sync`` during gradient accumulation."""

    name = "ddp"
    # tp > 1 replicates the split model with FSDP2 instead (fsdp.ReplicatedTensorParallel).
    traits = StrategyTraits(dims=frozenset({"dp_replicate", "tp"}), reduces_in_backward=True,
                            comm_hooks=True, tp_by_replicate_mesh=True,
                            data_parallel="replicate", several_models=True)
    needs_process_group = True

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DDP) else model

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return model.no_sync() if isinstance(model, DDP) else contextlib.nullcontext()
