"""``fleet.forward_backward`` (gpufleet.fleet.schedule) in one process: the strategy's own
forward and backward under single (with Accelerate's accumulation) and a pipeline of one
stage equal the plain loop; a pipeline stage refuses a training forward. The 2-rank
pipelines, model_parallel, the GAN under fsdp and the stream are in
tests/examples/test_own_loop.py (one launch)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gpufleet


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g))
            for _ in range(4)]


def _plain(accumulate: int) -> dict[str, torch.Tensor]:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, (x, y) in enumerate(_batches()):
        (F.mse_loss(model(x), y) / accumulate).backward()
        if (i + 1) % accumulate == 0:
            opt.step()
            opt.zero_grad()
    return model.state_dict()


@pytest.mark.parametrize("strategy, accumulate", [("single", 2), ("pipeline", 1)])
def test_forward_backward_trains_as_the_plain_loop(tmp_path, strategy, accumulate):
    fleet = gpufleet.Fleet(accelerator="cpu", devices=1, strategy=strategy,
                           run_dir=str(tmp_path / "run"),
                           gradient_accumulation_steps=accumulate,
                           overrides={"parallel.pipeline.microbatches": 2})
    net = _net()
    model, opt = fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    losses = []
    for batch in _batches():
        with fleet.accumulate(model):
            losses.append(fleet.forward_backward(model, batch, F.mse_loss))
            opt.step()
            opt.zero_grad()
    for name, value in _plain(accumulate).items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=1e-6, atol=1e-7)
    assert fleet.step == 4 // accumulate and all(loss.requires_grad is False
                                                 for loss in losses)
    if strategy == "pipeline":
        with pytest.raises(gpufleet.ConfigError, match=r"fleet\.forward_backward"):
            model(_batches()[0][0])  # a training forward of a stage
        model.eval()
        with torch.no_grad():  # the whole model's output (here one stage)
            assert model(_batches()[0][0]).shape == (4, 1)
    fleet.finish()


def test_forward_backward_takes_set_up_models_only(tmp_path):
    fleet = gpufleet.Fleet(accelerator="cpu", devices=1, run_dir=str(tmp_path / "run"))
    with pytest.raises(TypeError, match=r"fleet\.setup returned"):
        fleet.forward_backward(_net(), _batches()[0], F.mse_loss)
    fleet.finish()
