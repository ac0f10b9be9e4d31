"""``dp``: ``nn.DataParallel``, one process driving every visible GPU.

Kept because users ask for it. It is slower than ``ddp`` even on one machine: every step
it copies the parameters from GPU 0 to the others, scatters the batch from GPU 0, gathers
the outputs back and sums the gradients on GPU 0, all from one Python thread under the
GIL. GPU 0 therefore carries more memory and work than the rest.
"""

from __future__ import annotations

import torch
from torch import nn

from gpufleet.parallel.base import Strategy
from gpufleet.parallel.dims import StrategyTraits


class _AutocastReplica(nn.Module):
    """Runs the wrapped module's forward under autocast with the run's dtype.

    DataParallel runs each replica in its own thread, and autocast's dtype is per thread:
    torch's replica threads re-enter autocast with the default dtype (float16), not the
    caller's (e.g. bfloat16). Entering it inside the replica keeps the run's dtype.
    """

    def __init__(self, module: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.module = module
        self.dtype = dtype

    def forward(self, *args, **kwargs):
        with torch.autocast("cuda", dtype=self.dtype):
            return self.module(*args, **kwargs)


class DataParallel(Strategy):
    """Replicate the model over all visible GPUs from one process."""

    name = "dp"
    traits = StrategyTraits(one_process=True, needs_cuda=True, wraps="nn.DataParallel",
                            copies_module_each_step=True)

    def setup_model(self, model: nn.Module) -> nn.Module:
        model = model.to(self.device)
        dtype = getattr(self.precision, "autocast_dtype", None)
        inner = _AutocastReplica(model, dtype) if dtype is not None else model
        # Inputs go to cuda:0; DataParallel scatters them along dim 0 every forward.
        return nn.DataParallel(inner)

    def unwrap(self, model: nn.Module) -> nn.Module:
        if isinstance(model, nn.DataParallel):
            model = model.module
        return model.module if isinstance(model, _AutocastReplica) else model
