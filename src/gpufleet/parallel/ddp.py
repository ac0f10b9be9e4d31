"""``ddp``: ``DistributedDataParallel``, one process per device.

Gradients are all-reduced in buckets while backward is still running, so communication
overlaps compute. With gradient accumulation, the loop enters :meth:`no_sync` on all but
the last micro-step so that the all-reduce runs once per optimizer step.
"""

from __future__ import annotations

import contextlib

from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gpufleet.parallel.base import Strategy


class DistributedDataParallel(Strategy):
    """Wrap the model in DDP with the ``[parallel]`` bucket and graph options."""

    name = "ddp"
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
            broadcast_buffers=cfg.broadcast_buffers,
        )

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DDP) else model

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return model.no_sync() if isinstance(model, DDP) else contextlib.nullcontext()
