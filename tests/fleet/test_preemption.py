"""Preemption in your own loop, in one process: a stop signal becomes a checkpoint of
the registered state (else of the state the loop saved last) in the run directory when
the loop begins its next step, the run ends and SystemExit(75) leaves the loop; a Fleet
made again with resume="auto" finds it. A stop a callback asks for is the loop's to act
on (fleet.should_stop). The 2-rank run (a signal to one rank, both stopping at the same
step, the resume bit for bit) is tests/examples/test_own_loop.py's."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import gpufleet
from gpufleet.core.callbacks import Callback


def _fleet(run_dir, **kwargs) -> gpufleet.Fleet:
    return gpufleet.Fleet(accelerator="cpu", seed=0, run_dir=str(run_dir), log_every=2,
                          resume="auto", overrides={"fault.preempt_check_every": 1},
                          **kwargs)


def _loop(fleet: gpufleet.Fleet, register: bool, signal_after: int | None = None,
          save_at: int | None = None) -> dict:
    """SGD on 64 samples, batches of 8: 8 steps."""
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    model, optimizer = fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
    loader = fleet.setup_dataloaders(DataLoader(data, batch_size=8, shuffle=True))
    state = {"model": model, "optimizer": optimizer, "loader": loader, "done": 0}
    if register:
        fleet.register_state(state)
    if fleet.resume_from is not None:
        fleet.load(fleet.resume_from, state)
    for x, y in loader:
        fleet.backward(F.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        state["done"] += 1  # the loop's own count, read when the checkpoint is written
        if state["done"] == save_at:
            fleet.save(fleet.run_dir / "mine.pt", state)
        if state["done"] == signal_after:
            os.kill(os.getpid(), signal.SIGTERM)
    return state


def test_sigterm_checkpoints_the_registered_state_and_a_new_fleet_resumes(tmp_path):
    straight = _fleet(tmp_path / "straight")
    want = straight.launch(_loop, True)["model"].state_dict()
    first = _fleet(tmp_path / "run")
    with pytest.raises(SystemExit) as stop:  # SIGTERM after step 3 (and its check):
        first.launch(_loop, True, 3)  # the stop is agreed at step 4's end
    assert stop.value.code == 75 and first.run.result.preempted == "SIGTERM"
    checkpoint = tmp_path / "run" / "checkpoints" / "step-0000004.pt"
    assert first.run.result.checkpoint == str(checkpoint)
    saved = torch.load(checkpoint, weights_only=True)
    assert saved["done"] == 4  # the loop's bookkeeping after step 4 was done
    again = _fleet(tmp_path / "run")
    assert again.resume_from == checkpoint
    state = again.launch(_loop, True)
    assert state["done"] == 8 and again.step == 8
    for name, value in want.items():
        assert torch.equal(state["model"].state_dict()[name], value), name


def _whole(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v
            for k, v in model.state_dict().items()}


def test_under_fsdp_the_checkpoint_is_a_directory_of_shards_and_resumes(tmp_path):
    """One process under fsdp (a process group of one rank): the preemption's
    checkpoint is a sharded directory, found again by resume="auto"."""
    want = _whole(_fleet(tmp_path / "straight", strategy="fsdp").launch(_loop, True)["model"])
    with pytest.raises(SystemExit):
        _fleet(tmp_path / "run", strategy="fsdp").launch(_loop, True, 3)
    checkpoint = tmp_path / "run" / "checkpoints" / "step-0000004"
    assert checkpoint.is_dir()
    again = _fleet(tmp_path / "run", strategy="fsdp")
    assert again.resume_from == checkpoint
    got = _whole(again.launch(_loop, True)["model"])
    assert all(torch.equal(got[k], want[k]) for k in want) and again.step == 8


def test_without_a_registered_state_the_last_saved_one_is_checkpointed(tmp_path):
    fleet = _fleet(tmp_path / "run")
    with pytest.raises(SystemExit):
        fleet.launch(_loop, False, 4, 2)  # saved at step 2, stopped at step 5
    saved = torch.load(tmp_path / "run" / "checkpoints" / "step-0000005.pt",
                       weights_only=True)
    assert saved["done"] == 5 and saved["_fleet"]["step"] == 5


def test_without_any_state_the_run_still_stops_and_says_so(tmp_path, caplog):
    fleet = _fleet(tmp_path / "run")
    with pytest.raises(SystemExit) as stop:
        fleet.launch(_loop, False, 2)
    assert stop.value.code == 75
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert "fleet.register_state" in caplog.text


class _AskToStop(Callback):
    def on_step_end(self, view, step):
        if step == 3:
            view.request_stop("enough")


def test_a_stop_a_callback_asks_for_is_agreed_at_a_check_and_left_to_the_loop(tmp_path):
    fleet = gpufleet.Fleet(accelerator="cpu", run_dir=str(tmp_path / "run"),
                           callbacks=[_AskToStop()],
                           overrides={"fault.preempt_check_every": 2})
    net = torch.nn.Linear(4, 1)
    model, optimizer = fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    seen = []
    for _ in range(6):
        fleet.backward(model(torch.ones(2, 4)).sum())
        optimizer.step()
        optimizer.zero_grad()
        seen.append(fleet.should_stop)
    fleet.finish()
    assert seen == [False, False, False, True, True, True]  # checked at steps 2, 4, 6
    assert fleet.run.result.stopped_early == "enough"


def test_a_run_directory_with_checkpoints_needs_resume_and_says_how(tmp_path):
    fleet = _fleet(tmp_path / "run")
    with pytest.raises(SystemExit):
        fleet.launch(_loop, True, 2)
    with pytest.raises(gpufleet.ConfigError, match=r'Fleet\(resume="latest"\)'):
        gpufleet.Fleet(accelerator="cpu", run_dir=str(tmp_path / "run"))


def test_a_signal_no_step_boundary_acted_on_is_taken_when_the_run_ends(tmp_path):
    """SIGUSR1 to a loop that never steps (the checks come at steps' ends): nothing is
    written, and at finish the process takes the signal with the handler it had before
    the Fleet (here one that records it; by default the process would end)."""
    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        fleet = _fleet(tmp_path / "run")
        signal.raise_signal(signal.SIGUSR1)
        assert seen == []  # the run's until it ends
        fleet.finish()
        assert seen == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, previous)
