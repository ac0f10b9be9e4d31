"""The loop in one process: accumulation, precision, clipping, schedule, resume."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from torch.nn import functional as F

import gpufleet
import toyjob
from equivalence import assert_same_weights
from gpufleet.core.callbacks import Callback
from gpufleet.data.audit import audit


def _fit(tmp_path, overrides: dict, model_kwargs=None, data=None, callbacks=(),
         eval_data=None):
    torch.manual_seed(0)  # every run starts from the same weights
    model = toyjob.make_model(**(model_kwargs or {}))
    base = {"run.out_dir": str(tmp_path), "run.max_steps": 8, "log.progress": "off",
            "log.every": 1, "data.batch_size": 32, "optim.warmup_steps": 2}
    return model, gpufleet.fit(model, data or toyjob.make_data(), eval_data,
                               loss_fn=F.mse_loss, overrides={**base, **overrides},
                               callbacks=callbacks)


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_loss_falls_and_run_dir_is_written(tmp_path):
    _, result = _fit(tmp_path, {"run.max_steps": 40, "optim.lr": 0.01})
    assert result.steps == 40
    assert result.losses[-1][1] < 0.5 * result.losses[0][1]
    lines = [json.loads(x) for x in open(f"{result.run_dir}/metrics.jsonl")]
    assert [x["step"] for x in lines if x["kind"] == "train"] == list(range(1, 41))
    assert (tmp_path / result.run_dir.split("/")[-1] / "config.toml").exists()
    state = torch.load(result.checkpoint, weights_only=True)
    assert state["step"] == 40
    assert not any(k.startswith("module.") for k in state["model"])


def test_accumulation_equals_one_big_batch(tmp_path):
    big, _ = _fit(tmp_path / "a", {"data.batch_size": 32, "optim.grad_accum": 1})
    acc, _ = _fit(tmp_path / "b", {"data.batch_size": 8, "optim.grad_accum": 4})
    assert_same_weights(_params(acc), _params(big), rtol=1e-5)


def test_accumulation_counts_samples(tmp_path):
    _, result = _fit(tmp_path, {"data.batch_size": 8, "optim.grad_accum": 4,
                                "log.every": 4, "run.max_steps": 4})
    assert result.samples_per_s > 0
    assert result.steps == 4


@pytest.mark.parametrize("mode", ["bf16-mixed", "fp16-mixed"])
def test_mixed_precision_runs_on_cpu(tmp_path, mode):
    _, result = _fit(tmp_path, {"precision.mode": mode, "run.max_steps": 30, "optim.lr": 0.01})
    losses = [loss for _, loss in result.losses]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("value, norm", [(1e-3, 0.0), (0.0, 1e-3), (1e-3, 5e-3)])
def test_clip_by_value_then_by_norm(tmp_path, value, norm):
    # One plain SGD step with lr 1: the update is exactly minus the clipped gradient.
    plain = {"optim.name": "sgd", "optim.momentum": 0.0, "optim.weight_decay": 0.0,
             "optim.lr": 1.0, "optim.warmup_steps": 0, "run.max_steps": 1}
    torch.manual_seed(0)
    start = torch.cat([p.detach().flatten() for p in toyjob.make_model().parameters()])
    model, _ = _fit(tmp_path, {**plain, "optim.clip_value": value, "optim.clip_norm": norm})
    step = torch.cat([p.detach().flatten() for p in model.parameters()]) - start
    if value:
        assert step.abs().max() <= value * (1 + 1e-5)
    if norm:
        assert step.norm().item() == pytest.approx(norm, rel=1e-4)  # the raw gradient is larger
    else:
        assert step.abs().max().item() == pytest.approx(value, rel=1e-4)


def test_lr_warmup_then_cosine(tmp_path):
    _, result = _fit(tmp_path, {"run.max_steps": 10, "optim.warmup_steps": 4,
                                "optim.lr": 1.0, "optim.min_lr_ratio": 0.1,
                                "optim.decay": "cosine"})
    lrs = [json.loads(x)["lr"] for x in open(f"{result.run_dir}/metrics.jsonl")
           if '"train"' in x]
    # scheduler.get_last_lr() after step s is the lr for step s+1 (0-based).
    assert lrs[:3] == pytest.approx([0.5, 0.75, 1.0])
    assert lrs[-2] == pytest.approx(0.1)
    assert all(a >= b for a, b in itertools.pairwise(lrs[2:]))


class _StopAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, trainer, step):
        if step == self.step:
            raise KeyboardInterrupt  # an interrupted run


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    common = {"run.max_steps": 20, "checkpoint.every": 5, "data.batch_size": 48,
              "run.name": "r"}  # 256/48: epochs end mid-way through checkpoints
    # Dropout makes every step depend on the restored RNG state.
    straight, full = _fit(tmp_path / "a", common, model_kwargs={"dropout": 0.3})
    with pytest.raises(KeyboardInterrupt):
        _fit(tmp_path / "b", common, model_kwargs={"dropout": 0.3},
             callbacks=[_StopAt(12)])
    resumed, rest = _fit(tmp_path / "b", {**common, "checkpoint.resume": "latest"},
                         model_kwargs={"dropout": 0.3})
    assert [s for s, _ in rest.losses] == list(range(11, 21))  # from the step-10 checkpoint
    assert rest.losses == full.losses[10:]
    for k, v in _params(straight).items():
        torch.testing.assert_close(_params(resumed)[k], v, rtol=0, atol=0)
    # The ledger: steps 11-12, read before the interruption, are voided by the resume
    # from step 10; each of the 4 epochs (5 steps of 48) read its 240 samples once (the
    # loader's drop_last leaves 16 out).
    report = audit(rest.run_dir)
    assert report.ok and "resume at step 10 (1 rank(s))" in report.events, report.lines()
    finished = [e for e in report.epochs if e.finished]
    assert len(finished) == 4 and all(e.once == 240 and len(e.dropped) == 16
                                      for e in finished), report.lines()


def test_a_run_directory_with_checkpoints_is_never_trained_over(tmp_path):
    _, first = _fit(tmp_path, {"run.dir": str(tmp_path / "run")})
    with pytest.raises(gpufleet.ConfigError, match=r"already holds checkpoints.*--resume latest"):
        _fit(tmp_path, {"run.dir": str(tmp_path / "run")})
    assert torch.load(first.checkpoint, weights_only=True)["step"] == 8  # untouched


def test_resume_latest_only_picks_runs_of_that_name(tmp_path):
    _fit(tmp_path, {"run.name": "toy-long", "run.max_steps": 3})
    with pytest.raises(gpufleet.CheckpointError, match="found no checkpoint"):
        _fit(tmp_path, {"run.name": "toy", "checkpoint.resume": "latest"})
    _, own = _fit(tmp_path, {"run.name": "toy", "run.max_steps": 2})
    _, resumed = _fit(tmp_path, {"run.name": "toy", "run.max_steps": 4,
                                 "checkpoint.resume": "latest"})
    assert resumed.run_dir == own.run_dir
    assert [s for s, _ in resumed.losses] == [3, 4]


def test_resume_from_a_file_kept_elsewhere_starts_a_new_run_dir(tmp_path):
    _, first = _fit(tmp_path, {"run.max_steps": 2})
    kept = tmp_path / "saved" / "good.pt"
    kept.parent.mkdir()
    kept.write_bytes(open(first.checkpoint, "rb").read())
    _, resumed = _fit(tmp_path, {"run.max_steps": 4, "checkpoint.resume": str(kept)})
    assert resumed.run_dir.startswith(str(tmp_path)) and resumed.run_dir != first.run_dir
    assert not (tmp_path / "saved" / "checkpoints").exists()


def test_checkpoint_of_another_model_is_a_clear_error(tmp_path):
    _, first = _fit(tmp_path, {"run.max_steps": 2})
    with pytest.raises(gpufleet.CheckpointError, match="does not fit this run"):
        _fit(tmp_path, {"checkpoint.resume": first.checkpoint},
             model_kwargs={"hidden": 32})


def test_ddp_in_a_lone_process_is_a_clear_error(tmp_path):
    with pytest.raises(gpufleet.ConfigError, match="needs a process group"):
        _fit(tmp_path, {"parallel.strategy": "ddp"})


def test_resume_latest_without_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(gpufleet.CheckpointError, match="found no checkpoint"):
        _fit(tmp_path, {"checkpoint.resume": "latest"})


def test_corrupt_checkpoint_is_named(tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(gpufleet.CheckpointError, match="cannot be read"):
        _fit(tmp_path, {"checkpoint.resume": str(bad)})


def test_evaluation_counts_every_sample_once(tmp_path):
    train, held_out = toyjob.make_data(n=256, n_eval=50)
    seen = []

    class Grab(Callback):
        def on_eval(self, trainer, step, metrics):
            seen.append(metrics)

    model, result = _fit(tmp_path, {"run.eval_every": 4, "run.eval_batches": 0},
                         data=train, eval_data=held_out, callbacks=[Grab()])
    assert [m["step"] for m in seen] == [4, 8]
    assert all(m["eval_samples"] == 50 for m in seen)
    x, y = held_out.tensors
    with torch.no_grad():
        expected = F.mse_loss(model(x), y).item()
    assert result.eval_loss == pytest.approx(expected, rel=1e-5)


def test_log_eval_and_checkpoints_run_at_their_own_steps_and_at_the_end(tmp_path):
    # Intervals that do not line up (the loop tests only the next step any of them is
    # due): log every 3, evaluate every 4, checkpoint every 5, in a run of 11 steps.
    train, held_out = toyjob.make_data(n=256, n_eval=16)
    saved = []

    class Saved(Callback):
        def on_checkpoint(self, trainer, step, path):
            saved.append(step)

    _, result = _fit(tmp_path, {"run.max_steps": 11, "log.every": 3, "run.eval_every": 4,
                                "checkpoint.every": 5, "run.eval_batches": 0},
                     data=train, eval_data=held_out, callbacks=[Saved()])
    assert [s for s, _ in result.losses] == [3, 6, 9, 11]  # and the last step's
    assert [s for s, _ in result.eval_losses] == [4, 8, 11]  # the final evaluation
    assert saved == [5, 10, 11]  # the final checkpoint
    assert result.steps == 11


def test_model_without_loss_gets_a_clear_error(tmp_path):
    with pytest.raises(TypeError, match="pass a loss function"):
        gpufleet.fit(toyjob.make_model(), toyjob.make_data(),
                     overrides={"run.out_dir": str(tmp_path), "log.progress": "off"})


def test_batch_larger_than_data_is_a_clear_error(tmp_path):
    with pytest.raises(gpufleet.ConfigError, match=r"fewer than data\.batch_size"):
        _fit(tmp_path, {"data.batch_size": 1000})


def _fit_tokens(tmp_path, overrides, callbacks=()):
    torch.manual_seed(0)
    base = {"run.out_dir": str(tmp_path), "log.progress": "off", "log.every": 1,
            "data.batching": "tokens", "data.token_budget": 512, "optim.warmup_steps": 2,
            "run.max_steps": 12, "optim.lr": 0.05, "data.batch_size": 8}
    return gpufleet.fit(toyjob.BagModel(), toyjob.VarLenData(), toyjob.VarLenData(n=40, seed=1),
                        loss_fn=F.cross_entropy, overrides={**base, **overrides},
                        callbacks=callbacks)


def test_token_budget_batching_trains_and_resumes_exactly(tmp_path):
    full = _fit_tokens(tmp_path / "a", {"checkpoint.every": 4, "run.name": "t"})
    rows = [json.loads(x) for x in open(f"{full.run_dir}/metrics.jsonl") if '"train"' in x]
    assert all(r["tokens_per_s"] > 0 and r["samples_per_s"] > 0 for r in rows)
    assert full.eval_losses[-1][1] > 0
    with pytest.raises(KeyboardInterrupt):
        _fit_tokens(tmp_path / "b", {"checkpoint.every": 4, "run.name": "t"},
                    callbacks=[_StopAt(10)])
    rest = _fit_tokens(tmp_path / "b", {"checkpoint.every": 4, "run.name": "t",
                                        "checkpoint.resume": "latest"})
    assert rest.losses == full.losses[8:]  # resumed from the step-8 checkpoint
    # The bucket sampler's batches, sample by sample: 12 steps of 8, epoch 0 under way.
    for run in (full, rest):
        report = audit(run.run_dir)
        assert report.ok and not report.epochs[0].finished, report.lines()
    assert "resume at step 8" in audit(rest.run_dir).lines()[0]


def test_token_batching_needs_lengths(tmp_path):
    with pytest.raises(gpufleet.ConfigError, match="no `lengths` attribute"):
        _fit(tmp_path, {"data.batching": "tokens", "data.token_budget": 64})
