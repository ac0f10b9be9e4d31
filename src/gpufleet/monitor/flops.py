"""FLOPs of a training step, the GPU's peak rate, and model FLOPs utilization (MFU).

MFU = (model FLOPs per step / step time) / peak FLOP/s of the device at the precision the
matmuls run in. Two ways to get the FLOPs per step:

* :func:`count_flops` runs a step once under ``torch.utils.flop_counter.FlopCounterMode``
  and adds up what the matmul and attention kernels did (any model, no formula needed).
* :func:`gpt_train_flops` is the analytic count for a GPT (the PaLM / nanoGPT formula).

Example:
    >>> flops = gpt_train_flops(n_params=124_000_000, n_layer=12, n_embd=768, seq_len=1024,
    ...                         tokens=16 * 1024)
    >>> round(mfu(flops, step_time_s=0.1, peak=989e12), 3)
    0.142
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

PRECISIONS = ("bf16", "fp16", "tf32", "fp32")
PEAK_FLOPS_ENV = "GPUFLEET_PEAK_FLOPS"  # FLOP/s; wins over the table, loses to `override`

# Dense peak FLOP/s (no 2:4 sparsity) from the vendors' datasheets and architecture
# whitepapers: NVIDIA H100 / H200 / A100 / L4 / L40S / A10 / V100 datasheets, the Ada
# (RTX 4090) and GA102 (RTX 3090) whitepapers. bf16 and fp16 are tensor-core rates with
# fp32 accumulation; tf32 is the tensor-core rate for fp32 matmuls with TF32 allowed;
# fp32 is the plain (non-tensor) rate. A precision a GPU lacks is left out (V100: no bf16,
# no tf32). A10G is not in an NVIDIA datasheet: its numbers are the commonly quoted AWS
# figures and less certain; set GPUFLEET_PEAK_FLOPS to use your own.
# Keys are matched as substrings of torch.cuda.get_device_name(), case-insensitively, in
# this order, so the more specific names ("H100 PCIe") come before the general ones.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51.2e12},
    "H100 NVL": {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12, "fp32": 60e12},
    "H100 SXM": {"bf16": 989e12, "fp16": 989e12, "tf32": 494.7e12, "fp32": 66.9e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "tf32": 494.7e12, "fp32": 66.9e12},  # SXM
    "H200 NVL": {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12, "fp32": 60e12},
    "H200": {"bf16": 989e12, "fp16": 989e12, "tf32": 494.7e12, "fp32": 66.9e12},  # = H100 SXM
    "A100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362.05e12, "fp16": 362.05e12, "tf32": 183e12, "fp32": 91.6e12},
    "L4": {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12},
    "A10G": {"bf16": 70e12, "fp16": 70e12, "tf32": 35e12, "fp32": 31.2e12},  # see above
    "A10": {"bf16": 125e12, "fp16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12},
    "V100": {"fp16": 125e12, "fp32": 15.7e12},  # SXM2; the PCIe card is ~10% lower
    "RTX 4090": {"bf16": 165.2e12, "fp16": 165.2e12, "tf32": 82.6e12, "fp32": 82.6e12},
    "RTX 3090": {"bf16": 71e12, "fp16": 71e12, "tf32": 35.6e12, "fp32": 35.6e12},
}


def flop_counter() -> FlopCounterMode:
    """A ``FlopCounterMode`` that counts what :func:`count_flops` counts; use it as a
    context manager and read ``get_total_flops()`` afterwards."""
    return FlopCounterMode(display=False, custom_mapping=_EXTRA_FORMULAS)


def count_flops(fn: Callable[[], Any]) -> int:
    """Run ``fn()`` once and return the FLOPs its matmuls and attention kernels did.

    Counts what ``FlopCounterMode`` counts: matmuls (``mm``, ``addmm``, ``bmm``, ...),
    convolutions and the fused attention kernels, 2 FLOPs per multiply-add. Element-wise
    work (LayerNorm, GELU, softmax outside the fused kernel, the loss, the optimizer) is
    not counted. Attention is counted without a causal discount, and its backward includes
    the recomputation of the score matrix that flash-style kernels do (5 matmuls against 2
    in the forward). The CPU's fused attention kernel is added here, since torch only
    registers the CUDA ones; CPU and CUDA thus give the same count.

    Args:
        fn: does the work to count, e.g. one forward and backward of a training step.
            It runs for real (gradients accumulate, RNGs advance).

    Returns:
        Total FLOPs (an exact integer for a given set of shapes).

    Example:
        >>> layer = torch.nn.Linear(32, 16)
        >>> x = torch.randn(8, 32, requires_grad=True)  # so backward also computes grad(x)
        >>> count_flops(lambda: layer(x).sum().backward())  # 3 matmuls of 2 * 8 * 32 * 16
        24576
    """
    with flop_counter() as counter:
        fn()
    return counter.get_total_flops()


def gpt_train_flops(n_params: int, n_layer: int, n_embd: int, seq_len: int,
                    tokens: int) -> float:
    """Analytic FLOPs of one training step (forward + backward) of a GPT.

    ``tokens * (6 * n_params + 12 * n_layer * n_embd * seq_len)`` (PaLM, appendix B; the
    count nanoGPT's MFU uses). ``6 * N`` per token: each weight is in one multiply-add
    (2 FLOPs) in the forward and two in the backward (gradient of the input and of the
    weight). ``12 * L * d * seq`` per token: the attention scores ``q @ k^T`` and the
    weighted sum ``scores @ v`` are 2 matmuls of ``2 * seq * d`` FLOPs per token and layer
    in the forward, times 3 for forward + backward. No causal discount, no recomputation.

    Which N: every parameter that is a matmul weight. For our :class:`~gpufleet.models.gpt.GPT`
    that is ``model.num_params() - model.wpe.weight.numel()``: all parameters but the
    position embedding (a table lookup, no FLOPs). The token embedding stays in because,
    tied to the output head, it is the ``d x vocab`` matmul that makes the logits; for an
    untied model count the head and leave the input embedding out. LayerNorm weights are
    counted too, a negligible ``(2L + 1) * d`` overcount that keeps the rule simple.

    Args:
        n_params: N as above.
        n_layer: transformer blocks.
        n_embd: width of the residual stream (d).
        seq_len: tokens per sequence (the attention span).
        tokens: tokens in the step, ``batch * seq_len`` (times grad_accum, times ranks for
            the whole job).

    Returns:
        FLOPs of the step.

    Example:
        >>> gpt_train_flops(n_params=1000, n_layer=2, n_embd=8, seq_len=16, tokens=32)
        290304.0
    """
    per_token = 6.0 * n_params + 12.0 * n_layer * n_embd * seq_len
    return per_token * tokens


def peak_flops(device_name: str, precision: str, override: float | None = None) -> float | None:
    """Dense peak FLOP/s of a GPU at a precision, or None when it is not known.

    ``override`` wins, then the ``GPUFLEET_PEAK_FLOPS`` environment variable, then the
    :data:`PEAK_FLOPS` table (first key that is a substring of ``device_name``).

    Args:
        device_name: e.g. ``torch.cuda.get_device_name()``, "NVIDIA H100 80GB HBM3".
        precision: the matmul precision: "bf16", "fp16", "tf32" or "fp32".
        override: FLOP/s to use instead of the table.

    Returns:
        FLOP/s, or None for an unknown device or a precision the device lacks.

    Raises:
        ValueError: unknown ``precision``, or a ``GPUFLEET_PEAK_FLOPS`` that is not a
            positive number.

    Example:
        >>> peak_flops("NVIDIA A100-SXM4-80GB", "bf16")
        312000000000000.0
        >>> peak_flops("Intel Xeon", "fp32") is None
        True
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision = {precision!r}: choose one of {', '.join(PRECISIONS)}.")
    if override is not None:
        return float(override)
    env = os.environ.get(PEAK_FLOPS_ENV, "").strip()
    if env:
        try:
            value = float(env)
        except ValueError:
            value = -1.0
        if not value > 0:
            raise ValueError(f"{PEAK_FLOPS_ENV} = {env!r}: must be a positive number of "
                             "FLOP/s, e.g. 989e12.")
        return value
    name = device_name.lower()
    for key, rates in PEAK_FLOPS.items():
        if key.lower() in name:
            return rates.get(precision)
    return None


def device_peak_flops(cfg: Any, device: Any) -> float | None:
    """Peak FLOP/s of the run's device at its matmul precision (``monitor.peak_tflops``
    wins over the table); None on a CPU or an unknown GPU."""
    if device.type != "cuda":
        return None
    override = cfg.monitor.peak_tflops * 1e12 or None
    tf32 = torch.backends.cuda.matmul.allow_tf32  # as the run set it, or left it
    return peak_flops(torch.cuda.get_device_name(device),
                      matmul_precision(cfg.precision.mode, tf32), override)


def matmul_precision(precision_mode: str, tf32: bool) -> str:
    """The :data:`PEAK_FLOPS` column for a ``precision.mode``: which rate the matmuls run at.

    Example:
        >>> matmul_precision("bf16-mixed", tf32=True), matmul_precision("fp32", tf32=True)
        ('bf16', 'tf32')
    """
    modes = {"bf16-mixed": "bf16", "fp16-mixed": "fp16", "fp32": "tf32" if tf32 else "fp32"}
    if precision_mode not in modes:
        raise ValueError(f"precision mode {precision_mode!r}: choose one of "
                         f"{', '.join(modes)}.")
    return modes[precision_mode]


def mfu(flops_per_step: float, step_time_s: float, peak: float) -> float:
    """Model FLOPs utilization: achieved FLOP/s as a share of the peak (0.4 = 40%).

    Args:
        flops_per_step: FLOPs of one step on the device(s) that ``peak`` covers.
        step_time_s: seconds per step.
        peak: peak FLOP/s of those device(s).

    Example:
        >>> mfu(1e12, step_time_s=0.01, peak=200e12)
        0.5
    """
    if step_time_s <= 0 or peak <= 0:
        raise ValueError(f"step_time_s = {step_time_s!r} and peak = {peak!r} must be positive.")
    return flops_per_step / step_time_s / peak


# -- fused attention on the CPU --------------------------------------------------------
# torch registers FLOP formulas for the CUDA attention kernels only. These give the CPU
# kernel the same count: forward 2 matmuls (q @ k^T, p @ v), backward 5 (the scores
# recomputed, then the gradients of p, v, q and k). Shapes are [batch, heads, seq, dim].

def _attention_forward_flops(q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None,
                             **kwargs: Any) -> int:
    b, h, s_q, d_qk = q
    s_k, d_v = k[2], v[3]
    return 2 * b * h * s_q * s_k * (d_qk + d_v)


def _attention_backward_flops(grad_out: Any, q: Any, k: Any, v: Any, *args: Any,
                              out_shape: Any = None, **kwargs: Any) -> int:
    b, h, s_q, d_qk = q
    s_k, d_v = k[2], v[3]
    return 2 * b * h * s_q * s_k * (3 * d_qk + 2 * d_v)


_aten = torch.ops.aten
_EXTRA_FORMULAS: dict[Any, Any] = {}
if hasattr(_aten, "_scaled_dot_product_flash_attention_for_cpu"):
    _EXTRA_FORMULAS[_aten._scaled_dot_product_flash_attention_for_cpu] = _attention_forward_flops
if hasattr(_aten, "_scaled_dot_product_flash_attention_for_cpu_backward"):
    _EXTRA_FORMULAS[_aten._scaled_dot_product_flash_attention_for_cpu_backward] = (
        _attention_backward_flops)
