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
    traits = StrategyTraits(reduces_in_backward=True)
    needs_process_group = True

    def setup_model(self, model: nn.Module) -> nn.Module:
        model = model.to(self.device)
        cfg = self.cfg
        return DDP(
            model,
            # None on CPU: the module stays where it is, gloo reduces host tensors.
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            bucket_cap_mb=cfg.bucket_cap_mb,
            static_graph=cfg.static_graph,
            gradient_as_bucket_view=cfg.gradient_as_bucket_view,
            find_unused_parameters=cfg.find_unused_parameters,
            **{_SYNC_BUFFERS: cfg.broadcast_buffers},
        )

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DDP) else model

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return model.no_sync() if isinstance(model, DDP) else contextlib.nullcontext()
