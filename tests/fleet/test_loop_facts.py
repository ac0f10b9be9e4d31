"""The record of an own loop is what the loop did: the diagnosis's facts (batch size,
accumulation, evaluation cadence, steps, restarts) counted from its calls, the step
count restored by ``fleet.load``, the logged loss the step's (not the part of it handed
to each backward), and the restarts of the elastic agent on record. One process each."""

from __future__ import annotations

import json
import socket

import pytest
import tomllib
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import gpufleet


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def _data(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g))


def _records(run_dir, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def test_the_facts_of_an_own_loop_are_what_it_did(tmp_path):
    """Batches of 8 (the first loader set up, the evaluation's, has 32), two backward
    passes per step under no_backward_sync, an evaluation of 2 batches every 3 steps:
    diagnosis.json says 8, 2, 3, not the config's or the first loader's."""
    fleet = gpufleet.Fleet(accelerator="cpu", run_dir=str(tmp_path / "run"), log_every=2)
    net = _net()
    model, optimizer = fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.05))
    val, train = fleet.setup_dataloaders(DataLoader(_data(64), batch_size=32),
                                         DataLoader(_data(192), batch_size=8))
    batches = iter(train)
    for step in range(12):
        for micro in range(2):
            x, y = next(batches)
            with fleet.no_backward_sync(model, enabled=micro == 0):
                fleet.backward(F.mse_loss(model(x), y) / 2)
        optimizer.step()
        optimizer.zero_grad()
        if step % 3 == 2:
            model.eval()
            with torch.no_grad():
                for x, _ in val:
                    model(x)
            model.train()
    fleet.finish()
    facts = json.loads((tmp_path / "run" / "diagnosis.json").read_text())["facts"]
    assert (facts["own_loop"], facts["batch_size"], facts["grad_accum"],
            facts["eval_every"], facts["evaluations"], facts["steps"],
            facts["restarts"]) == (True, 8, 2, 3, 4, 12, 0)


def test_the_logged_loss_is_the_step_s_under_accumulation(tmp_path):
    """Accelerate's accumulation divides the loss handed to backward by 2: the loss
    logged is the step's (the micro-batches' mean), as the loop computed it."""
    fleet = gpufleet.Fleet(accelerator="cpu", run_dir=str(tmp_path / "run"), log_every=1,
                           gradient_accumulation_steps=2)
    net = _net()
    model, optimizer = fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.05))
    loader = fleet.setup_dataloaders(DataLoader(_data(32), batch_size=4))
    means, micro = [], []
    for x, y in loader:
        with fleet.accumulate(model):
            loss = F.mse_loss(model(x), y)
            micro.append(loss.item())
            fleet.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if fleet.sync_gradients:
            means.append(sum(micro) / len(micro))
            micro = []
    fleet.finish()
    logged = [r["loss"] for r in _records(tmp_path / "run", "train")]
    assert len(logged) == len(means) == 4
    assert logged == pytest.approx(means, rel=1e-5)


def _steps(fleet, model, optimizer, batches, n: int) -> None:
    for _ in range(n):
        x, y = next(batches)
        fleet.backward(F.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()


def test_load_restores_the_step_count_and_metrics_go_on_from_it(tmp_path):
    """Saved at step 4, loaded by a new run: fleet.step is 4 again and the steps logged
    after the resume are 5 and 6, not 1 and 2 once more."""
    ckpt = tmp_path / "ckpt.pt"
    fleet = gpufleet.Fleet(accelerator="cpu", run_dir=str(tmp_path / "a"), log_every=1)
    net = _net()
    model, optimizer = fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.05))
    loader = fleet.setup_dataloaders(DataLoader(_data(), batch_size=4))
    _steps(fleet, model, optimizer, iter(loader), 4)
    fleet.save(ckpt, {"model": model, "optimizer": optimizer, "loader": loader})
    fleet.finish()

    fleet = gpufleet.Fleet(accelerator="cpu", run_dir=str(tmp_path / "b"), log_every=1)
    net = _net()
    model, optimizer = fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.05))
    loader = fleet.setup_dataloaders(DataLoader(_data(), batch_size=4))
    fleet.load(ckpt, {"model": model, "optimizer": optimizer, "loader": loader})
    assert fleet.step == 4
    _steps(fleet, model, optimizer, iter(loader), 2)
    assert fleet.step == 6
    fleet.finish()
    assert [r["step"] for r in _records(tmp_path / "b", "train")] == [5, 6]
    facts = json.loads((tmp_path / "b" / "diagnosis.json").read_text())["facts"]
    assert facts["steps"] == 6


def test_a_rank_restarted_by_the_agent_records_its_restarts(tmp_path, monkeypatch):
    """What torch's elastic agent tells a rank it restarted (gpufleet run --max-restarts
    1, on its first restart): config.toml says max_restarts = 1, metrics.jsonl and
    diagnosis.json record the restart."""
    with socket.socket() as s:  # a free port for this one-rank group
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                        "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port), "TORCHELASTIC_MAX_RESTARTS": "1",
                        "TORCHELASTIC_RESTART_COUNT": "1"}.items():
        monkeypatch.setenv(name, value)
    run_dir = tmp_path / "run"
    fleet = gpufleet.Fleet(accelerator="cpu", run_dir=str(run_dir), log_every=1)
    net = _net()
    model, optimizer = fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.05))
    loader = fleet.setup_dataloaders(DataLoader(_data(), batch_size=4))
    _steps(fleet, model, optimizer, iter(loader), 2)
    fleet.finish()
    config = tomllib.loads((run_dir / "config.toml").read_text())
    assert config["dist"]["max_restarts"] == 1
    assert [(r["step"], r["restarts"]) for r in _records(run_dir, "restart")] == [(0, 1)]
    facts = json.loads((run_dir / "diagnosis.json").read_text())["facts"]
    assert facts["restarts"] == 1


def test_an_own_loop_counts_its_tokens_and_logs_its_schedulers_rate(tmp_path):
    """Batches of token ids (8 x 16): the run counts every token the loop took, as
    fit's does (tokens per second in the log line and the result), and the log line's
    learning rate is the one the loop's own scheduler set."""
    run_dir = tmp_path / "run"
    fleet = gpufleet.Fleet(accelerator="cpu", run_dir=str(run_dir), log_every=2)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Embedding(32, 4), torch.nn.Flatten(),
                              torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model, optimizer, scheduler = fleet.setup(
        net, opt, scheduler=torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32, (64, 16), generator=g)
    loader = fleet.setup_dataloaders(DataLoader(TensorDataset(ids, torch.randn(64, 1)),
                                                batch_size=8))
    for x, y in loader:  # 8 steps
        fleet.backward(F.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    fleet.finish()
    assert (fleet.run.state.samples, fleet.run.state.tokens) == (64, 64 * 16)
    assert fleet.run.result.tokens_per_s > 0
    train = _records(run_dir, "train")
    assert [r["step"] for r in train] == [2, 4, 6, 8]
    assert all(r["tokens_per_s"] > 0 for r in train)
    # logged at the end of the step, before that step's scheduler.step()
    assert [r["lr"] for r in train] == [0.1 * 0.5 ** (s - 1) for s in (2, 4, 6, 8)]
