"""In-process recovery inside your own loop, in one process: with ``fault.snapshot_every``
the state the loop registered is snapshotted when the loop begins its next step; a lost
peer met in a Fleet call (here a backward that fails as gloo's all-reduce does when a
peer's connection closes) has the run's recovery put the snapshot back in place and
raises gpufleet.Recovered; the loop that continues ends with the weights, the count, the
schedule and the step of a run that never failed. The regroup over a new process group
after a real lost node (two bed nodes, `gpufleet run --nnodes 1:2`) is
tests/cluster/test_fleet_recovery.py's."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import gpufleet
from gpufleet.train.recovery.recovery import Recovery, is_peer_loss

PEER_LOST = "[gloo/transport/tcp/pair.cc:537] Read error [10.0.0.2]:4242: Connection reset by peer"


class _FailsOnce(torch.autograd.Function):
    """The identity, whose backward raises ``error`` (once)."""

    @staticmethod
    def forward(ctx, x, error):
        ctx.error = error
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise ctx.error


class _Toy(nn.Module):
    """A small regression model with dropout (its masks come from the RNG the snapshot
    holds); its ``fail_at``-th forward's backward raises ``error``."""

    def __init__(self, fail_at: int = 0, error: Exception | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 1))
        self.calls, self.fail_at, self.error = 0, fail_at, error

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        out = self.net(x)
        return _FailsOnce.apply(out, self.error) if self.calls == self.fail_at else out


def _alone(recovery: Recovery) -> None:
    """``recovery.recover`` does what the run's Recovery does on the one rank left after
    a lost peer, but its regroup (one process has no peer to lose): the newest snapshot
    put back through the recovery's own restore. ``recovery.seen``: their steps."""
    recovery.seen = []

    def recover(error: BaseException) -> bool:
        if not is_peer_loss(error):
            return False
        own = recovery.run.monitors.snapshots.snapshotter.own_copy(10.0)
        recovery.seen.append(own.step)
        recovery.restore(own.state(), f"the step-{own.step} in-memory snapshot")
        return True

    recovery.recover = recover


