"""Stopping and keeping: early stopping, a stop asked by a callback, the best
checkpoints, a checkpoint every N epochs, and loading a checkpoint into your module."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

import gpufleet
import toyjob
from gpufleet.core.callbacks import Callback
from gpufleet.errors import CheckpointError, ConfigError
from gpufleet.train.checkpoint.files import list_checkpoints, step_of

BASE = {"log.progress": "off", "log.every": 2, "data.batch_size": 16,
        "data.num_workers": 0, "monitor.report": False, "optim.lr": 0.01}


def _fit(tmp_path, overrides, callbacks=(), with_eval=True):
    torch.manual_seed(0)
    model = toyjob.make_model()
    train, held_out = toyjob.make_data(n_eval=64)
    return model, gpufleet.fit(model, train, held_out if with_eval else None,
                               loss_fn=F.mse_loss, callbacks=callbacks,
                               overrides={**BASE, "run.out_dir": str(tmp_path), **overrides})


class _AskToStop(Callback):
    def on_step_end(self, view, step):
        if step == 5:
            view.request_stop("enough for this test")


def test_a_callback_stops_the_run_which_ends_with_a_checkpoint(tmp_path):
    _, result = _fit(tmp_path, {"run.max_steps": 50, "checkpoint.save_final": False,
                                "fault.preempt_check_every": 1}, [_AskToStop()])
    assert result.steps == 5 and result.stopped_early == "enough for this test"
    assert [step_of(p) for p in list_checkpoints(result.run_dir)] == [5]
    assert result.preempted is None


def test_early_stopping_on_the_eval_loss_after_patience_checks(tmp_path):
    # lr 0: the eval loss never improves after the first evaluation.
    _, result = _fit(tmp_path, {"run.max_steps": 100, "optim.lr": 0.0, "run.eval_every": 2,
                                "early_stop.metric": "eval_loss", "early_stop.patience": 3,
                                "fault.preempt_check_every": 2})
    assert result.steps == 8  # evaluated at 2 (best), 4, 6, 8: three without improvement
    assert "early stop: eval_loss did not improve" in result.stopped_early
    assert list_checkpoints(result.run_dir)  # ends with a checkpoint


def test_early_stopping_on_an_eval_metric_needs_eval_data(tmp_path):
    with pytest.raises(ConfigError, match="no evaluation data"):
        _fit(tmp_path, {"run.max_steps": 2, "early_stop.metric": "eval_loss"},
             with_eval=False)


def test_keep_best_keeps_the_best_checkpoints_beside_the_newest(tmp_path):
    # The logged training loss as the monitor, a checkpoint every 2 steps.
    _, result = _fit(tmp_path, {"run.max_steps": 12, "checkpoint.every": 2,
                                "checkpoint.keep_last": 1, "checkpoint.keep_best": 2,
                                "checkpoint.monitor": "loss", "run.eval_every": 0})
    scores = {int(k): v for k, v in json.loads(
        (Path(result.run_dir) / "checkpoints" / "scores.json").read_text()).items()}
    assert sorted(scores) == [2, 4, 6, 8, 10, 12]
    best_two = sorted(sorted(scores, key=scores.get)[:2])
    kept = sorted(step_of(p) for p in list_checkpoints(result.run_dir))
    assert kept == sorted({*best_two, 12})


def test_a_checkpoint_every_epoch(tmp_path):
    # 256 samples, batch 16: an epoch is 16 steps.
    _, result = _fit(tmp_path, {"run.max_steps": 40, "checkpoint.every_epochs": 1,
                                "checkpoint.keep_last": 5, "checkpoint.save_final": False,
                                "run.eval_every": 0, "log.every": 5})
    assert [step_of(p) for p in list_checkpoints(result.run_dir)] == [16, 32]


def test_load_checkpoint_into_your_own_module(tmp_path):
    trained, result = _fit(tmp_path, {"run.max_steps": 4, "run.eval_every": 0})
    mine = toyjob.make_model()
    opt = torch.optim.AdamW(mine.parameters())
    info = gpufleet.load_checkpoint(result.run_dir, mine, opt)  # the run's newest
    assert info["step"] == 4 and opt.state_dict()["state"]
    for a, b in zip(trained.state_dict().values(), mine.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(CheckpointError, match="do not fit this model"):
        gpufleet.load_checkpoint(result.checkpoint, toyjob.make_model(hidden=8))


def test_a_stop_asked_on_one_rank_stops_both_after_the_same_step(tmp_path):
    train = toyjob.make_data()
    result = gpufleet.fit(toyjob.make_model(), train, loss_fn=F.mse_loss,
                          callbacks=[toyjob.StopOnOneRank(rank=1, step=3)],
                          overrides={**BASE, "run.out_dir": str(tmp_path), "dist.nproc": 2,
                                     "run.max_steps": 40, "fault.preempt_check_every": 2})
    # Asked after step 3 on rank 1; the ranks agree every 2 steps: both stop at 4.
    assert result.steps == 4 and result.stopped_early == "another rank asked the run to stop"
    assert [step_of(p) for p in list_checkpoints(result.run_dir)] == [4]
