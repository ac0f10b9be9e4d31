"""Parallelisms over one DeviceMesh: the plan's degrees and their errors, the one
gradient norm, and (gloo ranks started through the CLI) HSDP and tensor parallelism
ending with ``single``'s weights on the same global batch, and resuming."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from equivalence import assert_same_weights
from gpufleet.config import load_config
from gpufleet.errors import ConfigError
from gpufleet.launch import DistEnv
from gpufleet.parallel import strategy_class, strategy_names
from gpufleet.parallel.dims import ParallelDims, plan_for
from gpufleet.parallel.grad_norm import (
    clip_grads_,
    clip_whole_,
    grad_norm,
    spreads_gradients,
)
from gpufleet.plan import make_plan
from gpufleet.resolve import Machine, resolve
from gpufleet.train.checkpoint import format as ckpt

CPU = Machine(cuda=False, gpus=0, bf16=False)


def _plan(world: int, *overrides: str, local: int | None = None) -> ParallelDims:
    par = load_config(overrides=list(overrides)).parallel
    return plan_for(par, strategy_class(par.strategy).traits, world, local)


# -- the plan ---------------------------------------------------------------------------
def test_presets_give_the_rest_of_the_ranks_to_their_own_dimension():
    assert _plan(4, "parallel.strategy=ddp") == ParallelDims(dp_replicate=4)
    assert _plan(4, "parallel.strategy=fsdp") == ParallelDims(dp_shard=4)
    assert _plan(4, "parallel.strategy=pipeline") == ParallelDims(pp=4)
    assert _plan(4, "parallel.strategy=pipeline", "parallel.dp_shard=2") == ParallelDims(
        pp=2, dp_shard=2)
    # HSDP: shard within a node (4 ranks each), replicate across the 2 nodes.
    assert _plan(8, "parallel.strategy=hsdp", local=4) == ParallelDims(dp_replicate=2,
                                                                       dp_shard=4)
    assert _plan(4, "parallel.strategy=hsdp", "parallel.dp_shard=2") == ParallelDims(
        dp_replicate=2, dp_shard=2)
    tp = _plan(8, "parallel.strategy=fsdp", "parallel.tp=2")
    assert tp == ParallelDims(dp_shard=4, tp=2) and tp.dp == 4
    # Ranks 0,1 are one layer's two tensor parallel halves: they read the same data.
    assert [tp.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [ParallelDims(pp=2, dp_shard=2).dp_rank(r) for r in range(4)] == [0, 1, 0, 1]


@pytest.mark.parametrize("world, overrides, words", [
    (4, ["parallel.strategy=fsdp", "parallel.dp_shard=3"],
     ["multiply to 3", "has 4 rank(s)", "dp_shard=3"]),
    (4, ["parallel.strategy=hsdp", "parallel.dp_shard=2", "parallel.dp_replicate=3"],
     ["multiply to 6", "has 4 rank(s)"]),
    (6, ["parallel.strategy=fsdp", "parallel.tp=4"], ["multiply to 4", "has 6 rank(s)"]),
    (4, ["parallel.strategy=local_sgd", "parallel.tp=2"],
     ["parallel.tp = 2 cannot", "parallel.strategy = ddp"]),
    (4, ["parallel.strategy=zero1", "parallel.tp=2"], ["parallel.tp = 2 cannot"]),
    (2, ["parallel.strategy=single"], ["independent copies", "ddp"]),
    # The communication hooks are a trait of ddp alone.
    (2, ["parallel.strategy=fsdp", "parallel.ddp.comm_hook=powersgd"],
     ["compresses ddp's", "'fsdp'", "--strategy ddp"]),
])
def test_impossible_degrees_are_refused_by_resolve_with_the_product(world, overrides, words):
    with pytest.raises(ConfigError) as e:
        resolve(load_config(overrides=overrides), CPU, world, world)
    for word in words:
        assert word in str(e.value)


@pytest.mark.parametrize("world, degrees, preset, dims", [
    (8, ["dp_shard=2", "tp=2", "pp=2"], "pipeline", ParallelDims(dp_shard=2, tp=2, pp=2)),
    (4, ["dp_replicate=2", "pp=2"], "pipeline", ParallelDims(dp_replicate=2, pp=2)),
    (8, ["dp_replicate=2", "dp_shard=2", "tp=2"], "fsdp",
     ParallelDims(dp_replicate=2, dp_shard=2, tp=2)),
    (4, ["dp_shard=4"], "fsdp", ParallelDims(dp_shard=4)),
    (4, ["dp_replicate=2", "tp=2"], "ddp", ParallelDims(dp_replicate=2, tp=2)),
    (2, ["tp=2"], "ddp", ParallelDims(tp=2)),
    (4, [], "ddp", ParallelDims(dp_replicate=4)),
    (1, [], "single", ParallelDims()),
])
def test_auto_takes_the_preset_the_degrees_need_once_in_the_plan(world, degrees, preset, dims):
    """Degrees alone (parallel.strategy left at auto) take the preset that runs them; the
    plan records the decision, so nothing downstream decides it again."""
    cfg = load_config(overrides=[f"parallel.{d}" for d in degrees]
                      + [f"dist.nproc={world}", "run.device=cpu"])
    plan = make_plan(cfg, DistEnv.detect({}), machine=CPU)
    assert (plan.strategy, plan.dims) == (preset, dims)
    assert plan.cfg.parallel.strategy == preset  # what config.toml records


@pytest.mark.parametrize("strategy, degree, preset", [
    ("ddp", "pp=2", "pipeline"), ("fsdp", "pp=2", "pipeline"), ("hsdp", "pp=2", "pipeline"),
    ("zero1", "dp_shard=2", "fsdp"), ("local_sgd", "tp=2", "ddp"), ("ddp", "dp_shard=2", "fsdp"),
])
def test_a_named_strategy_is_never_swapped_for_the_preset_of_its_degrees(strategy, degree,
                                                                          preset):
    """The user named the strategy: degrees it cannot use are refused (not silently
    answered with another preset), naming the strategy, the degree and both fixes."""
    name, value = degree.split("=")
    cfg = load_config(overrides=[f"parallel.strategy={strategy}", f"parallel.{degree}",
                                 "dist.nproc=2", "run.device=cpu"])
    with pytest.raises(ConfigError) as e:
        make_plan(cfg, DistEnv.detect({}), machine=CPU)
    message = str(e.value)
    assert f"parallel.{name} = {value} cannot be used with parallel.strategy = {strategy!r}" \
        in message
    assert f"Use parallel.strategy = {preset} (the preset for {name} > 1)" in message
    assert "parallel.strategy = auto" in message and f"parallel.{name} = 1" in message


def test_the_traits_answer_backend_and_processes():
    cfg = resolve(load_config(overrides=["parallel.strategy=hsdp"]), CPU, 4, 4)
    assert cfg.dist.backend == "gloo" and cfg.parallel.strategy == "hsdp"
    assert strategy_class("horovod").traits.backend == "gloo"
    assert strategy_class("dp").traits.one_process
    assert strategy_class("hsdp").traits.reduces_in_backward
    assert not strategy_class("local_sgd").traits.reduces_in_backward
    assert [n for n in strategy_names() if strategy_class(n).traits.comm_hooks] == ["ddp"]


# -- the gradient norm ------------------------------------------------------------------
def test_grad_norm_without_spread_pieces_is_torchs_and_clip_scales_to_max_norm():
    grads = [torch.tensor([3.0, 0.0]), torch.tensor([[4.0]])]
    dims = ParallelDims(dp_replicate=4)  # ddp: every rank holds every gradient
    assert not spreads_gradients(dims)
    norm = grad_norm(grads, torch.device("cpu"), dims)
    assert float(norm) == pytest.approx(5.0)
    clip_grads_(grads, 1.0, norm)
    assert float(torch.cat([g.flatten() for g in grads]).norm()) == pytest.approx(1.0, 1e-5)
    assert spreads_gradients(ParallelDims(dp_shard=2))
    assert spreads_gradients(ParallelDims(pp=2)) and spreads_gradients(ParallelDims(tp=2))


@pytest.mark.parametrize("max_norm", [1e-3, 1e9])  # clipped, and left as it was
def test_the_whole_clip_is_torchs_clip_bit_for_bit_and_keeps_each_norm(max_norm):
    torch.manual_seed(0)
    ours, theirs = (torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1))
                    for _ in range(2))
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(32, 8)
    for model in (ours, theirs):
        model(x).square().mean().backward()
    ours[0].bias.grad = None  # a parameter without a gradient this step
    theirs[0].bias.grad = None
    params = list(ours.parameters())
    norm, each = clip_whole_(params, max_norm, torch.device("cpu"))
    expected = torch.nn.utils.clip_grad_norm_(theirs.parameters(), max_norm, foreach=True)
    assert torch.equal(norm, expected)
    for mine, reference in zip(ours.parameters(), theirs.parameters()):
        assert (mine.grad is None and reference.grad is None) or \
            torch.equal(mine.grad, reference.grad)
    # The norms measured on the way: one per gradient present, before clipping.
    assert each.present == [0, 2, 3] and each.params is params
    assert torch.equal(torch.linalg.vector_norm(each.values), norm)


# -- through the CLI: gloo ranks --------------------------------------------------------
TOY = ["--model", "toyjob:make_model", "--data", "toyjob:make_data",
       "--data.num_workers", "0", "--model.loss", "torch.nn.functional:mse_loss",
       "--log.every", "1", "--optim.warmup_steps", "2", "--run.eval_every", "0",
       "--run.out_dir", "runs", "--max-steps", "8", "--checkpoint.every", "4"]
GPT = ["--model", "meshjob:make_gpt", "--data", "meshjob:make_tokens",
       "--data.num_workers", "0", "--log.every", "1", "--optim.warmup_steps", "2",
       "--run.eval_every", "0", "--run.out_dir", "runs", "--max-steps", "6",
       "--checkpoint.every", "3"]


def _train(run_cli, tmp_path: Path, name: str, job: list[str], *args: str) -> Path:
    run_cli("train", *job, "--run-dir", f"runs/{name}", *args, timeout=400)
    return tmp_path / "runs" / name


def _weights(run_dir: Path, step: int | None = None) -> dict[str, torch.Tensor]:
    paths = ckpt.list_checkpoints(run_dir)
    path = paths[-1] if step is None else next(p for p in paths if f"{step:07d}" in p.name)
    return ckpt.load_checkpoint(path)["model"]


def _assert_same(a: Path, b: Path, step: int | None = None) -> None:
    assert_same_weights(_weights(b, step), _weights(a, step))


def _step_dir(run_dir: Path, step: int) -> str:
    return str(run_dir / "checkpoints" / f"step-{step:07d}")


def _assert_resumes_elsewhere(run_cli, tmp_path: Path, job: list[str], single: Path,
                              step: int, global_batch: int, *args: str) -> None:
    """Resumed at another world size (``args``, with ``--resume``), a run reads the rest
    of the epoch from the checkpoint's global sample position, split over its own ranks;
    so does the reference: the single run's own checkpoint of that step resumed by 2 ddp
    ranks with the same global batch. Both then end with the same weights."""
    other = _train(run_cli, tmp_path, "other", job, *args)
    ref = _train(run_cli, tmp_path, "ref", job, "--nproc", "2", "--strategy", "ddp",
                 "--batch-size", str(global_batch // 2), "--resume",
                 str(single / "checkpoints" / f"step-{step:07d}.pt"))
    _assert_same(ref, other)


@pytest.mark.slow  # hsdp: test_presets.py and the fsdp/hsdp snapshot and recovery tests keep it
def test_hsdp_2x2_on_four_ranks_equals_single_and_resumes_at_four(run_cli, tmp_path):
    single = _train(run_cli, tmp_path, "single", TOY, "--batch-size", "32")
    # 2 replicas x 2 shards, 8 samples per rank: the single run's 32 per step.
    hsdp = _train(run_cli, tmp_path, "hsdp", TOY, "--nproc", "4", "--strategy", "hsdp",
                  "--parallel.dp_shard", "2", "--batch-size", "8")
    _assert_same(single, hsdp, 4)
    _assert_same(single, hsdp)
    step4 = Path(_step_dir(hsdp, 4))
    assert len(list(step4.glob("__*.distcp"))) == 4
    again = _train(run_cli, tmp_path, "again", TOY, "--nproc", "4", "--strategy", "hsdp",
                   "--parallel.dp_shard", "2", "--batch-size", "8", "--resume", str(step4))
    _assert_same(single, again)  # the same world size: the epoch goes on where it was


def test_tensor_parallel_gpt_on_two_ranks_equals_single(run_cli, tmp_path):
    single = _train(run_cli, tmp_path, "single", GPT, "--batch-size", "8")
    # tp = 2: both ranks read the same 8 samples, each computes half of every layer.
    tp = _train(run_cli, tmp_path, "tp", GPT, "--nproc", "2", "--strategy", "fsdp",
                "--parallel.tp", "2", "--batch-size", "8")
    _assert_same(single, tp)


@pytest.mark.slow
def test_tensor_parallel_checkpoint_resumes_at_two_and_at_one(run_cli, tmp_path):
    single = _train(run_cli, tmp_path, "single", GPT, "--batch-size", "8")
    tp = _train(run_cli, tmp_path, "tp", GPT, "--nproc", "2", "--strategy", "fsdp",
                "--parallel.tp", "2", "--batch-size", "8")
    again = _train(run_cli, tmp_path, "again", GPT, "--nproc", "2", "--strategy", "fsdp",
                   "--parallel.tp", "2", "--batch-size", "8", "--resume", _step_dir(tp, 3))
    _assert_same(single, again)  # the same world size: the epoch goes on where it was
    _assert_resumes_elsewhere(run_cli, tmp_path, GPT, single, 3, 8,
                              "--batch-size", "8", "--resume", _step_dir(tp, 3))


@pytest.mark.slow
def test_fsdp_with_tensor_parallel_2x2_equals_single_and_resumes_at_two(run_cli, tmp_path):
    single = _train(run_cli, tmp_path, "single", GPT, "--batch-size", "8")
    both = _train(run_cli, tmp_path, "both", GPT, "--nproc", "4", "--strategy", "fsdp",
                  "--parallel.tp", "2", "--batch-size", "4")
    _assert_same(single, both)
    _assert_resumes_elsewhere(run_cli, tmp_path, GPT, single, 3, 8, "--nproc", "2",
                              "--strategy", "fsdp", "--parallel.tp", "2", "--batch-size", "8",
                              "--resume", _step_dir(both, 3))


@pytest.mark.slow
def test_hsdp_checkpoint_of_four_ranks_resumes_at_two(run_cli, tmp_path):
    single = _train(run_cli, tmp_path, "single", TOY, "--batch-size", "32")
    hsdp = _train(run_cli, tmp_path, "hsdp", TOY, "--nproc", "4", "--strategy", "hsdp",
                  "--parallel.dp_shard", "2", "--batch-size", "8")
    _assert_resumes_elsewhere(run_cli, tmp_path, TOY, single, 4, 32, "--nproc", "2",
                              "--strategy", "hsdp", "--batch-size", "16",
                              "--resume", _step_dir(hsdp, 4))


@pytest.mark.slow  # fsdp x pipeline: test_layouts_by_degree.py keeps an fsdp x tp x pp run
def test_fsdp_with_pipeline_2x2_equals_single(run_cli, tmp_path):
    single = _train(run_cli, tmp_path, "single", TOY, "--batch-size", "32")
    # 2 stages x 2 shards: each pipeline reads 16 samples a step, two pipelines 32.
    both = _train(run_cli, tmp_path, "both", TOY, "--nproc", "4", "--strategy", "pipeline",
                  "--parallel.dp_shard", "2", "--batch-size", "16",
                  "--parallel.pipeline.schedule", "gpipe")
    _assert_same(single, both, 4)
    _assert_same(single, both)


@pytest.mark.slow
def test_fsdp_with_pipeline_checkpoint_resumes_at_four_and_at_two(run_cli, tmp_path):
    single = _train(run_cli, tmp_path, "single", TOY, "--batch-size", "32")
    both = _train(run_cli, tmp_path, "both", TOY, "--nproc", "4", "--strategy", "pipeline",
                  "--parallel.dp_shard", "2", "--batch-size", "16")
    again = _train(run_cli, tmp_path, "again", TOY, "--nproc", "4", "--strategy", "pipeline",
                   "--parallel.dp_shard", "2", "--batch-size", "16",
                   "--resume", _step_dir(both, 4))
    _assert_same(single, again)  # the same world size: the epoch goes on where it was
    _assert_resumes_elsewhere(run_cli, tmp_path, TOY, single, 4, 32, "--nproc", "2",
                              "--strategy", "pipeline", "--batch-size", "32",
                              "--resume", _step_dir(both, 4))


def test_tensor_parallel_of_a_model_without_a_plan_names_the_hook(run_cli):
    proc = run_cli("train", *TOY, "--nproc", "2", "--strategy", "fsdp", "--parallel.tp", "2",
                   "--batch-size", "8", expect=1)
    assert "has no built-in tensor parallel plan" in proc.stderr
    assert "tp_plan(self, tp_mesh)" in proc.stderr
