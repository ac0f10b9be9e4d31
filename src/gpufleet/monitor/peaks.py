"""What this CPU can do, measured: the yardsticks of the expected step
(:mod:`gpufleet.monitor.expected`).

Three short probes, each run once per process (and per torch thread count), on rank 0
when the diagnosis first runs (after the first log interval, not before the first
step), about 0.2 s in all:

- :func:`matmul_rate`: FLOP/s of a 512 x 512 matmul in the dtype the run's matmuls use
  (fp32; bf16 or fp16 under mixed precision), 0.1 s;
- :func:`launch_cost`: seconds per operator called from Python on tiny tensors (an
  addition into a preallocated 1-element output: Python, the dispatcher, no work),
  the least an operator costs;
- :func:`memory_rate`: bytes per second a 16 MiB copy reads and writes, the rate of
  memory-bound work such as the optimizer's update.

Links between nodes are measured by :mod:`gpufleet.monitor.links` at the start of a
multi-node run. A GPU's yardstick is its datasheet peak (:mod:`gpufleet.monitor.flops`):
these probes run on the CPU only.

Example:
    >>> rate = matmul_rate(torch.float32, seconds=0.01, n=64)
    >>> rate > 0
    True
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

#: The dtype of the matmuls under each ``precision.mode``.
MATMUL_DTYPES = {"fp32": torch.float32, "bf16-mixed": torch.bfloat16,
                 "fp16-mixed": torch.float16}


@dataclass(frozen=True)
class Peaks:
    """This CPU's measured rates (see the module docs).

    Attributes:
        matmul_flops: FLOP/s of a matmul in ``dtype``.
        dtype: its name ("fp32", "bf16", "fp16").
        launch_s: seconds per tiny operator called from Python.
        memory_bps: bytes per second a large copy moves (read plus write).
        seconds: what the probes took in this call (0 when measured before).
    """

    matmul_flops: float
    dtype: str
    launch_s: float
    memory_bps: float
    seconds: float


_MATMUL: dict[tuple[int, torch.dtype], float] = {}  # (torch threads, dtype) -> FLOP/s
_HOST: dict[int, tuple[float, float]] = {}  # torch threads -> (launch s, memory B/s)


def cpu_peaks(precision_mode: str = "fp32") -> Peaks:
    """This CPU's :class:`Peaks` for a run in ``precision_mode``; each probe runs once
    per process and torch thread count (the matmul once per dtype too)."""
    threads, start = torch.get_num_threads(), time.perf_counter()
    dtype = MATMUL_DTYPES.get(precision_mode, torch.float32)
    if (threads, dtype) not in _MATMUL:
        _MATMUL[threads, dtype] = matmul_rate(dtype)
    if threads not in _HOST:
        _HOST[threads] = (launch_cost(), memory_rate())
    launch, memory = _HOST[threads]
    return Peaks(_MATMUL[threads, dtype], _NAMES[dtype], launch, memory,
                 time.perf_counter() - start)


_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def matmul_rate(dtype: torch.dtype = torch.float32, seconds: float = 0.1,
                n: int = 512) -> float:
    """FLOP/s of an ``n`` x ``n`` matmul in ``dtype`` on this CPU with torch's threads,
    over about ``seconds``."""
    g = torch.Generator().manual_seed(0)  # the global RNG stays as training left it
    a = torch.randn(n, n, generator=g).to(dtype)
    b = torch.randn(n, n, generator=g).to(dtype)
    a @ b  # warm-up
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        runs += 1
    return 2 * n ** 3 * runs / (time.perf_counter() - start)


def launch_cost(calls: int = 2000) -> float:
    """Seconds per operator called from Python on 1-element tensors (the fastest of
    three rounds of ``calls``: the least an operator costs, without the work)."""
    a, b, out = torch.ones(1), torch.ones(1), torch.empty(1)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            torch.add(a, b, out=out)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def memory_rate(nbytes: int = 16 << 20, seconds: float = 0.05) -> float:
    """Bytes per second a copy of ``nbytes`` reads and writes (both counted)."""
    src = torch.empty(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: the pages are touched once
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        dst.copy_(src)
        runs += 1
    return 2 * nbytes * runs / (time.perf_counter() - start)
