"""What a rank leaves behind when training fails: a crash report in plain words.

``<run_dir>/crash/rank-<R>.txt`` holds what failed, where (step and phase), the likely
cause and its fix for the failures people meet most (out of memory, a collective that
failed or timed out), the traceback, the rank's last collectives (with peers) and the
memory state. The error is then raised as
before, so the launcher (and the elastic agent, which may restart the ranks) sees it.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from gpufleet.core.ring import RING
from gpufleet.errors import ConfigError
from gpufleet.fault import crash_forensics
from gpufleet.fault.forensics import ring_lines
from gpufleet.procs import forget_process

log = logging.getLogger(__name__)


def crash_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "crash"


def explain(error: BaseException) -> str:
    """The likely cause of a fatal error and what to do about it, in one paragraph."""
    text = f"{type(error).__name__}: {error}"
    if isinstance(error, torch.OutOfMemoryError) or "out of memory" in text.lower():
        return ("The GPU ran out of memory. Lower data.batch_size and raise "
                "optim.grad_accum to keep the same global batch, use precision.mode="
                "bf16-mixed, or shard the model (parallel.strategy=fsdp when available).")
    if any(k in text for k in ("NCCL", "ProcessGroup", "Connection reset", "Gloo",
                               "Timed out", "timed out")):
        return ("A collective failed or timed out: another rank died, stalled or took a "
                "different path through the code. Look at that rank's crash report and at "
                "hangs/ (the watchdog's stack dumps), and run `gpufleet doctor`. With "
                "--max-restarts K the agent restarts the ranks from the last checkpoint.")
    return "An error in the training code or the data; the traceback below shows where."


def write_crash_report(trainer: Any, error: BaseException) -> Path | None:
    """Write this rank's crash report; returns its path (None if it could not be written:
    the original error matters more than the report)."""
    rank = trainer.env.rank
    path = crash_dir(trainer.run_dir) / f"rank-{rank}.txt"
    where = _positions(trainer.run_dir, rank, trainer.env.world_size)
    lines = [
        f"gpufleet crash report: rank {rank} of {trainer.env.world_size}, "
        f"host {socket.gethostname()}, pid {os.getpid()}",
        f"time: {time.strftime('%Y-%m-%d %H:%M:%S')}",
        f"step: {trainer.step} (steps done), epoch {trainer.epoch}, "
        f"phase: {trainer.phase}",
        f"error: {type(error).__name__}: {error}",
        "",
        "likely cause: " + explain(error),
        *(["", "where the ranks were (from the rings of the ranks on this node):",
            *where] if where else []),
        "",
        "traceback:",
        "".join(traceback.format_exception(type(error), error, error.__traceback__)),
        *_collectives(trainer.env.world_size),
        _memory_state(trainer.device),
    ]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines))
    except OSError as e:
        log.error("could not write the crash report %s: %s", path, e)
        return None
    log.error("rank %d failed at step %d: %s: %s. Crash report: %s", rank, trainer.step,
              type(error).__name__, error, path)
    return path


@contextmanager
def crash_reported(view: Any) -> Iterator[None]:
    """Training inside this block leaves a crash report if it fails, and its process
    record is removed when it ends well.

    A config or code mistake (:class:`~gpufleet.errors.ConfigError`, whose message names
    the fix) is not a crash: no report, and nothing is left running to clean up. Any
    other error (OOM, a failed collective, a bug) leaves a report in the run directory
    that says where and why; the error is raised as before.
    """
    try:
        yield
    except ConfigError:
        forget_process(view.run_dir)
        raise
    except Exception as e:
        write_crash_report(view, e)
        raise
    forget_process(view.run_dir)  # a clean end leaves nothing to clean up


def _collectives(world_size: int) -> list[str]:
    """This rank's last collectives (which one failed or never returned), when it has
    peers."""
    if world_size < 2 or not RING.seq:
        return []
    return ["this rank's last collectives (numbered alike on every rank):",
            *ring_lines(RING.snapshot()), ""]


def _positions(run_dir: str | Path, rank: int, world_size: int) -> list[str]:
    """Every rank's position on this node, merged (this rank's from its live ring):
    a collective mismatch named with both sides, a rank dead by a signal."""
    if world_size < 2:
        return []
    ranks = crash_forensics.read_folder(crash_dir(run_dir))
    ranks[rank] = crash_forensics.RankFiles(rank, RING.snapshot())
    return crash_forensics.positions(ranks)


def _memory_state(device: torch.device) -> str:
    if device.type != "cuda":
        return ""
    try:
        return "CUDA memory:\n" + torch.cuda.memory_summary(device, abbreviated=True)
    except Exception as e:  # the device itself may be what failed
        return f"CUDA memory: unavailable ({e})"
