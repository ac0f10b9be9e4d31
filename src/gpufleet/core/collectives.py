"""Object collectives over the default process group that also work without one, and
a timed point-to-point swap between two ranks.

A single process (no process group) gets its own object back, so code calling these
runs unchanged in one process and in many.
"""

from __future__ import annotations

import time
from typing import Any, TypeVar

import torch.distributed as dist

from gpufleet.core.ring import RING

T = TypeVar("T")


def is_initialized() -> bool:
    """Whether this process has joined a process group."""
    return dist.is_available() and dist.is_initialized()


def broadcast_object(obj: T, src: int = 0, group: Any = None) -> T:
    """Return rank ``src``'s ``obj`` on every rank of ``group`` (default: all; picklable
    objects only; ``src`` is a global rank).

    Without a process group ``obj`` comes back as it is.

    Example:
        >>> broadcast_object({"run_dir": "runs/a"})
        {'run_dir': 'runs/a'}
    """
    if not is_initialized():
        return obj
    box: list[Any] = [obj]
    # The ring numbers the default group's collectives alike on every rank; a group of
    # its own (a background checkpoint write's) runs in another thread, unnumbered.
    n = RING.enter("broadcast_object", -1) if group is None else 0
    dist.broadcast_object_list(box, src=src, group=group)  # collective; pickles
    if n:
        RING.leave(n)
    return box[0]


def gather_objects(obj: T, group: Any = None) -> list[T]:
    """Every rank's ``obj``, in rank order, on every rank of ``group`` (default: all;
    picklable objects only).

    Without a process group the list holds ``obj`` alone.

    Example:
        >>> gather_objects(3)
        [3]
    """
    if not is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    n = RING.enter("all_gather_object", -1) if group is None else 0
    dist.all_gather_object(out, obj, group=group)  # collective; pickles through the backend
    if n:
        RING.leave(n)
    return out


def timed_swap(x: Any, first: int, second: int) -> float:
    """COLLECTIVE (a barrier, so one pair at a time): rank ``first`` sends ``x`` to rank
    ``second`` and receives it back. Returns the seconds on ``first``, 0.0 elsewhere."""
    import torch

    n = RING.enter("barrier", 0)
    dist.barrier()  # the other ranks wait here while this pair swaps
    RING.leave(n)
    me = dist.get_rank()
    if me == first:
        start = time.perf_counter()
        dist.send(x, dst=second)
        dist.recv(x, src=second)
        if x.is_cuda:
            torch.cuda.synchronize(x.device)  # SYNC: the swap is done, not just queued
        return time.perf_counter() - start
    if me == second:
        dist.recv(x, src=first)
        dist.send(x, dst=first)
    return 0.0
