"""The DDP-tutorial port: gpufleet trains exactly what the plain PyTorch loop trains,
on 1 and 2 ranks, and resumes exactly."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import ddp_regression as example

from gpufleet.train.checkpoint import format as ckpt


def _same(a: dict, b: dict) -> None:
    for key, value in a.items():
        torch.testing.assert_close(b[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_one_rank_equals_the_plain_loop(tmp_path):
    plain = example.train_plain(epochs=3, batch_size=32)
    ours, result = example.train_gpufleet(3, 32, overrides={
        "run.out_dir": str(tmp_path), "log.progress": "off", "monitor.report": False})
    _same(plain.state_dict(), ours.state_dict())
    assert "StepLR(step_size=1, gamma=0.7) every epoch" in Path(
        result.run_dir, "config.toml").read_text()


def test_two_ranks_equal_the_plain_loop_on_the_global_batch(tmp_path):
    plain = example.train_plain(epochs=2, batch_size=32)  # 1 process, batch 32
    _, result = example.train_gpufleet(2, 16, nproc=2, overrides={  # 2 x 16
        "run.out_dir": str(tmp_path), "log.progress": "off", "monitor.report": False})
    _same(plain.state_dict(), ckpt.load_checkpoint(result.checkpoint)["model"])


class _Stop(example.gpufleet.Callback):
    def on_step_end(self, view, step):
        if step == 20:
            raise KeyboardInterrupt


def test_a_stopped_run_resumes_to_the_same_weights(tmp_path):
    settings = {"run.dir": str(tmp_path / "run"), "checkpoint.every": 8,
                "log.progress": "off", "monitor.report": False}
    whole, _ = example.train_gpufleet(3, 32, overrides={**settings,
                                                        "run.dir": str(tmp_path / "whole")})
    torch.manual_seed(0)
    with pytest.raises(KeyboardInterrupt):
        example.gpufleet.fit(example.build_model(), example.build_data(),
                             loss_fn=torch.nn.functional.mse_loss,
                             optimizer=example.build_optimizer,
                             scheduler=example.build_scheduler, callbacks=[_Stop()],
                             overrides={"run.max_epochs": 3, "data.batch_size": 32,
                                        "data.shuffle": False, "sched.interval": "epoch",
                                        "run.eval_every": 0, **settings})
    resumed, _ = example.train_gpufleet(3, 32, overrides={**settings,
                                                          "checkpoint.resume": "latest"})
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name
