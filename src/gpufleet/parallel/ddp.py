"""``ddp``: ``DistributedDataParallel``, one process per device.

Gradients are all-reduced in buckets while backward is still running, so communication
overlaps compute. With gradient accumulation, the loop enters :meth:`no_sync` on all but
the last micro-step so that the all-reduce runs once per optimizer step.
"""

from __future__ import annotations

import contextlib
import inspect

from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gpufleet.parallel.base import Strategy
from gpufleet.parallel.dims import StrategyTraits

# Rank 0's buffers (BatchNorm statistics) to every rank before each forward. Newer torch
# names the option forward_sync_buffers and warns on the old name; the buffers are then
# also synced when DDP is built, which gpufleet's identically seeded models do not mind.
_SYNC_BUFFERS = ("forward_sync_buffers" if "forward_sync_buffers"
                 in inspect.signature(DDP.__init__).parameters else "broadcast_buffers")


class DistributedDataParallel(Strategy):
    """Wrap the model in DDP with the ``[parallel]`` bucket and graph options."""

    name = "ddp"
    # tp > 1 replicates the split model with FSDP2 instead (fsdp.ReplicatedTensorParallel).
    traits = StrategyTraits(dims=frozenset({"dp_replicate", "tp"}), reduces_in_backward=True,
                            comm_hooks=True, tp_by_replicate_mesh=True)
    needs_process_group = True

    def setup_model(self, model: nn.Module) -> nn.Module:
        model = model.to(self.device)
        cfg = self.cfg
        ddp = DDP(
            model,
            # None on CPU: the module stays where it is, gloo reduces host tensors.
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            bucket_cap_mb=cfg.ddp.bucket_cap_mb,
            static_graph=cfg.ddp.static_graph,
            gradient_as_bucket_view=cfg.ddp.gradient_as_bucket_view,
            find_unused_parameters=cfg.ddp.find_unused_parameters,
            **{_SYNC_BUFFERS: cfg.ddp.broadcast_buffers},
        )
        register_comm_hook(ddp, cfg.ddp.comm_hook, cfg.ddp.powersgd_rank,
                           cfg.ddp.powersgd_start_step)
        return ddp

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DDP) else model

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return model.no_sync() if isinstance(model, DDP) else contextlib.nullcontext()


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
