"""Rank functions for the launcher tests: module-level so spawned ranks can unpickle them.

Imported as ``_launch_workers`` with tests/launch on sys.path (a distinct name, so it never
clashes with the ``gpufleet.launch`` package).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from gpufleet.launch import (
    DistEnv,
    destroy_process_group,
    init_process_group,
    rank_zero_first,
)


def all_reduce_rank() -> dict:
    """Join a gloo group, sum rank + 1 over the ranks; 2 ranks give 3 everywhere."""
    env = DistEnv.detect()
    init_process_group(env, "gloo", timeout_s=30)
    try:
        value = torch.tensor([env.rank + 1.0])
        dist.all_reduce(value)  # collective: sum over ranks
        return {"sum": value.item(), "rank": dist.get_rank(), "world": dist.get_world_size(),
                "source": env.source, "local_rank": env.local_rank}
    finally:
        destroy_process_group()


def fail_once() -> int:
    """Rank 1 dies on the first attempt; after the agent's restart every rank succeeds."""
    env = DistEnv.detect()
    if env.restart_count == 0 and env.rank == 1:
        os._exit(3)
    init_process_group(env, "gloo", timeout_s=30)
    try:
        dist.barrier()
        return env.restart_count
    finally:
        destroy_process_group()


def raise_on_rank_one() -> str:
    """Rank 1 raises; rank 0 returns without joining a group (so it never waits)."""
    if DistEnv.detect().rank == 1:
        raise ValueError("boom from rank 1")
    return "ok"


def raise_on_rank_one_after_zero(tmp: str) -> str:
    """Rank 1 raises once rank 0 has started (and so has its log files); rank 0 returns."""
    import time
    from pathlib import Path

    started = Path(tmp) / "rank-0-started"
    if DistEnv.detect().rank == 0:
        started.touch()
        return "ok"
    deadline = time.monotonic() + 60
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    raise ValueError("boom from rank 1")


def zero_first(tmp: str) -> bool:
    """Rank 0 writes a file slowly in the body; the others must find it in theirs."""
    env = DistEnv.detect()
    init_process_group(env, "gloo", timeout_s=30)
    try:
        for local in (False, True):
            marker = Path(tmp) / f"ready-{local}"
            with rank_zero_first(local=local):
                if env.rank == 0:
                    time.sleep(0.5)  # give rank 1 the chance to run ahead if it could
                    marker.write_text("done")
                else:
                    assert marker.read_text() == "done", "rank 1 entered before rank 0 finished"
        return True
    finally:
        destroy_process_group()


def loaded(names: list[str]) -> dict[str, bool]:
    """Which of ``names`` this rank has imported."""
    import sys

    return {name: name in sys.modules for name in names}


def raise_value_error() -> None:
    raise ValueError("bad value on purpose")
