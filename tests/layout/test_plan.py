"""gpufleet plan: degrees, devices, the printed plan, and its memory against a real run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from gpufleet.config import load_config
from gpufleet.errors import ConfigError
from gpufleet.layout.cli import layout_dims, trainable_with
from gpufleet.layout.devices import GIB, named_device
from gpufleet.layout.estimate import estimate_layout
from gpufleet.layout.measure import MemoryParts, saved_activation_bytes
from gpufleet.layout.saved import saved_bytes
from gpufleet.models.gpt import GPT, GPTConfig
from gpufleet.parallel.dims import ParallelDims
from meshjob import make_gpt, make_tokens

PARTS = ("params", "grads", "optimizer", "activations")


def test_degrees_left_at_zero_go_to_the_strategys_own_dimension():
    cfg = load_config(overrides={"parallel.tp": 8, "parallel.pp": 2})
    assert layout_dims(cfg, 128, 8) == ParallelDims(pp=2, dp_replicate=8, tp=8)
    fsdp = load_config(overrides={"parallel.strategy": "fsdp", "parallel.tp": 2})
    assert layout_dims(fsdp, 16, 8) == ParallelDims(dp_shard=8, tp=2)
    hsdp = load_config(overrides={"parallel.strategy": "hsdp"})
    assert layout_dims(hsdp, 16, 8) == ParallelDims(dp_replicate=2, dp_shard=8)
    with pytest.raises(ConfigError, match="do not multiply to the 16 ranks"):
        layout_dims(load_config(overrides={"parallel.tp": 3}), 16, 8)


def test_a_layout_says_which_strategy_trains_it_today():
    cfg = load_config()
    assert trainable_with(cfg, ParallelDims(dp_shard=4, tp=2), 8) == "fsdp"
    assert trainable_with(cfg, ParallelDims(dp_replicate=8), 8) == "ddp"
    # DDP x TP x PP: the pipeline preset over the one mesh.
    assert trainable_with(cfg, ParallelDims(pp=2, dp_replicate=2, tp=2), 8) == "pipeline"


def test_named_devices_and_their_mistakes():
    assert named_device("H100-80GB").memory_bytes == 80 * GIB
    assert named_device("24").memory_bytes == 24 * GIB
    # precision "auto" is planned as a run on that GPU resolves it
    assert named_device("a100-40gb").precision("auto") == "bf16-mixed"
    assert named_device("v100-32gb").precision("auto") == "fp32"
    assert named_device("t4-16gb").precision("fp16-mixed") == "fp16-mixed"
    with pytest.raises(ConfigError, match="no bf16 support"):
        named_device("v100-16gb").precision("bf16-mixed")
    with pytest.raises(ConfigError, match="Did you mean 'h100-80gb'"):
        named_device("h100-80g")


def test_sharding_divides_parameters_gradients_and_optimizer_state():
    cfg = load_config(overrides={"data.batch_size": 4})
    whole = estimate_layout(cfg, ParallelDims(), make_gpt).ranks[0]
    sharded = estimate_layout(cfg, ParallelDims(dp_shard=4), make_gpt).ranks[0]
    n = sum(p.numel() for p in make_gpt().parameters())
    assert whole.params == whole.grads == 4 * n and whole.optimizer == 8 * n
    assert sharded.params < whole.params / 3  # embeddings and blocks split 4 ways
    assert sharded.activations == whole.activations  # the same micro-batch
    assert set(sharded.comm) == {"dp_shard"} and not whole.comm


@pytest.mark.slow  # the four-rank planned-memory test keeps plan
def test_plan_prints_a_128_rank_layout_and_the_nearest_that_fits(run_cli):
    big = ["--nnodes", "16", "--nproc", "8", "--parallel.tp", "8", "--parallel.pp", "2",
           "--model.n_layer", "24", "--model.n_head", "16", "--model.n_embd", "2048",
           "--model.block_size", "2048", "--batch-size", "16", "--precision", "bf16-mixed"]
    fits = run_cli("plan", *big, "--gpu", "h100-80gb", timeout=200)
    out = fits.stdout
    assert "pp=2 x dp_replicate=8 x tp=8 = 128 ranks" in out
    assert "memory per rank" in out and "sent on tp" in out and "FLOPs" in out
    assert "fits." in out and "runs this layout with --strategy pipeline" in out
    tight = run_cli("plan", *big, "--gpu", "6", expect=1, timeout=200).stdout
    assert "does NOT fit" in tight
    assert "nearest layout that fits" in tight or "no layout of this many ranks" in tight


def test_planned_memory_matches_a_real_four_rank_fsdp_tp_run(tmp_path):
    """The planner's parameters, gradients, optimizer state and activations against
    what the ranks of a real 2 x 2 fsdp x tp run hold after a step (within 10%)."""
    import gpufleet

    data = make_tokens(64)
    batch = (data.tensors[0][:4], data.tensors[1][:4])
    settings = {"dist.nproc": 4, "parallel.strategy": "fsdp", "parallel.tp": 2,
                "data.batch_size": 4}
    result = gpufleet.fit(make_gpt(), data, overrides={
        **settings, "run.max_steps": 2, "run.eval_every": 0, "data.num_workers": 0,
        "log.progress": "off", "run.out_dir": str(tmp_path), "monitor.report": False},
        callbacks=[MemoryParts(batch)])
    measured = [json.loads(p.read_text())
                for p in sorted(Path(result.run_dir).glob("memory-rank*.json"))]
    assert len(measured) == 4
    cfg = load_config(overrides=settings)
    est = estimate_layout(cfg, ParallelDims(dp_shard=2, tp=2), make_gpt).ranks[0]
    for real in measured:
        for part in PARTS:
            assert abs(getattr(est, part) - real[part]) <= 0.10 * real[part], (part, est, real)


def test_saved_activations_at_bf16_are_what_a_real_cpu_forward_saves():
    """The CPU's autocast applies to the planner's forward (it does nothing to meta
    tensors): a small GPT's saved bytes at bf16 match a real forward's to the byte."""
    def gpt() -> GPT:
        return GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128))

    x, y = torch.randint(0, 256, (2, 4, 64))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        real = saved_activation_bytes(gpt(), (x,), y)
    with torch.device("meta"):
        meta = gpt()
    tokens = torch.zeros(4, 64, dtype=torch.long, device="meta")
    assert saved_bytes(meta, (tokens, tokens.clone()), torch.bfloat16, "cpu") == real


def test_saved_activations_for_a_gpu_follow_cudas_autocast():
    """A hand count of what CUDA's autocast saves, where the CPU's saves less: CUDA runs
    layer_norm and softmax in fp32, the CPU in bf16."""
    n = 10
    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Softmax(-1),
                            nn.Linear(32, 8))
    x = torch.empty(n, 16, device="meta")
    cuda = (16 * n * 2  # the input cast to bf16, for the first matmul
            + 32 * n * 4 + 2 * n * 4  # layer_norm's input cast to fp32; mean and rstd
            + 32 * n * 4  # softmax's fp32 result
            + 32 * n * 2 + 32 * 8 * 2)  # the result and the weight cast to bf16
    assert saved_bytes(net, (x,), torch.bfloat16, "cuda") == cuda
    assert saved_bytes(net, (x,), torch.bfloat16, "cpu") < 0.6 * cuda
    assert saved_bytes(net, (x,), None, "cuda") == (16 + 32 + 2 + 32) * n * 4  # fp32


@pytest.mark.gpu
def test_planned_memory_is_near_a_real_gpu_steps_peak():
    """One rank of the built-in GPT at bf16 on this GPU: the planner's total against
    the step's peak allocated memory."""
    from gpufleet.models.gpt import build_gpt

    cfg = load_config(overrides={"data.batch_size": 8, "precision.mode": "bf16-mixed",
                                 "parallel.ddp.gradient_as_bucket_view": True})

    def model() -> torch.nn.Module:
        return build_gpt(n_layer=12, n_head=12, n_embd=768, block_size=1024)

    est = estimate_layout(cfg, ParallelDims(), model, device_type="cuda").ranks[0]
    net = model().cuda()
    opt = torch.optim.AdamW(net.parameters(), fused=True)
    x = torch.randint(0, 256, (8, 1024), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    for _ in range(2):  # the second step has the optimizer state
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = net(x, targets=x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated()
    assert 0.8 * peak <= est.total <= 1.25 * peak, (est.total / GIB, peak / GIB)
