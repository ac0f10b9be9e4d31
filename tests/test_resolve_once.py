"""A rank resolves its config once (it used to do it up to three times)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

import gpufleet
import toyjob
from gpufleet.config import load_config
from gpufleet.entry import run_training
from gpufleet.errors import ConfigError
from gpufleet.resolve import Machine, resolve_once


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


def test_a_resolved_config_is_resolved_again_for_another_world():
    cfg = resolve_once(load_config(None, []), world_size=1)
    assert resolve_once(cfg, world_size=1) is cfg
    assert cfg.parallel.strategy == "single"  # "auto" decided for one process
    # For 2 ranks it is checked again (not handed back): "single" cannot run on 2.
    with pytest.raises(ConfigError, match="runs in one process, but this run has 2 ranks"):
        resolve_once(cfg, world_size=2, local_world_size=2)
