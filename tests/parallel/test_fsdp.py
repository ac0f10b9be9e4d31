"""``fsdp`` (FSDP2) on CPU with gloo ranks, started through the CLI; and the sharded
checkpoint directory it writes (torch.distributed.checkpoint), which loads at another
world size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from equivalence import assert_same_weights
from gpufleet.errors import CheckpointError, ConfigError
from gpufleet.parallel.fsdp import blocks_to_shard
from gpufleet.train.checkpoint import format as ckpt
from gpufleet.train.checkpoint import sharded

# 256 training samples; 17 evaluation samples split 9/8 over two ranks: in batches of 8,
# rank 0 has two and rank 1 one, which rank 1 repeats (uncounted) for the sharded forward.
TOY = ["--model", "toyjob:make_model", "--data", "toyjob:make_data",
       "--data.kwargs={n_eval = 17}", "--run.eval_every", "4", "--data.num_workers", "0",
       "--model.loss", "torch.nn.functional:mse_loss", "--log.every", "1",
       "--optim.warmup_steps", "2", "--run.out_dir", "runs",
       # Two parameter groups (decay on matrices), as the optimizer built below has.
       "--optim.preset", "gpt"]


def _train(run_cli, tmp_path: Path, name: str, *args: str) -> Path:
    proc = run_cli("train", *TOY, "--run-dir", f"runs/{name}", *args)
    if "--resume" in args:
        assert "resumed from" in proc.stderr and "at step 6" in proc.stderr
    return tmp_path / "runs" / name


def _final(run_dir: Path) -> dict[str, torch.Tensor]:
    """The model weights of a run's newest checkpoint (a file or a sharded directory)."""
    return ckpt.load_checkpoint(ckpt.list_checkpoints(run_dir)[-1])["model"]


def _assert_same(a: Path, b: Path) -> None:
    assert_same_weights(_final(b), _final(a))


def _evals(run_dir: Path) -> list[tuple[int, float, int]]:
    return [(r["step"], r["eval_loss"], r["eval_samples"])
            for r in map(json.loads, open(run_dir / "metrics.jsonl")) if r["kind"] == "eval"]


def _steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in map(json.loads, open(run_dir / "metrics.jsonl"))
            if r["kind"] == "train"]


# -- through the CLI: two gloo ranks ----------------------------------------------------
def test_fsdp_with_accumulation_equals_single_and_its_async_checkpoint_loads_at_one_rank(
        run_cli, tmp_path):
    single = _train(run_cli, tmp_path, "single", "--max-steps", "12", "--batch-size", "32",
                    "--checkpoint.every", "6")
    # 2 ranks x 8 samples x 2 micro-steps = the single run's 32 samples per step.
    # Written in the background (every rank its shards; the synchronous sharded save
    # runs in the resume test below and in-process further down): the files hold the
    # state of the step they were taken at.
    fsdp = _train(run_cli, tmp_path, "fsdp", "--max-steps", "12", "--nproc", "2",
                  "--strategy", "fsdp", "--batch-size", "8", "--grad-accum", "2",
                  "--checkpoint.every", "6", "--checkpoint.async_save", "true")
    _assert_same(single, fsdp)
    sharded.verify_sharded(fsdp / "checkpoints" / "step-0000012")
    for (s1, l1, n1), (s2, l2, n2) in zip(_evals(single), _evals(fsdp), strict=True):
        assert (s1, n1) == (s2, n2) == (s1, 17)  # uneven eval shards: every sample once
        assert l1 == pytest.approx(l2, rel=1e-5)
    step6 = fsdp / "checkpoints" / "step-0000006"
    assert (step6 / ckpt.MANIFEST).is_file() and len(list(step6.glob("__*.distcp"))) == 2
    # Resharded from 2 ranks to this one process: weights and AdamW moments equal the
    # single run's at the same step.
    import toyjob
    from gpufleet.train.optim import param_groups

    model = toyjob.make_model()
    opt = torch.optim.AdamW(param_groups(model, 0.1))
    sharded.load_sharded_into(step6, model, opt)
    want = ckpt.load_checkpoint(single / "checkpoints" / "step-0000006.pt")
    assert_same_weights(model.state_dict(), want["model"])
    got = opt.state_dict()["state"]
    assert got.keys() == want["optimizer"]["state"].keys()
    for i, moments in want["optimizer"]["state"].items():
        assert_same_weights({k: got[i][k] for k in ("step", "exp_avg", "exp_avg_sq")},
                            {k: moments[k] for k in ("step", "exp_avg", "exp_avg_sq")})


