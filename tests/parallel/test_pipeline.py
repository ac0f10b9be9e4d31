"""``pipeline``: stage planning, and 2 gloo ranks (GPipe and 1F1B) against ``single``."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from conftest import final_params
from equivalence import assert_same_weights
from gpufleet.errors import ConfigError
from gpufleet.models.gpt import GPT, GPTConfig, lm_loss
from gpufleet.parallel.dims import ParallelDims
from gpufleet.parallel.parallelize import distribute
from gpufleet.parallel.pipeline_split import (
    balanced_split,
    bubble_share,
    keep_stage,
    plan_stages,
    sequential_units,
    stage_module,
)
from meshjob import make_tokens

TOY = ["--model", "toyjob:make_model", "--data", "toyjob:make_data",
       "--model.loss", "torch.nn.functional:mse_loss", "--max-steps", "6",
       "--log.every", "1", "--optim.warmup_steps", "2", "--run.out_dir", "runs",
       "--batch-size", "16", "--monitor.report", "false"]


def _deep() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8),
                         nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)),
                         nn.Linear(8, 2))


def test_balanced_split_minimises_the_largest_stage():
    assert balanced_split([10, 10, 10, 10], 2) == [0, 2]
    assert balanced_split([100, 1, 1, 1], 2) == [0, 1]
    assert balanced_split([1, 1, 1, 1], 4) == [0, 1, 2, 3]


def test_nested_sequentials_open_up_and_stages_keep_the_full_names():
    net = _deep()
    units = sequential_units(net)
    assert [n for n, _ in units] == ["0", "1.0", "1.1", "1.2", "2"]
    starts = plan_stages(units, 2, "1.1")
    assert starts == [0, 2]
    first, second = stage_module(net, units, 0, 2), stage_module(net, units, 2, 5)
    assert list(first.state_dict()) == ["0.weight", "0.bias", "1.0.weight", "1.0.bias"]
    assert {**first.state_dict(), **second.state_dict()}.keys() == net.state_dict().keys()
    x = torch.randn(3, 4)
    torch.testing.assert_close(second(first(x)), net(x))
    assert plan_stages(units, 2, "1") == [0, 1]  # a container's name starts at its first layer


@pytest.mark.parametrize("stages, split, words", [
    (2, "1.7", ["no layer '1.7'", "Layers in order"]),
    (3, "1.2,1.0", ["does not come after"]),
    (3, "1.0", ["names 1 split point", "need 2"]),
])
def test_bad_split_points_name_the_layers(stages, split, words):
    with pytest.raises(ConfigError) as err:
        plan_stages(sequential_units(_deep()), stages, split)
    for word in words:
        assert word in str(err.value)


def test_models_with_their_own_forward_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"nn\.Sequential"):
        sequential_units(nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="at least 3 layers"):
        plan_stages(sequential_units(nn.Sequential(nn.Linear(2, 2), nn.ReLU())), 3, "")


def _first_stage_of_the_gpt() -> tuple[list[list[str]], list[tuple[str, str]], bool,
                                       list[str]]:
    """Rank 0's stage of a GPT cut in two (a one-rank process group: the cut reads only
    the rank): the layers of each stage, the ties, whether the loss hook was found, and
    the stage's state-dict names."""
    from gpufleet.launch import DistEnv, destroy_process_group, init_process_group

    init_process_group(DistEnv.detect(), "gloo", timeout_s=60)
    try:
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16))
        split = keep_stage(model, ParallelDims(pp=2), None, "", torch.device("cpu"))
        return split.layers, split.tied, split.loss is not None, list(split.module.state_dict())
    finally:
        destroy_process_group()


def test_a_model_with_its_own_stage_hooks_is_cut_by_them():
    from gpufleet.launch import launch

    layers, tied, has_loss, names = launch(_first_stage_of_the_gpt, nproc=1,
                                           launcher="spawn")[0]
    assert layers == [["embed", "blocks.0"], ["blocks.1", "head"]]  # pipeline_units, halved
    assert tied == [("wte.weight", "lm_head.weight")]  # pipeline_ties
    assert has_loss  # pipeline_loss
    # pipeline_stage's module: the first stage's layers under the whole model's names
    assert "wte.weight" in names and "blocks.0.attn.c_attn.weight" in names
    assert not any(n.startswith(("blocks.1.", "lm_head", "ln_f")) for n in names)


def test_bubble_share():
    assert bubble_share(2, 4) == pytest.approx(1 / 5)
    assert bubble_share(1, 8) == 0.0


def _train(run_cli, tmp_path, name, *args):
    proc = run_cli("train", *TOY, "--run-dir", f"runs/{name}", *args)
    return tmp_path / "runs" / name, proc


def _losses(run_dir, kind="train"):
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return [r["loss" if kind == "train" else "eval_loss"] for r in rows if r["kind"] == kind]


