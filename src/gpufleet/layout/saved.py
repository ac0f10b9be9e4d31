"""The bytes autograd saves for backward in one forward, counted without memory.

The planner's model lives on the meta device, where autocast does nothing (it casts only
tensors of its own device): a ``bf16-mixed`` forward there saves every activation in
float32, twice what the run holds. So the forward runs on fake tensors (shapes and
dtypes, no storage) that say they are on the CPU, where torch's CPU autocast applies.

A plan for GPUs needs CUDA's autocast, whose lists differ from the CPU's: CUDA runs the
norms, softmax and log-softmax, exp, log, pow and sums in float32 where the CPU keeps
the input's dtype, and the CPU runs 3-d pooling, padding and a few more in float32
where CUDA does not. A CUDA tensor cannot be faked on a torch built without CUDA
(autograd asks the device for a stream), so :class:`_CudaRules` applies CUDA's policy to
the functions where the two differ, over the CPU's autocast. The lists are torch's
(``aten/src/ATen/autocast_mode.h`` and ``.cpp``).

Attention runs as a fused kernel (flash, memory-efficient) saves it: its inputs, its
output and one float per query row, not the ``T x T`` scores of the math kernel.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode

#: Functions CUDA's autocast runs in float32 (its ``fp32`` and ``fp32_set_opt_dtype``
#: lists) and the CPU's in the input's dtype.
CUDA_FP32 = frozenset({
    "acos", "arccos", "asin", "arcsin", "cosh", "erfinv", "exp", "expm1", "log", "log10",
    "log2", "log1p", "reciprocal", "rsqrt", "sinh", "tan", "pow", "__rpow__", "softplus",
    "layer_norm", "rms_norm", "group_norm", "cosine_similarity", "dist", "pdist", "renorm",
    "logsumexp", "interpolate", "softmax", "log_softmax", "cumsum", "cumprod", "sum",
    "linalg_vector_norm", "linalg_matrix_norm"})
#: Matrix products CUDA's autocast runs in the compute dtype and the CPU's does not.
CUDA_LOWER = frozenset({"mv", "addmv", "addr"})
#: Functions the CPU's autocast runs in float32 and CUDA's in the input's dtype.
CPU_FP32 = frozenset({
    "avg_pool3d", "max_pool3d", "adaptive_avg_pool3d", "max_unpool2d", "max_unpool3d", "pad",
    "grid_sample", "polar", "quantile", "nanquantile", "stft", "trace", "view_as_complex"})


def saved_bytes(module: nn.Module, inputs: tuple[Any, ...], dtype: torch.dtype | None,
                device_type: str) -> int:
    """Bytes autograd saves in one forward of ``module`` (on the meta device, or holding
    DTensors of meta shards) on ``inputs``, under ``device_type``'s ("cpu" or "cuda")
    autocast to ``dtype`` (None: no autocast). Storages are counted once; parameters are
    not activations, their casts to ``dtype`` are."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t  # views share their base's memory
        if isinstance(base, nn.Parameter):  # weights: counted as parameters
            return t
        local = base.to_local() if hasattr(base, "to_local") else base
        saved[id(base)] = local.numel() * local.element_size()
        return t

    mode = FakeTensorMode()
    state = {n: _fake(t, mode) for n, t in [*module.named_parameters(),
                                             *module.named_buffers()]}
    args = tuple(_fake(t, mode) if isinstance(t, torch.Tensor) else t for t in inputs)
    with mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            _autocast(dtype, device_type), _fused_attention():
        torch.func.functional_call(module, state, args)
    return sum(saved.values())


def _fake(t: torch.Tensor, mode: FakeTensorMode) -> torch.Tensor:
    """``t`` as a fake CPU tensor of ``mode``, a DTensor of fake shards for a DTensor, a
    parameter for a parameter."""
    local = t.to_local() if hasattr(t, "to_local") else t
    with mode:
        fake = torch.empty_strided(local.shape, local.stride(), dtype=local.dtype,
                                   device="cpu")
        if hasattr(t, "to_local"):
            from torch.distributed.tensor import DTensor

            fake = DTensor.from_local(fake, t.device_mesh, t.placements, run_check=False,
                                      shape=t.shape, stride=t.stride())
    if isinstance(t, nn.Parameter):
        return nn.Parameter(fake, requires_grad=t.requires_grad)
    return fake


@contextlib.contextmanager
def _autocast(dtype: torch.dtype | None, device_type: str) -> Iterator[None]:
    if dtype is None:
        yield
        return
    with torch.autocast("cpu", dtype=dtype):
        if device_type != "cuda":
            yield
            return
        with _CudaRules(dtype):
            yield


class _CudaRules(TorchFunctionMode):
    """CUDA's autocast where it differs from the CPU's, over the CPU's autocast: the
    arguments of :data:`CUDA_FP32` functions cast to float32, of :data:`CUDA_LOWER` ones
    to the compute dtype, and :data:`CPU_FP32` functions run without autocast."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in CPU_FP32:
            with torch.autocast("cpu", enabled=False):
                return func(*args, **kwargs)
        to = torch.float32 if name in CUDA_FP32 else self.dtype if name in CUDA_LOWER else None
        if to is not None:
            args = tuple(_cast(a, to) for a in args)
            kwargs = {k: _cast(v, to) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def _cast(value: Any, dtype: torch.dtype) -> Any:
    """``value`` in ``dtype`` when autocast would cast it (a floating tensor that is not
    float64)."""
    if (isinstance(value, torch.Tensor) and value.is_floating_point()
            and value.dtype not in (dtype, torch.float64)):
        return value.to(dtype)
    return value


class _FusedAttentionSaves(torch.autograd.Function):
    """What a fused attention kernel keeps for backward: its inputs, its output and one
    float per query row (the log-sum-exp). Its output is written ``[B, T, heads, d]`` and
    handed back as the ``[B, heads, T, d]`` view, so the usual
    ``y.transpose(1, 2).contiguous()`` after it copies nothing."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        shape = (*q.shape[:-1], v.shape[-1])
        if q.dim() == 4:
            out = q.new_empty((shape[0], shape[2], shape[1], shape[3])).transpose(1, 2)
        else:
            out = q.new_empty(shape)
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
        return out


@contextlib.contextmanager
def _fused_attention() -> Iterator[None]:
    """``F.scaled_dot_product_attention`` as a fused kernel saves, for the planner's
    forward only (the function is put back on exit). Under autocast it computes in the
    compute dtype, as the kernel does on the CPU and on CUDA."""
    original = torch.nn.functional.scaled_dot_product_attention

    def fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any,
              **kwargs: Any) -> torch.Tensor:
        if torch.is_autocast_enabled("cpu"):
            q, k, v = (_cast(t, torch.get_autocast_dtype("cpu")) for t in (q, k, v))
        return _FusedAttentionSaves.apply(q, k, v)

    torch.nn.functional.scaled_dot_product_attention = fused
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original
