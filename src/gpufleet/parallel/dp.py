"""``dp``: ``nn.DataParallel``, one process driving every visible GPU.

Kept because users ask for it. It is slower than ``ddp`` even on one machine: every step
it copies the parameters from GPU 0 to the others, scatters the batch from GPU 0, gathers
the outputs back and sums the gradients on GPU 0, all from one Python thread under the
GIL. GPU 0 therefore carries more memory and work than the rest.
"""

from __future__ import annotations

from torch import nn

from gpufleet.parallel.base import Strategy


class DataParallel(Strategy):
    """Replicate the model over all visible GPUs from one process."""

    name = "dp"

    def setup_model(self, model: nn.Module) -> nn.Module:
        # Inputs go to cuda:0; DataParallel scatters them along dim 0 every forward.
        return nn.DataParallel(model.to(self.device))

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, nn.DataParallel) else model
