"""The built-in schedule: a constant one only counts its steps, with LambdaLR's state."""

from __future__ import annotations

import torch

from gpufleet.config import OptimConfig
from gpufleet.train.optim import ConstantSchedule, build_scheduler


def _opt() -> torch.optim.Optimizer:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2))]
    return torch.optim.SGD([{"params": params[:1]}, {"params": params[1:], "lr": 0.5}],
                           lr=0.1)


def test_a_constant_schedule_steps_like_lambdalr_at_factor_one():
    cfg = OptimConfig(warmup_steps=0, decay="constant")
    fast_opt, ref_opt = _opt(), _opt()
    fast = build_scheduler(fast_opt, cfg, max_steps=100)
    ref = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda step: 1.0)
    assert isinstance(fast, ConstantSchedule)
    for _ in range(7):
        fast_opt.step()
        ref_opt.step()
        fast.step()
        ref.step()
    assert [g["lr"] for g in fast_opt.param_groups] == [0.1, 0.5]
    assert fast.get_last_lr() == ref.get_last_lr() == [0.1, 0.5]
    assert fast.state_dict() == ref.state_dict()  # last_epoch 7, the same keys
    # A checkpoint of either loads into the other and goes on counting.
    ref.load_state_dict(fast.state_dict())
    again = ConstantSchedule(_opt(), lambda step: 1.0)
    again.load_state_dict(ref.state_dict())
    again.step()
    assert again.last_epoch == 8


def test_a_schedule_with_warmup_or_decay_is_torchs_lambdalr():
    for cfg in (OptimConfig(warmup_steps=5, decay="constant"),
                OptimConfig(warmup_steps=0, decay="cosine", min_lr_ratio=0.1)):
        sched = build_scheduler(_opt(), cfg, max_steps=100)
        assert type(sched) is torch.optim.lr_scheduler.LambdaLR
