"""The CUDA paths of your own loop and of in-memory snapshots: ``Fleet`` on one GPU in
bf16 (the same losses as the plain-PyTorch loop it replaces, phases timed by CUDA
events, the run's files; its guard on a fused optimizer's flag is a case of
tests/fleet/test_fleet.py), and the snapshot's pinned buffers filled on a side stream
while the next step's kernels run. Skipped without CUDA (tests/conftest.py)."""

from __future__ import annotations

import json

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import gpufleet
from gpufleet.fault.snapshot import Snapshotter, storage_of

pytestmark = pytest.mark.gpu


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 1))


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 32, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=32)


def _plain_losses() -> list[float]:
    """The loop as plain PyTorch writes it: bf16 autocast on cuda:0, SGD."""
    model = _net().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    for x, y in _loader():
        x, y = x.cuda(), y.cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_fleet_on_a_gpu_in_bf16_matches_the_plain_loop_and_writes_its_files(tmp_path):
    run = tmp_path / "run"
    fleet = gpufleet.Fleet(accelerator="cuda", devices=1, precision="bf16-mixed",
                           run_dir=str(run), log_every=4)
    net = _net()
    model, opt = fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
    assert next(model.parameters()).device.type == "cuda"
    losses = []
    for x, y in fleet.setup_dataloaders(_loader()):
        assert x.device.type == "cuda"
        loss = F.mse_loss(model(x), y)
        assert loss.dtype == torch.float32  # autocast: the loss of a bf16 output, in fp32
        fleet.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    fleet.finish()
    assert losses == pytest.approx(_plain_losses(), rel=1e-3, abs=1e-4)
    assert {"diagnosis.json", "report.html", "metrics.jsonl"} <= {p.name for p in run.iterdir()}
    train = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in train if r.get("kind") == "train"]
    assert [r["step"] for r in train] == [4, 8]
    # The phases the loop's calls mark are timed on the GPU too (CUDA events).
    late = train[1:]
    assert all(r["device_phases"]["forward"] > 0 and r["device_phases"]["backward"] > 0
               for r in late), late


def test_fabrics_helpers_on_a_gpu(tmp_path):
    """all_gather, broadcast, autocast and to_device on cuda, and log_dict of a cuda
    tensor (read on the host)."""
    fleet = gpufleet.Fleet(accelerator="cuda", devices=1, precision="bf16-mixed",
                           run_dir=str(tmp_path / "run"))
    gathered = fleet.all_gather({"x": torch.ones(2), "n": 3})
    assert gathered["x"].device.type == "cuda" and gathered["x"].shape == (1, 2)
    assert fleet.to_device([torch.ones(1)])[0].device.type == "cuda"
    assert fleet.broadcast({"t": 1}) == {"t": 1}
    with fleet.autocast():
        assert (torch.ones(2, 2, device="cuda") @ torch.ones(2, 2, device="cuda")).dtype \
            == torch.bfloat16
    model = fleet.setup_module(_net())
    opt = fleet.setup_optimizers(torch.optim.AdamW(model.parameters(), fused=True))
    x = torch.randn(4, 32, device="cuda")
    fleet.backward(model(x).float().square().mean())
    opt.step()
    fleet.log("acc", torch.tensor(0.5, device="cuda"))
    fleet.finish()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert any(json.loads(line).get("acc") == 0.5 for line in lines)


def test_init_module_builds_on_the_gpu_and_load_raw_fills_it(tmp_path):
    """A model built under init_module(empty_init=True) is on cuda from the start; a
    plain PyTorch file saved on the host loads into it after setup."""
    plain = _net()
    torch.save(plain.state_dict(), tmp_path / "plain.pt")
    fleet = gpufleet.Fleet(accelerator="cuda", devices=1, run_dir=str(tmp_path / "run"))
    with fleet.init_module(empty_init=True):
        model = _net()
        assert all(p.device.type == "cuda" for p in model.parameters())
    model = fleet.setup(model)
    fleet.load_raw(tmp_path / "plain.pt", model)
    for a, b in zip(plain.parameters(), model.parameters(), strict=True):
        assert b.device.type == "cuda" and torch.equal(a, b.cpu())
    fleet.finish()


def test_a_snapshot_of_cuda_state_holds_the_step_while_the_next_step_changes_it():
    """The parameter (changed only by the optimizer step) is copied on the side stream;
    the buffer (changed by the next forward) on the training stream. Both are changed
    right after ``take``, in kernel order, with no host sync between: the pinned host
    copy still holds the values of the snapshot's step."""
    snap = Snapshotter(0, torch.device("cuda"))
    weight = torch.randn(4096, 4096, device="cuda")  # 64 MB: the copy takes a while
    buffer = torch.arange(1000, device="cuda", dtype=torch.float32)
    state = {"model": {"weight": weight, "running": buffer}, "step": 7}
    expected = {"weight": weight.cpu(), "running": buffer.cpu()}
    snap.take(7, state, {storage_of(weight)})
    buffer.mul_(-1)  # the next forward, queued on the training stream
    snap.wait_copied()  # the optimizer step waits for the side stream, on the device
    weight.add_(1.0)
    assert snap.wait(60) and not snap.errors
    assert snap.own.buffer.is_pinned()
    held = snap.own.state()
    assert held["step"] == 7 and snap.own.step == 7
    assert torch.equal(held["model"]["weight"], expected["weight"])
    assert torch.equal(held["model"]["running"], expected["running"])
    torch.cuda.synchronize()
    assert torch.equal(weight.cpu(), expected["weight"] + 1.0)


def test_a_run_on_cuda_takes_snapshots_and_reports_their_memory(fit_cuda):
    _, cap = fit_cuda({"fault.snapshot_every": 5, "log.every": 10})
    logged = [m for m in cap.logs if "snapshot_mb" in m]
    assert logged and logged[-1]["snapshot_mb"] > 0, cap.logs[-1]
