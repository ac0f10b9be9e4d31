"""The loop's own bookkeeping: when a step's FLOPs are counted, and what they count."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset
from torch.utils.flop_counter import FlopCounterMode

import gpufleet


class _Seen(gpufleet.Callback):
    def __init__(self) -> None:
        self.flops: list[int | None] = []

    def on_step_end(self, view, step):
        self.flops.append(view.flops_per_step)


def test_flops_are_counted_on_the_second_step_over_its_micro_steps(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    x = torch.randn(64, 16)
    data = TensorDataset(x, x.sum(1, keepdim=True))
    with FlopCounterMode(display=False) as expected:  # one step's forward and backward
        F.mse_loss(model(x[:8]), x[:8].sum(1, keepdim=True)).backward()
    model.zero_grad()
    seen = _Seen()
    gpufleet.fit(model, data, loss_fn=F.mse_loss, callbacks=[seen],
                 overrides={"run.out_dir": str(tmp_path), "run.max_steps": 4,
                            "data.batch_size": 4, "optim.grad_accum": 2,
                            "log.progress": "off", "monitor.report": False,
                            "run.eval_every": 0})
    # Not on the first step (it answers as fast as without monitoring); on the second,
    # both micro-steps of 4 samples: the 8 samples counted above.
    assert seen.flops[0] is None
    assert seen.flops[1:] == [expected.get_total_flops()] * 3
