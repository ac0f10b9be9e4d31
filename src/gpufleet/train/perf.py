"""The fast-path switches of the ``[perf]`` section, applied in one place."""

from __future__ import annotations

import logging
import os

import torch

from gpufleet.config import PerfConfig
from gpufleet.core.machine import cores_per_rank, usable_cores
from gpufleet.core.tree import map_tensors

log = logging.getLogger(__name__)


def share_cores(local_world_size: int, is_main: bool = True) -> int | None:
    """Split the node's cores between its ranks' torch thread pools.

    torch sizes its intra-op thread pool to all the cores a process may use, in every
    process: N ranks on one node then run N times as many threads as there are cores, and
    the CPU work of a step (on CPU, all of it) slows down several-fold. Unless the user
    set ``OMP_NUM_THREADS``, each rank gets ``cores // N`` threads (at least one).
    torchrun's command line sets one thread; torch's ``elastic_launch`` (which ``--nproc``
    uses), ``horovodrun``, ``mpirun`` and ``srun`` set nothing.

    Returns the thread count set, or None when nothing was changed.

    Example:
        >>> share_cores(local_world_size=1) is None  # one rank keeps every core
        True
    """
    if local_world_size <= 1 or os.environ.get("OMP_NUM_THREADS"):
        return None
    threads = cores_per_rank(local_world_size)
    torch.set_num_threads(threads)
    if is_main:
        log.info("%d ranks share this node's %d core(s): %d torch thread(s) each (set "
                 "OMP_NUM_THREADS to choose)", local_world_size, usable_cores(), threads)
    return threads


def apply_backend_flags(perf: PerfConfig, deterministic: bool) -> None:
    """Process-wide matmul and cuDNN settings (they only matter on CUDA).

    TF32 runs fp32 matmuls and convolutions on tensor cores with a 10-bit mantissa
    (``perf.tf32`` true or false; ``default`` leaves torch's settings as they are);
    cuDNN benchmarking times the convolution algorithms once per input shape.
    """
    if perf.tf32 in ("true", "false"):
        torch.backends.cuda.matmul.allow_tf32 = perf.tf32 == "true"
        torch.backends.cudnn.allow_tf32 = perf.tf32 == "true"
    torch.backends.cudnn.benchmark = perf.cudnn_benchmark and not deterministic


def to_channels_last(batch: object) -> object:
    """4-D float tensors of a batch in NHWC layout (others untouched)."""
    return map_tensors(batch, _nhwc)


def _nhwc(t: torch.Tensor) -> torch.Tensor:
    if t.ndim == 4 and t.is_floating_point():
        return t.contiguous(memory_format=torch.channels_last)
    return t
