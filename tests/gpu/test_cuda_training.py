"""The training paths that only run on CUDA: NCCL, bf16 and fp16 autocast with the loss
scaler, fused AdamW, torch.compile, channels_last, model_parallel on cuda:0, dp on one GPU
and MFU. Each trains for real on the GPU and checks what the path is for, not only that
nothing raised. Skipped without CUDA (tests/conftest.py)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import toyjob
from gpufleet.config import load_config
from gpufleet.monitor.flops import matmul_precision, peak_flops
from gpufleet.precision import build_precision

from .helpers import assert_learned, tiny_gpt

pytestmark = pytest.mark.gpu


def _output_dtypes(module: nn.Module, kind: type[nn.Module]) -> list[torch.dtype]:
    """Records the output dtype of every ``kind`` submodule's forward calls."""
    seen: list[torch.dtype] = []
    for m in module.modules():
        if isinstance(m, kind):
            m.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    return seen


def test_nccl_process_group_trains_ddp_on_one_rank(run_cli, tmp_path):
    """One rank under torch's elastic agent joins an NCCL process group, and DDP (its
    gradient all-reduce over NCCL) plus the log interval's all-reduce train the model."""
    run_dir = tmp_path / "nccl"
    run_cli("train", "--launcher", "elastic", "--nproc", "1", "--strategy", "ddp",
            "--device", "cuda", "--max-steps", "30", "--batch-size", "8",
            "--model.n_layer=1", "--model.n_embd=64", "--model.n_head=2",
            "--model.block_size=32", "--data.corpus_bytes=200000", "--run.eval_every=0",
            "--log.every=10", "--log.progress=lines", f"--run.dir={run_dir}",
            "--monitor.report=false", timeout=300)
    cfg = load_config(run_dir / "config.toml")
    assert cfg.dist.backend == "nccl" and cfg.parallel.strategy == "ddp"
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in lines if m.get("kind") == "train"]
    assert len(losses) == 3 and losses[-1] < losses[0], losses


def test_bf16_autocast_runs_the_matmuls_in_bf16_and_learns(fit_cuda):
    model = tiny_gpt()
    dtypes = _output_dtypes(model, nn.Linear)
    result, cap = fit_cuda({"precision.mode": "bf16-mixed"}, model=model)
    assert dtypes and set(dtypes) == {torch.bfloat16}, set(dtypes)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master weights
    assert cap.trainer.precision.name == "bf16-mixed"
    assert_learned(result)


def test_fp16_scaler_skips_an_overflowing_step_and_lowers_its_scale():
    torch.manual_seed(0)
    layer = nn.Linear(8, 8).cuda()
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2, fused=True)
    precision = build_precision("fp16-mixed", "cuda")
    x = torch.randn(4, 8, device="cuda")
    before = layer.weight.detach().clone()
    scale0 = precision.scaler.get_scale()
    with precision.autocast():
        out = layer(x)
    assert out.dtype == torch.float16
    precision.backward(out.float().sum() * float("inf"))  # every gradient overflows
    precision.unscale(opt)
    precision.step(opt)
    opt.zero_grad()
    assert precision.scaler.get_scale() == scale0 * precision.scaler.get_backoff_factor()
    torch.testing.assert_close(layer.weight, before, rtol=0, atol=0)  # step skipped
    with precision.autocast():
        loss = layer(x).float().pow(2).mean()
    precision.backward(loss)
    precision.unscale(opt)
    precision.step(opt)
    assert not torch.equal(layer.weight, before)  # a finite step goes through


def test_fp16_mixed_trains_with_the_scaler(fit_cuda):
    model = tiny_gpt()
    dtypes = _output_dtypes(model, nn.Linear)
    result, cap = fit_cuda({"precision.mode": "fp16-mixed"}, model=model)
    assert set(dtypes) == {torch.float16}
    scaler = cap.trainer.precision.scaler
    assert scaler.is_enabled() and scaler.get_scale() > 1.0
    assert_learned(result)


def test_adamw_is_fused_on_cuda(fit_cuda):
    result, cap = fit_cuda({"run.max_steps": 20})
    opt = cap.trainer.optimizer
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults.get("fused") is True
    state = next(iter(opt.state.values()))
    assert state["exp_avg"].is_cuda
    assert result.steps == 20


def test_compile_trains_like_eager(fit_cuda):
    settings = {"precision.mode": "fp32", "perf.tf32": False, "run.max_steps": 30}
    eager, _ = fit_cuda(settings)
    compiled, cap = fit_cuda({**settings, "perf.compile": True})
    model = cap.trainer.strategy.unwrap(cap.trainer.model)
    assert getattr(model, "_compiled_call_impl", None) is not None
    assert_learned(compiled)
    for (step_a, a), (step_b, b) in zip(eager.losses, compiled.losses, strict=True):
        assert step_a == step_b and abs(a - b) <= 0.02 * abs(a) + 1e-3, (eager.losses,
                                                                         compiled.losses)


def test_channels_last_reaches_the_convolutions(fit_cuda):
    model = toyjob.make_conv_model()
    layouts: list[bool] = []
    conv = model[0]
    conv.register_forward_pre_hook(lambda _m, args: layouts.append(
        args[0].is_contiguous(memory_format=torch.channels_last)))
    result, _ = fit_cuda({"perf.channels_last": True, "precision.mode": "bf16-mixed",
                          "run.max_steps": 20, "log.every": 5}, model=model,
                         data=toyjob.make_image_data(), loss_fn=F.mse_loss)
    assert layouts and all(layouts)
    assert conv.weight.is_cuda and conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert result.steps == 20


def test_model_parallel_places_modules_on_cuda0_and_learns(fit_cuda):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 1))
    x = torch.randn(512, 8)
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
    result, _ = fit_cuda({"parallel.strategy": "model_parallel",
                          "parallel.device_map": {"0": "cuda:0", "2": "cuda:0"},
                          "optim.lr": 1e-2, "run.max_steps": 60}, model=model, data=data,
                         loss_fn=F.mse_loss)
    assert {p.device for p in model.parameters()} == {torch.device("cuda", 0)}
    assert_learned(result)


def test_dp_on_one_gpu_keeps_the_run_dtype_and_learns(fit_cuda):
    model = tiny_gpt()
    dtypes = _output_dtypes(model, nn.Linear)
    result, cap = fit_cuda({"parallel.strategy": "dp", "precision.mode": "bf16-mixed"},
                           model=model)
    assert isinstance(cap.trainer.model, nn.DataParallel)
    assert set(dtypes) == {torch.bfloat16}  # the replica thread keeps bf16, not fp16
    assert_learned(result)


def test_mfu_is_counted_and_plausible(fit_cuda):
    name = torch.cuda.get_device_name()
    # An unknown GPU gets a stated peak, so MFU is still computed and checked.
    known = peak_flops(name, matmul_precision("bf16-mixed", True)) is not None
    settings = {"precision.mode": "bf16-mixed", "log.every": 10}
    if not known:
        settings["monitor.peak_tflops"] = 100.0
    _, cap = fit_cuda(settings)
    assert cap.trainer.flops_per_step > 0
    late = cap.logs[1:]  # the first interval holds the start-up
    assert late and all("mfu" in m and 0 < m["mfu"] <= 1 for m in late), late
    for m in late:
        assert m["tflops"] * 1e12 == pytest.approx(
            cap.trainer.flops_per_step / m["step_time_s"], rel=1e-6)
