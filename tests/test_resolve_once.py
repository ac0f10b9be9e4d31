"""A run resolves its config once, into its plan (it used to do it up to three times)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

import gpufleet
import toyjob
from gpufleet.config import load_config
from gpufleet.entry import run_training
from gpufleet.errors import ConfigError
from gpufleet.launch import DistEnv
from gpufleet.plan import make_plan
from gpufleet.resolve import Machine


@pytest.fixture
def detections(monkeypatch):
    """How often this process looked at its machine to resolve a config."""
    calls = []
    real = Machine.detect.__func__

    def counting(cls):
        calls.append(1)
        return real(cls)

    monkeypatch.setattr(Machine, "detect", classmethod(counting))
    return calls


BASE = {"run.max_steps": 2, "log.progress": "off", "data.batch_size": 32,
        "data.num_workers": 0}


def test_fit_resolves_once(tmp_path, detections):
    torch.manual_seed(0)
    result = gpufleet.fit(toyjob.make_model(), toyjob.make_data(), loss_fn=F.mse_loss,
                          overrides={**BASE, "run.out_dir": str(tmp_path)})
    assert result.steps == 2
    assert len(detections) == 1


def test_the_cli_path_resolves_once_in_its_one_process(tmp_path, detections):
    """`gpufleet train` with one process: the launcher leaves resolving to the rank."""
    cfg = load_config(None, [f"{k}={v}" for k, v in BASE.items()] + [
        f"run.out_dir={tmp_path}", "model.name=toyjob:make_model",
        "data.name=toyjob:make_data", "model.loss=torch.nn.functional:mse_loss"])
    result = run_training(cfg)
    assert result.steps == 2
    assert len(detections) == 1


def test_a_plan_is_kept_in_its_world_and_made_again_for_another(detections):
    plan = make_plan(load_config(None, ["run.device=cpu"]), DistEnv.detect({}))
    assert len(detections) == 1
    assert plan.strategy == "single"  # "auto" decided for one process
    assert plan.for_world(DistEnv.detect({})) is plan  # the same world: nothing resolved
    assert len(detections) == 1
    # For 2 ranks (an elastic run that grew) it is checked again: "single" cannot run on 2.
    two = DistEnv.detect({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                          "LOCAL_WORLD_SIZE": "2"})
    with pytest.raises(ConfigError, match="runs in one process, but this run has 2 ranks"):
        plan.for_world(two)


def test_auto_strategy_is_decided_in_the_plan_from_the_ranks_it_starts():
    """The launcher and the strategy come from one decision: two ranks asked for are
    started by the elastic agent and run ddp; one is this process and runs single."""
    cpu = Machine(cuda=False, gpus=0, bf16=False)
    two = make_plan(load_config(None, ["dist.nproc=2"]), DistEnv.detect({}), machine=cpu)
    assert (two.launcher, two.nproc, two.world_size, two.strategy) == ("elastic", 2, 2, "ddp")
    assert two.dims.dp_replicate == 2
    one = make_plan(load_config(None, []), DistEnv.detect({}), machine=cpu)
    assert (one.launcher, one.nproc, one.world_size, one.strategy) == ("none", 1, 1, "single")
    gpus = Machine(cuda=True, gpus=4, bf16=True)
    four = make_plan(load_config(None, []), DistEnv.detect({}), machine=gpus)
    assert (four.launcher, four.nproc, four.strategy, four.device, four.precision) == (
        "elastic", 4, "ddp", "cuda", "bf16-mixed")
    # What config.toml records: the decided values, not "auto".
    assert (four.cfg.dist.launcher, four.cfg.dist.nproc) == ("elastic", 4)
