"""``local_sgd``: period 1 equals ``ddp``; hierarchical averaging runs on the steps its
periods select (2 gloo ranks posing as 2 nodes of 1 rank)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from conftest import final_params
from equivalence import assert_same_weights
from gpufleet.config import ParallelConfig
from gpufleet.config.parallel import LocalSGDOptions
from gpufleet.errors import ConfigError
from gpufleet.launch import DistEnv, destroy_process_group, init_process_group, launch
from gpufleet.parallel import OptimizerSpec
from gpufleet.parallel.local_sgd import LocalSGD, averaging_plan
from gpufleet.parallel.parallelize import distribute

TOY = ["--model", "toyjob:make_model", "--data", "toyjob:make_data",
       "--model.loss", "torch.nn.functional:mse_loss", "--max-steps", "8",
       "--log.every", "4", "--optim.warmup_steps", "2", "--run.out_dir", "runs",
       "--batch-size", "16", "--nproc", "2", "--monitor.report", "false",
       # Averaging models equals averaging gradients for a linear update: SGD with
       # momentum and weight decay, no clipping of each rank's own gradients.
       "--optim.name", "sgd", "--optim.lr", "0.05", "--optim.clip_norm", "0"]


@pytest.mark.slow  # the resume-at-an-averaging-step test below proves local_sgd in the default run
def test_local_sgd_with_period_one_equals_ddp(run_cli, tmp_path):
    run_cli("train", *TOY, "--strategy", "ddp", "--run-dir", "runs/ddp")
    run_cli("train", *TOY, "--strategy", "local_sgd", "--parallel.local_sgd.period", "1",
            "--parallel.local_sgd.warmup_steps", "3", "--run-dir", "runs/local")
    ddp, local = final_params(tmp_path / "runs/ddp"), final_params(tmp_path / "runs/local")
    assert_same_weights(local, ddp, rtol=1e-5)


@pytest.mark.slow  # local_sgd: its preset and hierarchy tests keep it
def test_local_sgd_resumed_at_an_averaging_step_goes_on_as_if_uninterrupted(run_cli,
                                                                           tmp_path):
    # Warm-up 1, period 2: the models are averaged after steps 2, 4, 6 and 8, so at the
    # step-4 checkpoint both ranks hold rank 0's model. Plain SGD keeps no per-rank state.
    # The resumed run must take step 5 without gradient all-reduce, like the first run.
    args = [*TOY, "--strategy", "local_sgd", "--parallel.local_sgd.period", "2",
            "--parallel.local_sgd.warmup_steps", "1", "--optim.momentum", "0",
            "--checkpoint.every", "4"]
    run_cli("train", *args, "--run-dir", "runs/straight")
    step4 = tmp_path / "runs/straight/checkpoints/step-0000004.pt"
    run_cli("train", *args, "--run-dir", "runs/resumed", "--resume", str(step4))
    straight = final_params(tmp_path / "runs/straight")
    resumed = final_params(tmp_path / "runs/resumed")
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], rtol=0, atol=0)


def _hierarchical_rank() -> list[bool]:
    """Two ranks, each its own 'node'; within-node period 2, across nodes period 4.
    Returns, per step, whether the ranks hold the same parameters after it."""
    os.environ.update(LOCAL_WORLD_SIZE="1", LOCAL_RANK="0")
    env = DistEnv.detect()
    init_process_group(env, "gloo", timeout_s=60)
    try:
        torch.manual_seed(0)
        cfg = ParallelConfig(local_sgd=LocalSGDOptions(period=2, inter_node_period=4))
        strategy = LocalSGD(cfg, torch.device("cpu"))
        model = distribute(nn.Linear(3, 1), strategy)
        spec = OptimizerSpec(torch.optim.SGD, lambda m: [{"params": list(m.parameters())}],
                             {"lr": 0.1})
        opt = strategy.setup_optimizer(model, spec)
        same = []
        for step in range(6):
            x = torch.full((4, 3), float(env.rank + step + 1))  # different data per rank
            model(x).pow(2).mean().backward()  # no gradient all-reduce (no warm-up)
            opt.step()
            opt.zero_grad()
            strategy.after_optimizer_step(model, step)
            weights = strategy.unwrap(model).weight.detach().clone()
            gathered = [torch.empty_like(weights) for _ in range(2)]
            dist.all_gather(gathered, weights)
            same.append(torch.equal(gathered[0], gathered[1]))
        return same
    finally:
        destroy_process_group()


def test_hierarchical_averaging_crosses_nodes_only_on_its_period():
    results = launch(_hierarchical_rank, nproc=2, launcher="spawn")
    # Steps 0 and 4: all ranks average; steps 2: each node alone (1 rank: no change).
    assert results[0] == [True, False, False, False, True, False]
    assert results[1] == results[0]


def test_averaging_plan_checks_the_hierarchy():
    assert averaging_plan(4, 0, 8, 4) == {4: 8}
    assert averaging_plan(4, 16, 8, 4) == {4: 4, 16: 8}
    assert averaging_plan(2, 8, 4, 4) == {2: 4}  # one node: flat
    with pytest.raises(ConfigError, match="multiple of"):
        averaging_plan(4, 6, 8, 4)
    with pytest.raises(ConfigError, match="same number of ranks on every node"):
        averaging_plan(2, 8, 6, 4)
