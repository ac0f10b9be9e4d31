"""``dp``: ``nn.DataParallel``, one process driving every visible GPU.

Kept because users ask for it. It is slower than ``ddp`` even on one machine: every step
it copies the parameters from GPU 0 to the others, scatters the batch from GPU 0, gathers
the outputs back and sums the gradients on GPU 0, all from one Python thread under the
GIL. GPU 0 therefore carries more memory and work than the rest.
:func:`gpufleet.parallel.parallelize.parallelize` wraps the model
(:func:`gpufleet.parallel.data_parallel.replicate_in_threads`); this strategy unwraps it.
"""

from __future__ import annotations

from torch import nn

from gpufleet.parallel.base import Strategy
from gpufleet.parallel.data_parallel import AutocastReplica
from gpufleet.parallel.dims import StrategyTraits


class DataParallel(Strategy):
    """Replicate the model over all visible GPUs from one process."""

    name = "dp"
    traits = StrategyTraits(one_process=True, needs_cuda=True, wraps="nn.DataParallel",
                            copies_module_each_step=True, data_parallel="threads")

    def unwrap(self, model: nn.Module) -> nn.Module:
        if isinstance(model, nn.DataParallel):
            model = model.module
        return model.module if isinstance(model, AutocastReplica) else model
