"""Fleet against Accelerate itself: the same small loop under
``accelerate.Accelerator`` and under ``gpufleet.Fleet`` (accumulate, gather_for_metrics)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import gpufleet

accelerate = pytest.importorskip("accelerate")


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(14, 4, generator=g), torch.randn(14, 1, generator=g))


def _accumulating_loop(prepare, backward, accumulate, sync):
    """Accelerate's documented loop: step, zero_grad and the scheduler on every
    micro-batch, inside accumulate(model); 7 batches of 2, 3 per step."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    model, opt, loader = prepare(net, opt, DataLoader(_data(), batch_size=2))
    inner = getattr(opt, "optimizer", opt)
    stepped = []
    inner.register_step_post_hook(lambda *_: stepped.append(len(seen)))
    seen, syncs = [], []
    for x, y in loader:
        with accumulate(model):
            seen.append(x[0, 0].item())
            backward(F.mse_loss(model(x), y))
            syncs.append(sync())
            opt.step()
            opt.zero_grad()
    return stepped, syncs, [p.detach().clone() for p in net.parameters()]


def test_accumulate_steps_as_accelerates_does(tmp_path):
    """Loss divided by the steps, optimizer.step and zero_grad acting on every 3rd
    micro-batch and on the loader's last one, the same weights as Accelerate's."""
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=3)
    theirs = _accumulating_loop(lambda m, o, d: acc.prepare(m, o, d), acc.backward,
                                acc.accumulate, lambda: acc.sync_gradients)
    fleet = gpufleet.Fleet(accelerator="cpu", devices=1, run_dir=str(tmp_path / "run"),
                           gradient_accumulation_steps=3)

    def prepare(m, o, d):
        model, opt = fleet.setup(m, o)
        return model, opt, fleet.setup_dataloaders(d)

    ours = _accumulating_loop(prepare, fleet.backward, fleet.accumulate,
                              lambda: fleet.sync_gradients)
    assert ours[0] == theirs[0] == [3, 6, 7]  # after the 3rd, 6th and last micro-batch
    assert ours[1] == theirs[1]
    for a, b in zip(ours[2], theirs[2], strict=True):
        assert torch.allclose(a, b, atol=1e-7)
    assert fleet.step == 3
    fleet.finish()


def test_gather_for_metrics_in_one_process_is_accelerates(tmp_path):
    """One rank: every value once, as Accelerate's gather_for_metrics gives it."""
    acc = accelerate.Accelerator(cpu=True)
    fleet = gpufleet.Fleet(accelerator="cpu", devices=1, run_dir=str(tmp_path / "run"))
    loaders = (acc.prepare(DataLoader(_data(), batch_size=4)),
               fleet.setup_dataloaders(DataLoader(_data(), batch_size=4)))
    out = []
    for loader, gather in zip(loaders, (acc.gather_for_metrics, fleet.gather_for_metrics),
                              strict=True):
        out.append(torch.cat([gather(x[:, 0]) for x, _ in loader]))
    assert torch.equal(out[0], out[1]) and len(out[1]) == 14
    fleet.finish()