@pytest.mark.slow
def test_fsdp_checkpoint_of_two_ranks_resumes_at_one_and_at_four(run_cli, tmp_path):
    fsdp = _train(run_cli, tmp_path, "fsdp", "--max-steps", "12", "--nproc", "2",
                  "--strategy", "fsdp", "--batch-size", "16", "--checkpoint.every", "6")
    single = _train(run_cli, tmp_path, "single", "--max-steps", "12", "--batch-size", "32",
                    "--checkpoint.every", "6")
    _assert_same(single, fsdp)  # without accumulation too
    step6 = str(fsdp / "checkpoints" / "step-0000006")
    one = _train(run_cli, tmp_path, "one", "--max-steps", "12", "--batch-size", "32",
                 "--resume", step6)
    four = _train(run_cli, tmp_path, "four", "--max-steps", "12", "--nproc", "4",
                  "--strategy", "fsdp", "--batch-size", "8", "--resume", step6)
    # The reference: the single run's (single-file) step-6 checkpoint resumed by 2 ddp
    # ranks. Every resume changes the world size, so each restarts epoch 0 with 32
    # samples per step: the same data, the same updates.
    ref = _train(run_cli, tmp_path, "ref", "--max-steps", "12", "--nproc", "2",
                 "--strategy", "ddp", "--batch-size", "16", "--resume",
                 str(single / "checkpoints" / "step-0000006.pt"))
    assert _steps(one) == _steps(four) == list(range(7, 13))
    assert len(list((four / "checkpoints" / "step-0000012").glob("__*.distcp"))) == 4
    _assert_same(ref, one)
    _assert_same(ref, four)


@pytest.mark.slow
def test_fsdp_bf16_with_cpu_offload_and_class_wrapping_tracks_single(run_cli, tmp_path):
    bf16 = ["--precision.mode", "bf16-mixed", "--max-steps", "12"]
    single = _train(run_cli, tmp_path, "single", *bf16, "--batch-size", "32")
    fsdp = _train(run_cli, tmp_path, "fsdp", *bf16, "--nproc", "2", "--strategy", "fsdp",
                  "--batch-size", "16", "--parallel.fsdp.cpu_offload", "true",
                  "--parallel.fsdp.reshard_after_forward", "false",
                  "--parallel.fsdp.wrap", "Linear")
    # bf16 compute: close, not equal (FSDP casts per module, autocast per operation).
    for (_, l1, _), (_, l2, _) in zip(_evals(single), _evals(fsdp), strict=True):
        assert l1 == pytest.approx(l2, rel=2e-2)


# -- in this process: wrapping and the checkpoint directory ----------------------------
class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3))
        self.head = nn.Linear(8, 1)


def test_auto_wrap_takes_the_blocks_of_the_largest_container():
    net = _Net()
    assert blocks_to_shard(net, "auto") == list(net.blocks)
    linears = blocks_to_shard(net, "Linear")
    assert len(linears) == 5 and linears[0] is net.head  # innermost/last first
    with pytest.raises(ConfigError, match=r"'Linaer'.*Did you mean 'Linear'.*ModuleList"):
        blocks_to_shard(net, "Linaer")


def _save_sharded(run_dir: Path, step: int, keep_last: int = 5) -> Path:
    torch.manual_seed(step)
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return sharded.save_sharded_checkpoint(run_dir, step, {"model": msd, "optimizer": osd},
                                        {"step": step, "epoch": 0}, keep_last)


def test_sharded_checkpoints_are_listed_pruned_verified_and_read_back(tmp_path):
    ckpt.save_checkpoint(tmp_path, 1, {"step": 1}, keep_last=5)  # a single file among them
    paths = [_save_sharded(tmp_path, step, keep_last=3) for step in (2, 3, 4)]
    assert ckpt.list_checkpoints(tmp_path) == paths  # step 1 pruned (keep 3)
    newest = paths[-1]
    assert sorted(p.name for p in newest.iterdir()) == [
        ".metadata", ckpt.MANIFEST, "__0_0.distcp", ckpt.TRAINER_STATE]
    state = ckpt.load_checkpoint(newest)
    assert state["step"] == 4 and state["sharded"] and state["model"]["weight"].shape == (2, 4)
    torch.manual_seed(4)
    assert torch.equal(state["model"]["bias"], _reference_bias())
    assert ckpt.find_resume_checkpoint(str(newest), "runs", "x") == newest
    # A damaged shard fails the manifest; the newest intact one is taken instead.
    shard = newest / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp is not what was written"):
        ckpt.verify_checkpoint(newest)
    assert ckpt.find_resume_checkpoint(str(tmp_path), "runs", "x") == paths[1]
    # A directory that was never completed (no manifest) is not trusted either.
    (paths[1] / ckpt.MANIFEST).unlink()
    with pytest.raises(CheckpointError, match="never completed"):
        ckpt.verify_checkpoint(paths[1])