def _same(a, b):
    assert_same_weights(final_params(b), final_params(a))


@pytest.mark.slow  # pipeline equals single: test_recipe.py's pipeline case keeps it
def test_gpipe_and_1f1b_on_two_ranks_equal_single(run_cli, tmp_path):
    """Same global batch (16 samples, 4 micro-batches, 2 accumulation steps, clipping on):
    both schedules end with single's parameters, optimizer state and loss curve."""
    common = ["--grad-accum", "2", "--optim.clip_norm", "0.5", "--data.kwargs={n_eval = 40}",
              "--run.eval_every", "3"]
    single, _ = _train(run_cli, tmp_path, "single", *common)
    for schedule in ("gpipe", "1f1b"):
        run, proc = _train(run_cli, tmp_path, schedule, *common, "--nproc", "2",
                           "--launcher", "spawn",
                           "--strategy", "pipeline", "--parallel.pipeline.microbatches", "4",
                           "--parallel.pipeline.schedule", schedule)
        _same(single, run)
        assert _losses(run) == pytest.approx(_losses(single), rel=1e-4)
        assert _losses(run, "eval") == pytest.approx(_losses(single, "eval"), rel=1e-4)
        assert len(_losses(run, "eval")) == 2  # steps 3 and 6
        assert "bubble share 20.0%" in proc.stderr
        ckpt = torch.load(sorted((run / "checkpoints").glob("step-*.pt"))[-1],
                          weights_only=True)
        ref = torch.load(sorted((single / "checkpoints").glob("step-*.pt"))[-1],
                         weights_only=True)
        # The gathered optimizer state is laid out exactly as a single process's.
        assert ckpt["optimizer"]["param_groups"] == ref["optimizer"]["param_groups"]
        for i, s in ref["optimizer"]["state"].items():
            for key, value in s.items():
                torch.testing.assert_close(ckpt["optimizer"]["state"][i][key], value,
                                           rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_pipeline_resumes_from_its_checkpoint_and_evaluates(run_cli, tmp_path):
    args = ["--nproc", "2", "--strategy", "pipeline", "--parallel.pipeline.schedule",
            "1f1b", "--optim.decay", "constant", "--name", "pp",
            "--data", "toyjob:make_data", "--data.kwargs={n_eval = 40}", "--run.eval_every", "3"]
    straight, _ = _train(run_cli, tmp_path, "straight", *args)
    run_cli("train", *TOY, *args, "--max-steps", "3")
    run_cli("train", *TOY, *args, "--resume", "latest")
    (resumed,) = (tmp_path / "runs").glob("pp-*")
    assert _losses(resumed) == pytest.approx(_losses(straight), rel=1e-5)
    _same(straight, resumed)
    evals = [json.loads(line) for line in open(resumed / "metrics.jsonl")]
    evals = [r for r in evals if r["kind"] == "eval"]
    assert evals and all(r["eval_loss"] == r["eval_loss"] for r in evals)  # finite


def test_fp16_loss_scaling_is_refused_with_the_alternative():
    from gpufleet.config import ParallelConfig
    from gpufleet.parallel import build_strategy
    from gpufleet.precision import build_precision

    fp16 = build_precision("fp16-mixed", "cpu")
    strategy = build_strategy("pipeline", ParallelConfig(), torch.device("cpu"), fp16)
    with pytest.raises(ConfigError, match="bf16-mixed"):
        distribute(_deep(), strategy)


class _GPTWithoutStageLoss(GPT):
    """A model that computes its loss in its own forward and can be cut into stages,
    but does not say how its last stage turns the output into that loss."""

    pipeline_loss = None


@pytest.mark.parametrize("model, loss_fn, refused", [
    (_GPTWithoutStageLoss, None, True),
    (_GPTWithoutStageLoss, lm_loss, False),  # a loss function of the user's
    (GPT, None, False),  # the built-in GPT's pipeline_loss
])
def test_a_pipeline_without_a_loss_for_its_last_stage_is_refused_before_ranks_start(
        model, loss_fn, refused):
    """The preflight runs the whole model (which computes its own loss); the stages never
    do, so without a loss function or a pipeline_loss hook the run is refused here, not
    at step 0 on the last rank."""
    from gpufleet.config import load_config
    from gpufleet.job import Job
    from gpufleet.train.preflight import preflight_job

    cfg = load_config(overrides={"parallel.strategy": "pipeline", "run.device": "cpu"})
    job = Job(model(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)),
              make_tokens(8), loss_fn=loss_fn)
    if not refused:
        assert preflight_job(cfg, job) is job
        return
    with pytest.raises(ConfigError) as e:
        preflight_job(cfg, job)
    assert "_GPTWithoutStageLoss" in str(e.value)
    assert "--model.loss" in str(e.value) and "pipeline_loss(output, target)" in str(e.value)
