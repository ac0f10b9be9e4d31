"""Activation checkpointing gives the same loss, gradients and BatchNorm statistics as
the plain model; SyncBatchNorm conversion keeps the state-dict names."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from gpufleet.config import ParallelConfig
from gpufleet.errors import ConfigError
from gpufleet.parallel.activation_checkpointing import (
    apply_activation_checkpointing,
    apply_layer_options,
    convert_sync_batchnorm,
)


class Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm = nn.BatchNorm2d(channels)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.relu(self.norm(self.conv(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.ModuleList(Block(8) for _ in range(4))
        self.head = nn.Sequential(nn.BatchNorm1d(8), nn.Linear(8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))


def _train(model: nn.Module, steps: int = 3) -> tuple[list[float], dict]:
    """A few SGD steps with dropout on; returns the losses and the last gradients."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(7)  # the dropout masks: the same in both runs
    losses = []
    for _ in range(steps):
        x = torch.randn(6, 3, 8, 8, generator=g)
        y = torch.randint(0, 2, (6,), generator=g)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        losses.append(loss.item())
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    return losses, grads


@pytest.mark.parametrize("spec", ["Block", "every:2", "Block,BatchNorm1d", "every:1"])
def test_checkpointing_changes_no_number_and_no_batchnorm_statistic(spec):
    torch.manual_seed(0)
    plain = Net()
    checked = copy.deepcopy(plain)
    names = apply_activation_checkpointing(checked, spec)
    assert names
    plain_losses, plain_grads = _train(plain)
    checked_losses, checked_grads = _train(checked)
    assert checked_losses == pytest.approx(plain_losses, rel=1e-6)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(checked_grads[name], grad, rtol=1e-5, atol=1e-6)
    plain_state, checked_state = plain.state_dict(), checked.state_dict()
    assert plain_state.keys() == checked_state.keys()  # no wrapper prefix
    for key, value in plain_state.items():
        if "running" in key or "num_batches_tracked" in key:
            # Recomputation would update these a second time; they must match exactly.
            assert torch.equal(checked_state[key], value), key
        else:
            torch.testing.assert_close(checked_state[key], value, rtol=1e-5, atol=1e-6)
    assert int(checked_state["blocks.0.norm.num_batches_tracked"]) == 3


def test_every_k_picks_blocks_of_the_largest_module_list():
    assert apply_activation_checkpointing(Net(), "every:3") == ["blocks.0", "blocks.3"]
    assert apply_activation_checkpointing(Net(), "") == []


def test_checkpointed_forward_recomputes_in_backward():
    calls = []
    block = Block(2)
    block.conv.register_forward_hook(lambda *_: calls.append(1))
    apply_activation_checkpointing(nn.Sequential(block), "Block")
    block(torch.randn(2, 2, 4, 4)).sum().backward()
    assert len(calls) == 2  # forward, then the recomputation in backward
    with torch.no_grad():
        block(torch.randn(2, 2, 4, 4))
    assert len(calls) == 3  # no recomputation machinery without gradients


@pytest.mark.parametrize("spec, words", [
    ("Blok", ["'Blok'", "Block"]),
    ("every:0", ["every:2"]),
    ("every:x", ["whole number"]),
])
def test_bad_specs_name_the_fix(spec, words):
    with pytest.raises(ConfigError) as err:
        apply_activation_checkpointing(Net(), spec)
    for word in words:
        assert word in str(err.value)


def test_every_k_without_a_module_list_says_to_name_a_class():
    with pytest.raises(ConfigError, match=r"no blocks"):
        apply_activation_checkpointing(nn.Sequential(nn.Linear(2, 2)), "every:2")


def test_sync_batchnorm_conversion_keeps_names_and_runs_alone():
    torch.manual_seed(0)
    net = Net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    net = convert_sync_batchnorm(net)
    assert isinstance(net.blocks[0].norm, nn.SyncBatchNorm)
    assert isinstance(net.head[0], nn.SyncBatchNorm)
    after = net.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    net(torch.randn(4, 3, 8, 8)).sum().backward()  # no process group: plain BatchNorm


def test_layer_options_refuse_sync_batchnorm_on_cpu_ranks():
    cfg = ParallelConfig(sync_batchnorm=True)
    with pytest.raises(ConfigError, match="needs GPUs"):
        apply_layer_options(Net(), cfg, torch.device("cpu"), world_size=2)
    net = apply_layer_options(Net(), cfg, torch.device("cpu"), world_size=1)
    assert isinstance(net.blocks[0].norm, nn.SyncBatchNorm)


def test_training_with_checkpointing_ends_with_the_same_weights(run_cli, tmp_path):
    from conftest import final_params

    toy = ["--model", "toyjob:make_model", "--data", "toyjob:make_data", "--model.loss",
           "torch.nn.functional:mse_loss", "--max-steps", "4", "--run.out_dir", "runs",
           "--monitor.report", "false"]
    run_cli("train", *toy, "--run-dir", "runs/plain")
    proc = run_cli("train", *toy, "--run-dir", "runs/ac",
                   "--parallel.activation_checkpointing", "Linear")
    assert "activation checkpointing (Linear) on 2 x Linear: 0, 3" in proc.stderr
    plain, checked = final_params(tmp_path / "runs/plain"), final_params(tmp_path / "runs/ac")
    assert plain.keys() == checked.keys()
    for key in plain:
        torch.testing.assert_close(checked[key], plain[key])