def _reference_bias() -> torch.Tensor:
    """The bias _save_sharded's model ends with (same seed, same step)."""
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model.bias.detach()


def test_an_interrupted_sharded_write_leaves_nothing_under_the_real_name(tmp_path):
    good = _save_sharded(tmp_path, 1)
    staging = good.with_name(".step-0000002.tmp-sharded")
    staging.mkdir()
    (staging / "__0_0.distcp").write_bytes(b"half")  # a writer died here
    _save_sharded(tmp_path, 3)
    assert not staging.exists()
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-0000001", "step-0000003"]


def test_sharded_checkpoint_loads_into_a_plain_model_and_optimizer(tmp_path):
    path = _save_sharded(tmp_path, 7)
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())  # no step taken: no state yet
    sharded.load_sharded_into(path, model, opt)
    assert torch.equal(model.weight, sharded.read_full_model(path)["weight"])
    state = opt.state_dict()["state"]
    assert len(state) == 2 and float(state[0]["step"]) == 1.0
    (path / "__0_0.distcp").unlink()
    with pytest.raises(RuntimeError):
        sharded.load_sharded_into(path, model, opt)


def test_a_sharded_write_that_fails_raises_oserror_and_leaves_the_old_ones(tmp_path):
    good = _save_sharded(tmp_path, 1)
    blocker = tmp_path / "checkpoints" / ".step-0000002.tmp-sharded"
    blocker.write_text("a file where the staging folder must go")
    with pytest.raises(OSError):
        _save_sharded(tmp_path, 2)
    assert ckpt.list_checkpoints(tmp_path) == [good]
    ckpt.verify_checkpoint(good)


def _clip_on_one_rank() -> tuple[float, float, list[float], list[str]]:
    """FSDP2 over a one-rank mesh (what a survivor alone, or an elastic run down to one
    node, trains with): the norm measured and clipped, next to torch's on a plain copy."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gpufleet.launch import DistEnv, destroy_process_group, init_process_group
    from gpufleet.parallel.dims import ParallelDims
    from gpufleet.parallel.grad_norm import clip_whole_, grad_norm

    init_process_group(DistEnv.detect(), "gloo", timeout_s=60)
    try:
        torch.manual_seed(0)
        plain = nn.Linear(4, 3)
        sharded_model = nn.Linear(4, 3)
        sharded_model.load_state_dict(plain.state_dict())
        fully_shard(sharded_model, mesh=init_device_mesh("cpu", (1,)))
        x = torch.randn(8, 4)
        for model in (plain, sharded_model):
            (model(x) ** 2).sum().backward()
        expected = float(torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5))
        params = list(sharded_model.parameters())
        measured = grad_norm([p.grad for p in params], torch.device("cpu"), ParallelDims())
        norm, each = clip_whole_(params, 0.5, torch.device("cpu"))
        clipped = [float(a.to_local().sub(b).abs().max())
                   for a, b in zip((p.grad for p in params), (p.grad for p in plain.parameters()))]
        # Plain tensors, as the log interval's one host read (tolist) needs them.
        kinds = [type(t).__name__ for t in (norm, measured, each.values)]
        return float(norm) - expected, float(measured) - expected, clipped, kinds
    finally:
        destroy_process_group()


def test_fsdp_on_one_rank_clips_its_dtensor_gradients_like_torch():
    from gpufleet.launch import launch

    norm_diff, measured_diff, clipped_diffs, kinds = launch(_clip_on_one_rank, nproc=1,
                                                            launcher="spawn")[0]
    assert norm_diff == 0.0 and measured_diff == 0.0
    assert max(clipped_diffs) == 0.0
    assert kinds == ["Tensor"] * 3
