import doctest

import pytest
import torch

from gpufleet.models.gpt import build_gpt
from gpufleet.monitor import flops
from gpufleet.monitor.flops import (
    PEAK_FLOPS,
    count_flops,
    gpt_train_flops,
    matmul_precision,
    mfu,
    peak_flops,
)


@pytest.fixture(autouse=True)
def _no_peak_env(monkeypatch):
    monkeypatch.delenv("GPUFLEET_PEAK_FLOPS", raising=False)


# -- the counter ------------------------------------------------------------------------

@pytest.mark.parametrize("bias", [False, True])
def test_linear_forward_backward_is_three_matmuls(bias):
    batch, n_in, n_out = 8, 32, 16
    layer = torch.nn.Linear(n_in, n_out, bias=bias)
    x = torch.randn(batch, n_in, requires_grad=True)  # so backward computes grad(x) too
    counted = count_flops(lambda: layer(x).sum().backward())
    # forward x @ W^T: 2BIO; backward grad(x) and grad(W): 2BIO each. Bias adds are not
    # matmul FLOPs.
    assert counted == 3 * 2 * batch * n_in * n_out


def test_linear_without_input_grad_skips_the_input_gradient():
    layer = torch.nn.Linear(32, 16)
    counted = count_flops(lambda: layer(torch.randn(8, 32)).sum().backward())
    assert counted == 2 * 2 * 8 * 32 * 16


def test_cpu_attention_is_counted_like_the_cuda_kernels():
    b, h, s, d = 2, 3, 16, 8
    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
    fwd = count_flops(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
    assert fwd == 2 * (2 * b * h * s * s * d)  # q @ k^T and p @ v
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    bwd = count_flops(lambda: out.sum().backward())
    assert bwd == 5 * (2 * b * h * s * s * d)  # scores recomputed, then 4 gradient matmuls


@pytest.mark.parametrize("n_layer,n_embd,seq,batch", [(2, 64, 64, 4), (4, 128, 128, 2)])
def test_counted_gpt_flops_match_the_formula(n_layer, n_embd, seq, batch):
    torch.manual_seed(0)
    model = build_gpt(n_layer=n_layer, n_head=4, n_embd=n_embd, block_size=seq)
    idx = torch.randint(0, 256, (batch, seq))
    counted = count_flops(lambda: model(idx, targets=idx).backward())
    n = model.num_params() - model.wpe.weight.numel()
    analytic = gpt_train_flops(n, n_layer, n_embd, seq, tokens=batch * seq)
    # They differ by a few percent, for known reasons: the counter includes the attention
    # backward's recomputation of the scores (14 * L * d * seq per token instead of 12);
    # the formula counts LayerNorm weights as if they were matmul weights; neither counts
    # LayerNorm, GELU, softmax, the loss or the optimizer (element-wise work).
    assert counted == pytest.approx(analytic, rel=0.10)
    matmul_params = n - (2 * n_layer + 1) * n_embd  # N without the LayerNorm weights
    exact = batch * seq * (6 * matmul_params + 14 * n_layer * n_embd * seq)
    assert counted == exact


def test_formula_arithmetic():
    # per token: 6 * 1000 + 12 * 2 * 8 * 16 = 9072
    assert gpt_train_flops(1000, 2, 8, 16, tokens=32) == 9072 * 32


# -- peak table -------------------------------------------------------------------------

@pytest.mark.parametrize("name,precision,expected", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989e12),
    ("NVIDIA H100 80GB HBM3", "tf32", 494.7e12),
    ("NVIDIA H100 80GB HBM3", "fp32", 66.9e12),
    ("NVIDIA H100 PCIe", "bf16", 756e12),
    ("NVIDIA H200", "bf16", 989e12),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
    ("NVIDIA A100-PCIE-40GB", "tf32", 156e12),
    ("NVIDIA A100-SXM4-40GB", "fp32", 19.5e12),
    ("NVIDIA A10G", "bf16", 70e12),
    ("NVIDIA A10", "bf16", 125e12),
    ("NVIDIA L4", "bf16", 121e12),
    ("NVIDIA L40S", "bf16", 362.05e12),
    ("Tesla V100-SXM2-16GB", "fp16", 125e12),
    ("NVIDIA GeForce RTX 4090", "bf16", 165.2e12),
    ("NVIDIA GeForce RTX 3090", "fp16", 71e12),
])
def test_peak_lookup(name, precision, expected):
    assert peak_flops(name, precision) == expected


def test_peak_unknown_device_or_precision_the_device_lacks_is_none():
    assert peak_flops("Intel(R) Xeon(R) CPU", "fp32") is None
    assert peak_flops("Tesla V100-SXM2-16GB", "bf16") is None


def test_peak_table_rows_use_known_precisions():
    for rates in PEAK_FLOPS.values():
        assert set(rates) <= set(flops.PRECISIONS)
        assert all(r > 0 for r in rates.values())


def test_peak_override_and_env(monkeypatch):
    assert peak_flops("unknown", "bf16", override=1e15) == 1e15
    monkeypatch.setenv("GPUFLEET_PEAK_FLOPS", "2.5e14")
    assert peak_flops("unknown", "bf16") == 2.5e14
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 2.5e14  # env beats the table
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16", override=1e12) == 1e12  # override wins


def test_peak_rejects_bad_input(monkeypatch):
    with pytest.raises(ValueError, match="bf16, fp16, tf32, fp32"):
        peak_flops("NVIDIA H100", "int8")
    monkeypatch.setenv("GPUFLEET_PEAK_FLOPS", "fast")
    with pytest.raises(ValueError, match="GPUFLEET_PEAK_FLOPS"):
        peak_flops("NVIDIA H100", "bf16")


def test_matmul_precision():
    assert matmul_precision("bf16-mixed", tf32=False) == "bf16"
    assert matmul_precision("fp16-mixed", tf32=True) == "fp16"
    assert matmul_precision("fp32", tf32=True) == "tf32"
    assert matmul_precision("fp32", tf32=False) == "fp32"
    with pytest.raises(ValueError, match="bf16-mixed"):
        matmul_precision("auto", tf32=True)


# -- MFU --------------------------------------------------------------------------------

def test_mfu_arithmetic():
    assert mfu(1e12, 0.01, 200e12) == pytest.approx(0.5)
    assert mfu(4.0, 2.0, 4.0) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        mfu(1.0, 0.0, 1.0)
    with pytest.raises(ValueError):
        mfu(1.0, 1.0, 0.0)


def test_doctests():
    result = doctest.testmod(flops)
    assert result.failed == 0 and result.attempted > 0