def _loop(fleet: gpufleet.Fleet, fail_at: int = 0, error: Exception | None = None) -> dict:
    """Two epochs of 32 samples in shuffled batches of 8 (8 steps), the state
    registered; Recovered continues the loop."""
    torch.manual_seed(0)
    net = _Toy(fail_at, error)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    model, optimizer, scheduler = fleet.setup(net, optimizer, scheduler=scheduler)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
    loader = fleet.setup_dataloaders(DataLoader(data, batch_size=8, shuffle=True))
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler,
             "loader": loader, "epoch": 0, "seen": []}
    fleet.register_state(state)
    recovered = []
    while state["epoch"] < 2:
        try:
            for x, y in loader:
                recovery = fleet.run.recovery  # built when the first step began
                if recovery is not None and not hasattr(recovery, "seen"):
                    _alone(recovery)
                fleet.backward(F.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
                state["seen"].append(round(float(x.sum()), 4))  # a plain value of yours
        except gpufleet.Recovered as back:
            recovered.append(back.step)
            continue
        state["epoch"] += 1
    return {"state": state, "recovered": recovered, "step": fleet.step,
            "weights": {k: v.clone() for k, v in model.state_dict().items()}}


def _fleet(run_dir, every: int = 1) -> gpufleet.Fleet:
    # ddp on one process: a process group of one rank, so the run builds its Recovery
    return gpufleet.Fleet(accelerator="cpu", strategy="ddp", seed=0, run_dir=str(run_dir),
                          log_every=4, overrides={"fault.snapshot_every": every})


def test_a_lost_peer_becomes_recovered_and_the_loop_ends_as_if_it_never_failed(tmp_path):
    want = _fleet(tmp_path / "straight").launch(_loop)
    assert want["recovered"] == [] and want["step"] == 8
    fleet = _fleet(tmp_path / "lost")
    # Step 5's backward (its 5th forward, the first of epoch 1) meets the lost peer: the
    # snapshot of step 4, taken when step 5 began (the loop's epoch count and the
    # loader's pass already at epoch 1), is put back and the loop reads step 5's batch
    # again.
    got = fleet.launch(_loop, 5, RuntimeError(PEER_LOST))
    assert got["recovered"] == [4] and fleet.run.recovery.seen == [4]
    assert got["step"] == 8 and got["state"]["epoch"] == 2
    assert got["state"]["seen"] == want["state"]["seen"]  # the failed step not counted
    assert got["state"]["scheduler"].last_epoch == 8
    for name, value in want["weights"].items():  # dropout's masks too: the RNG put back
        assert torch.equal(got["weights"][name], value), name
    # The log interval and the step's loss start again from the restored step.
    steps = [s for s, _ in fleet.run.result.losses]
    assert steps == sorted(set(steps)) and steps[-1] == 8, steps


def test_an_error_that_is_not_a_lost_peer_goes_on_as_it_was(tmp_path):
    fleet = _fleet(tmp_path / "run")
    try:
        with pytest.raises(ValueError, match="a mistake of the loop's"):
            fleet.launch(_loop, 3, ValueError("a mistake of the loop's"))
    finally:  # (an error leaves the process group of one rank Fleet joined)
        if dist.is_initialized():
            dist.destroy_process_group()
    assert fleet.run.recovery.seen == []


def test_a_snapshot_waits_for_the_loop_to_begin_its_next_step(tmp_path):
    """The step's end marks the snapshot due; it is taken at the next step's first
    phase, after the loop's scheduler step and count: the state a step boundary's."""
    fleet = _fleet(tmp_path / "run", every=2)
    net = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    model, optimizer = fleet.setup(net, optimizer)
    state = {"model": model, "optimizer": optimizer, "done": 0}
    fleet.register_state(state)
    snapshotter = None
    for _ in range(3):
        fleet.backward(model(torch.ones(2, 4)).sum())
        optimizer.step()
        optimizer.zero_grad()
        snapshotter = fleet.run.monitors.snapshots.snapshotter
        state["done"] += 1
    # Step 2 ended before its count; the snapshot was taken at step 3's forward.
    assert snapshotter.own_copy(10.0).step == 2
    assert snapshotter.own.state()["done"] == 2
    fleet.finish()


def test_a_loader_without_a_position_takes_no_snapshots_and_says_why(tmp_path, caplog):
    fleet = _fleet(tmp_path / "run")
    net = nn.Linear(4, 1)
    model, optimizer = fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    loader = fleet.setup_dataloaders(DataLoader(data, batch_size=8),
                                     use_distributed_sampler=False)
    with caplog.at_level(logging.WARNING, logger="gpufleet"):
        fleet.register_state({"model": model, "optimizer": optimizer, "data": loader})
    assert "'data' was set up with use_distributed_sampler=False" in caplog.text
    assert fleet.run.loop_state is None
    fleet.finish()


def test_a_regroup_places_every_set_up_model_again_and_the_loop_steps_on(tmp_path):
    """The recovery's rebuild over a new group (here the same one-rank group): the first
    optimizer's model and a second one (a GAN's) are wrapped in DDP again around the
    same modules of yours, each set-up wrapper runs its new one, and both train on."""
    fleet = _fleet(tmp_path / "run")
    try:
        nets = [nn.Linear(4, 1), nn.Linear(4, 1)]
        pairs = [fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
                 for net in nets]
        state = {f"model{i}": m for i, (m, _) in enumerate(pairs)}
        state.update({f"optimizer{i}": o for i, (_, o) in enumerate(pairs)})
        fleet.register_state(state)
        for model, optimizer in pairs:  # the first step builds the run's recovery
            fleet.backward(model(torch.ones(2, 4)).sum())
            optimizer.step()
            optimizer.zero_grad()
        before = [model.placed for model, _ in pairs]
        fleet.run.recovery.rebuild(0, 1)  # COLLECTIVE: DDP again over the group
        for (model, optimizer), net, old in zip(pairs, nets, before, strict=True):
            assert model.placed is not old and model.placed.module is net
            weight = net.weight.detach().clone()
            fleet.backward(model(torch.ones(2, 4)).sum())
            optimizer.step()
            optimizer.zero_grad()
            assert not torch.equal(net.weight, weight)  # trained through the new wrapper
        assert fleet._placed == [model.placed for model, _ in pairs]
    finally:
        fleet.finish()
