"""The DCGAN-style port: two models, two optimizers and a training step train exactly
what the plain PyTorch loop trains, on 1 and 2 ranks, and resume exactly."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import dcgan as example

from gpufleet.train.checkpoint import format as ckpt

QUIET = {"log.progress": "off", "monitor.report": False}


def _logged(run_dir: str) -> list[dict[str, float]]:
    """Each step's logged model losses (log.every = 1)."""
    rows = [json.loads(line) for line in Path(run_dir, "metrics.jsonl").open()]
    return [{k: r[k] for k in ("generator", "discriminator") if k in r}
            for r in rows if "generator" in r or "discriminator" in r]


def _same_losses(plain: list[dict], ours: list[dict]) -> None:
    assert len(plain) == len(ours)
    for step, (a, b) in enumerate(zip(plain, ours, strict=True)):
        assert a.keys() == b.keys(), step
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (step, key)


def _same_weights(plain: dict, ours: dict) -> None:
    for name, model in plain.items():
        for key, value in model.state_dict().items():
            torch.testing.assert_close(ours[name][key], value, rtol=1e-5, atol=1e-6,
                                       msg=f"{name}.{key}")


@pytest.mark.parametrize("mode", ["both", "alternate"])
def test_one_rank_equals_the_plain_loop(tmp_path, mode):
    plain_models, plain = example.train_plain(6, 16, mode)
    models, result = example.train_gpufleet(6, 16, mode, overrides={
        "run.out_dir": str(tmp_path), **QUIET})
    _same_losses(plain, _logged(result.run_dir))
    _same_weights(plain_models, {n: m.state_dict() for n, m in models.items()})
    config = Path(result.run_dir, "config.toml").read_text()
    assert "generator: Adam(lr=0.0002, betas=(0.5, 0.999)" in config
    assert "discriminator: Adam(lr=0.0002" in config


@pytest.mark.slow
def test_two_ranks_in_turns_equal_the_plain_loop(tmp_path):
    """A model that sits a step out was still called (the generator makes the fakes):
    its DDP wrapper then waits for no gradients."""
    plain_models, plain = example.train_plain(4, 32, "alternate")
    _, result = example.train_gpufleet(4, 16, "alternate", nproc=2, overrides={
        "run.out_dir": str(tmp_path), **QUIET})
    _same_losses(plain, _logged(result.run_dir))
    saved = ckpt.load_checkpoint(result.checkpoint)["models"]
    _same_weights(plain_models, {n: s["model"] for n, s in saved.items()})


def test_two_ranks_equal_the_plain_loop_on_the_global_batch(tmp_path):
    plain_models, plain = example.train_plain(4, 32)  # 1 process, batch 32
    # 2 ranks (ddp) x 2 micro-batches of 8: each model's gradient sync held back on the
    # first micro-batch.
    _, result = example.train_gpufleet(4, 8, nproc=2, overrides={
        "run.out_dir": str(tmp_path), "optim.grad_accum": 2, **QUIET})
    _same_losses(plain, _logged(result.run_dir))
    saved = ckpt.load_checkpoint(result.checkpoint)["models"]
    assert set(saved["generator"]) == {"model", "optimizer", "scheduler", "precision"}
    # Into your own modules and optimizers, by model name.
    mine = example.build_models(seed=1)
    optimizers = {n: example.adam(m.parameters()) for n, m in mine.items()}
    info = example.gpufleet.load_checkpoint(result.run_dir, mine, optimizers)
    assert info["step"] == 4
    _same_weights(plain_models, {n: m.state_dict() for n, m in mine.items()})
    assert optimizers["generator"].state_dict()["state"]


class _Stop(example.gpufleet.Callback):
    def on_step_end(self, view, step):
        if step == 5:
            raise KeyboardInterrupt


class _Steps(example.gpufleet.Callback):
    def __init__(self):
        self.seen = []

    def on_step_end(self, view, step):
        self.seen.append(step)


def test_a_stopped_run_resumes_to_the_same_weights(tmp_path):
    settings = {"run.dir": str(tmp_path / "run"), "checkpoint.every": 2, **QUIET}
    whole, _ = example.train_gpufleet(8, 16, "alternate", overrides={
        **settings, "run.dir": str(tmp_path / "whole")})
    def fit(callback, **more):
        models = example.build_models()
        example.gpufleet.fit(models, example.Blobs(), training_step=example.alternate_step,
                             optimizer=example.adam, callbacks=[callback],
                             overrides={"run.max_steps": 8, "data.batch_size": 16,
                                        "data.shuffle": False, "run.eval_every": 0,
                                        **settings, **more})
        return models

    with pytest.raises(KeyboardInterrupt):
        fit(_Stop())
    steps = _Steps()
    resumed = fit(steps, **{"checkpoint.resume": "latest"})
    assert steps.seen == [5, 6, 7, 8]  # from the checkpoint of step 4
    for name, model in whole.items():
        for (key, a), b in zip(model.state_dict().items(),
                               resumed[name].state_dict().values(), strict=True):
            assert torch.equal(a, b), f"{name}.{key}"
