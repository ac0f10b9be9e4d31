"""Evaluation metrics (eval.metrics): exact across ranks, shown where the loss is."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

import gpufleet
import toyjob
from conftest import final_params
from gpufleet.config import load_config
from gpufleet.errors import ConfigError
from gpufleet.train.evalmetrics import accuracy, build_metrics

METRICS = "accuracy,top5_accuracy,perplexity,toyjob:true_class_prob"


def _expected(model: torch.nn.Module, data) -> dict[str, float]:
    """The metrics computed in one process, over the whole eval set at once."""
    x, y = data.tensors
    with torch.no_grad():
        out = model(x)
    top5 = out.topk(5, -1).indices
    return {"loss": F.cross_entropy(out, y).item(),
            "accuracy": (out.argmax(-1) == y).double().mean().item(),
            "top5_accuracy": (top5 == y[:, None]).any(-1).double().mean().item(),
            "true_class_prob": out.softmax(-1).gather(-1, y[:, None]).mean().item()}


def test_two_ranks_reduce_the_metrics_exactly(run_cli, tmp_path):
    proc = run_cli("train", "--model", "toyjob:make_classifier", "--data",
                   "toyjob:make_class_data", "--model.loss", "torch.nn.functional:cross_entropy",
                   "--nproc", "2", "--strategy", "ddp", "--max-steps", "6", "--batch-size", "8",
                   "--run.eval_every", "3", "--run.eval_batches", "0", "--log.every", "3",
                   f"--eval.metrics={METRICS}", "--run-dir", "runs/cls", "--log.progress",
                   "lines")
    run_dir = tmp_path / "runs" / "cls"
    evals = [r for r in map(json.loads, open(run_dir / "metrics.jsonl"))
             if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [3, 6] and evals[-1]["eval_samples"] == 51
    model = toyjob.make_classifier()
    model.load_state_dict(final_params(run_dir))  # the weights the last evaluation saw
    want = _expected(model, toyjob.make_class_data()[1])
    got = evals[-1]["eval_metrics"]
    assert evals[-1]["eval_loss"] == pytest.approx(want["loss"], rel=1e-5)
    for name in ("accuracy", "top5_accuracy", "true_class_prob"):
        assert got[name] == pytest.approx(want[name], rel=1e-5), name
    assert got["perplexity"] == pytest.approx(math.exp(want["loss"]), rel=1e-5)
    # Shown in the progress lines and in the summary.
    assert f"accuracy {got['accuracy']:.4f}" in proc.stderr
    assert "eval accuracy" in proc.stdout and f"{got['accuracy']:.4f}" in proc.stdout


def test_metrics_reach_the_result_and_callbacks_in_python(tmp_path):
    train, held_out = toyjob.make_class_data()
    torch.manual_seed(0)
    model = toyjob.make_classifier()
    result = gpufleet.fit(model, train, held_out, loss_fn=F.cross_entropy, overrides={
        "run.dir": str(tmp_path / "r"), "run.max_steps": 4, "run.eval_every": 2,
        "run.eval_batches": 0, "log.progress": "off", "eval.metrics": "accuracy"},
        eval_metrics={"p_true": toyjob.true_class_prob})  # a callable, no import string
    assert [s for s, _ in result.eval_metrics] == [2, 4]
    want = _expected(model, held_out)
    assert result.eval_metrics[-1][1] == {
        "accuracy": pytest.approx(want["accuracy"], rel=1e-6),
        "p_true": pytest.approx(want["true_class_prob"], rel=1e-5)}


def test_token_accuracy_skips_ignored_positions():
    logits = torch.tensor([[[0.0, 1.0], [1.0, 0.0], [1.0, 0.0]]])  # predicts 1, 0, 0
    target = torch.tensor([[1, 1, -100]])
    assert [int(v) for v in accuracy(logits, target)] == [1, 2]


def test_unknown_metric_names_the_choices_and_a_bad_import_is_clear():
    with pytest.raises(ConfigError, match="Did you mean 'accuracy'"):
        load_config(overrides=["--eval.metrics=acuracy"])
    with pytest.raises(ConfigError, match="cannot import module 'nosuchmod'"):
        build_metrics("accuracy,nosuchmod:fn")
