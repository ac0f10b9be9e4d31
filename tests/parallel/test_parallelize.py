"""Parallelisms composed by degree (gpufleet.parallel.parallelize): eight gloo ranks
started through the CLI train the tiny GPT under a composed layout and end with the
weights of one process on the same global batch, over 20 steps. The pipeline layouts
split the GPT with its own pipeline_stage hook (the tied embedding and head on the
first and last stage)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from equivalence import assert_same_weights
from gpufleet.config import load_config
from gpufleet.errors import ConfigError
from gpufleet.parallel import build_strategy
from gpufleet.parallel.dims import ParallelDims
from gpufleet.parallel.fsdp import ReplicatedTensorParallel
from gpufleet.plan import make_plan
from gpufleet.resolve import Machine, resolve
from gpufleet.train.checkpoint import format as ckpt

CPU = Machine(cuda=False, gpus=0, bf16=False)
STEPS = 20
GPT = ["--model", "meshjob:make_gpt", "--data", "meshjob:make_tokens",
       "--data.num_workers", "0", "--log.every", "5", "--optim.warmup_steps", "2",
       "--run.eval_every", "0", "--run.out_dir", "runs", "--max-steps", str(STEPS),
       "--checkpoint.every", str(STEPS), "--monitor.diagnose", "false"]
# A pipeline's last stage returns logits; the single reference computes the same loss.
LM_LOSS = ("--model.loss", "gpufleet.models.gpt:lm_loss")


def _train(run_cli, tmp_path: Path, name: str, *args: str) -> Path:
    run_cli("train", *GPT, "--run-dir", f"runs/{name}", *args, timeout=500)
    return tmp_path / "runs" / name


def _assert_same(a: Path, b: Path) -> None:
    wa, wb = (ckpt.load_checkpoint(ckpt.list_checkpoints(d)[-1])["model"] for d in (a, b))
    assert_same_weights(wb, wa)


def test_ddp_with_tensor_parallel_is_a_preset_of_degrees():
    cfg = resolve(load_config(overrides=["parallel.strategy=ddp", "parallel.tp=4"]), CPU, 8, 8)
    assert cfg.parallel.strategy == "ddp"
    dims = ParallelDims(dp_replicate=2, tp=4)
    strategy = build_strategy("ddp", cfg.parallel, torch.device("cpu"), None, dims)
    # DDP cannot hold DTensor parameters: the replicas are FSDP2 over a replicate mesh.
    assert isinstance(strategy, ReplicatedTensorParallel) and strategy.saves_on_every_rank
    with pytest.raises(ConfigError, match=r"parallel\.ddp\.comm_hook = 'powersgd'"):
        build_strategy("ddp", load_config(overrides=["parallel.ddp.comm_hook=powersgd"]).parallel,
                       torch.device("cpu"), None, dims)


def test_a_layout_torch_cannot_do_fails_in_resolve_naming_the_degrees():
    with pytest.raises(ConfigError) as e:  # FSDP x PP is the pipeline preset's
        resolve(load_config(overrides=["parallel.strategy=fsdp", "parallel.pp=2"]), CPU, 8, 8)
    assert "parallel.pp = 2 cannot" in str(e.value)
    assert "parallel.strategy = pipeline" in str(e.value)
    with pytest.raises(ConfigError, match="dp_shard=3 x tp=2 multiply to 6"):
        resolve(load_config(overrides=["parallel.strategy=pipeline", "parallel.tp=2",
                                       "parallel.dp_shard=3"]), CPU, 8, 8)


def test_a_tensor_split_that_cuts_attention_heads_fails_before_ranks_start():
    with pytest.raises(ConfigError) as e:  # the GPT's 4 heads over 3 tensor parallel ranks
        make_plan(load_config(overrides=["parallel.strategy=ddp", "parallel.tp=3",
                                         "dist.nproc=6", "run.device=cpu"]))
    assert "parallel.tp = 3 does not divide model.n_head = 4" in str(e.value)
    assert "parallel.tp = 2" in str(e.value) and "model.n_head = 6" in str(e.value)


@pytest.mark.slow  # 8 ranks: layouts_by_degree's fsdp x tp x pp is the default run's one
def test_ddp_2_x_tp_4_on_eight_ranks_equals_single(run_cli, tmp_path):
    single = _train(run_cli, tmp_path, "single", "--batch-size", "8")
    # Two replicas read 4 samples each (the single run's 8); four ranks split each layer.
    both = _train(run_cli, tmp_path, "ddp_tp", "--nproc", "8", "--strategy", "ddp",
                  "--parallel.tp", "4", "--batch-size", "4")
    _assert_same(single, both)


@pytest.mark.slow
def test_hsdp_2_x_2_x_tp_2_on_eight_ranks_equals_single(run_cli, tmp_path):
    single = _train(run_cli, tmp_path, "single", "--batch-size", "8")
    both = _train(run_cli, tmp_path, "hsdp_tp", "--nproc", "8", "--strategy", "hsdp",
                  "--parallel.dp_shard", "2", "--parallel.tp", "2", "--batch-size", "2")
    _assert_same(single, both)


@pytest.mark.slow
@pytest.mark.parametrize("name, degrees, batch", [
    ("ddp_pp", ["--parallel.dp_replicate", "4"], "4"),  # DDP 4 x PP 2
    ("fsdp_pp", ["--parallel.dp_shard", "4"], "4"),  # FSDP 4 x PP 2
    ("fsdp_tp_pp", ["--parallel.dp_shard", "2", "--parallel.tp", "2"], "8"),  # 2 x 2 x 2
    ("ddp_tp_pp", ["--parallel.dp_replicate", "2", "--parallel.tp", "2"], "8"),  # 2 x 2 x 2
])
def test_pipeline_layouts_of_the_gpt_on_eight_ranks_equal_single(run_cli, tmp_path, name,
                                                                  degrees, batch):
    single = _train(run_cli, tmp_path, "single", *LM_LOSS, "--batch-size", "16")
    # pp = 2 takes the ranks the degrees leave; the data parallel ranks read 16 in all.
    both = _train(run_cli, tmp_path, name, *LM_LOSS, "--nproc", "8", "--strategy",
                  "pipeline", *degrees, "--batch-size", batch)
    _assert_same(single, both)


@pytest.mark.slow
def test_fsdp_tp_pp_2x2x2_checkpoint_resumes_as_ddp_4_x_pp_2(run_cli, tmp_path):
    half = ["--checkpoint.every", str(STEPS // 2)]
    single = _train(run_cli, tmp_path, "single", *LM_LOSS, *half, "--batch-size", "16")
    saved = _train(run_cli, tmp_path, "saved", *LM_LOSS, *half, "--nproc", "8", "--strategy",
                   "pipeline", "--parallel.dp_shard", "2", "--parallel.tp", "2",
                   "--batch-size", "8")
    step = saved / "checkpoints" / f"step-{STEPS // 2:07d}"
    assert len(list(step.glob("__*.distcp"))) == 8  # every rank wrote its own part
    # Another layout reads the distributed checkpoint and the data position it saved.
    resumed = _train(run_cli, tmp_path, "resumed", *LM_LOSS, "--nproc", "8", "--strategy",
                     "pipeline", "--parallel.dp_replicate", "4", "--batch-size", "4",
                     "--resume", str(step))
    _assert_same(single, resumed)
