"""Fleet against Accelerate itself: the same small loop under
``accelerate.Accelerator`` and under ``gpufleet.Fleet`` (accumulate, gather_for_metrics,
the data order of ``prepare`` on several ranks, unwrap_model)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

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


def _accelerates_ranks(n: int, batch_size: int, drop_last: bool, epochs: int):
    """What Accelerate's own ``prepare_data_loader`` gives process ``r`` of 2 (its
    batch sharding, run in this process for each ``r``), epoch by epoch, and torch's
    random state after (its loader draws from it too)."""
    out = []
    for rank in (0, 1):
        torch.manual_seed(7)  # a script seeded alike on every rank
        loader = accelerate.data_loader.prepare_data_loader(
            DataLoader(list(range(n)), batch_size=batch_size, shuffle=True,
                       drop_last=drop_last),
            num_processes=2, process_index=rank, put_on_device=False)
        out.append(([[b.tolist() for b in loader] for _ in range(epochs)], torch.rand(1)))
    return out


def _ours(rank: int, n: int, batch_size: int, drop_last: bool):
    """Fleet's order="accelerate" parts for rank ``rank`` of 2, as setup_dataloaders
    puts them together (its generator seeded from torch's random state)."""
    from gpufleet.fleet.loader import shard_loader
    from gpufleet.fleet.order import AccelerateOrder, accelerate_generator_state

    loader = DataLoader(list(range(n)), batch_size=batch_size, shuffle=True,
                        drop_last=drop_last)
    order = AccelerateOrder(loader.sampler, batch_size=batch_size, world_size=2,
                            drop_last=drop_last,
                            generator_state=accelerate_generator_state(loader.sampler))
    return shard_loader(loader, rank=rank, world_size=2, seed=0, order=order)


@pytest.mark.parametrize("drop_last", [False, True])
def test_accelerate_order_gives_each_rank_what_prepare_gives_it(drop_last):
    """``setup_dataloaders(order="accelerate")``: per rank and epoch, the batches
    Accelerate's prepare deals that process (whole batches of one shuffled order in
    turn, the last round completed from the epoch's first samples), and the same draws
    from torch's random state."""
    theirs = _accelerates_ranks(35, 4, drop_last, epochs=3)
    for rank in (0, 1):
        torch.manual_seed(7)
        loader, _ = _ours(rank, 35, 4, drop_last)
        ours = ([[b.tolist() for b in loader] for _ in range(3)], torch.rand(1))
        assert ours[0] == theirs[rank][0], rank
        assert torch.equal(ours[1], theirs[rank][1])
    assert theirs[0][0][0] != theirs[0][0][1]  # (the epochs are shuffled apart)


def test_accelerate_order_resumes_where_it_was_saved():
    """Saved in the middle of the second epoch, a new sampler reads the rest of it and
    the epoch after as the uninterrupted one does (each epoch's order is computed from
    the generator's state at setup)."""
    torch.manual_seed(7)
    loader, sampler = _ours(1, 35, 4, False)
    whole = [[b.tolist() for b in loader] for _ in range(3)]
    torch.manual_seed(7)
    loader, sampler = _ours(1, 35, 4, False)
    first = [b.tolist() for b in loader]
    it = iter(loader)
    taken = [next(it).tolist() for _ in range(2)]
    state = sampler.state_dict(consumed=8)  # 2 batches of 4 of epoch 1
    torch.manual_seed(7)
    resumed, fresh = _ours(1, 35, 4, False)
    fresh.load_state_dict(state)
    rest = [[b.tolist() for b in resumed] for _ in range(2)]
    assert [first, taken + rest[0], rest[1]] == whole


def test_order_is_checked_and_accelerates_takes_the_loaders_it_can_match(tmp_path):
    fleet = gpufleet.Fleet(accelerator="cpu", devices=1, run_dir=str(tmp_path / "run"))
    with pytest.raises(gpufleet.ConfigError, match=r"order.*'accelerate'"):
        fleet.setup_dataloaders(DataLoader(_data()), order="acelerate")
    weighted = DataLoader(_data(), batch_size=2, sampler=torch.utils.data.WeightedRandomSampler(
        [1.0] * 14, 14))
    with pytest.raises(gpufleet.ConfigError, match="WeightedRandomSampler"):
        fleet._accelerate_order(weighted, 2)  # (refused before anything is exchanged)
    # one process: both orders are the loader's own, as Accelerate leaves it there
    torch.manual_seed(3)
    theirs = [b[0].tolist() for b in DataLoader(_data(), batch_size=4, shuffle=True)]
    torch.manual_seed(3)
    ours = [b[0].tolist() for b in fleet.setup_dataloaders(
        DataLoader(_data(), batch_size=4, shuffle=True), order="accelerate")]
    assert ours == theirs
    fleet.finish()


def test_unwrap_model_is_the_set_up_models_module(tmp_path):
    """``accelerator.unwrap_model(model)`` is the user's own module; so is a set-up
    model's ``.module`` (also under ddp, where the placed model is DDP's wrapper)."""
    acc = accelerate.Accelerator(cpu=True)
    net = _net()
    assert acc.unwrap_model(acc.prepare(net)) is net
    fleet = gpufleet.Fleet(accelerator="cpu", devices=1, strategy="ddp",
                           run_dir=str(tmp_path / "run"))
    mine = _net()
    model = fleet.setup(mine)
    assert model.module is mine and type(model.placed).__name__ == "DistributedDataParallel"
    fleet.finish()


def _on_two_ranks(which: str, out: Path) -> dict:
    """tests/fleet/accelerate_ranks.py under ``which`` on the 2 ranks torchrun starts
    (a port of its own); the whole process group is ended if it overruns."""
    script = Path(__file__).with_name("accelerate_ranks.py")
    run = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            "--nproc_per_node", "2", str(script), which, str(out)],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    try:
        output, _ = run.communicate(timeout=240)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    assert run.returncode == 0, output[-4000:]
    return torch.load(out, weights_only=True)


# Slow (two torchrun jobs of 2 ranks, about 30 s on 2 cores); in the default run
# test_accumulate_steps_as_accelerates_does (one rank), test_accelerate_order_gives_each_
# rank_what_prepare_gives_it and test_group_and_named_barrier_on_two_ranks (2 ranks, the
# order against prepare_data_loader's) keep its promise part by part.
@pytest.mark.slow
def test_an_accumulating_loop_on_two_ranks_trains_as_accelerates_does(tmp_path):
    """The same loop under Accelerate and under Fleet (order="accelerate",
    gradient_accumulation_steps=3) on 2 ranks: the same samples, the optimizer steps
    after the same micro-batches, the same weights."""
    theirs = _on_two_ranks("accelerate", tmp_path / "accelerate.pt")
    ours = _on_two_ranks("fleet", tmp_path / "fleet.pt")
    assert ours["seen"] == theirs["seen"]
    assert ours["stepped"] == theirs["stepped"] == [3, 4, 7, 8]
    assert ours["syncs"] == theirs["syncs"]
    for a, b in zip(ours["weights"], theirs["weights"], strict=True):
        assert torch.allclose(a, b, atol=1e-7)
