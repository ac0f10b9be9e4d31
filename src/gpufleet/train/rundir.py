"""Where a run writes: the run directory, decided once for all ranks and restarts."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

from gpufleet.config import Config
from gpufleet.errors import CheckpointError, ConfigError
from gpufleet.train import runlock
from gpufleet.train.checkpoint import (
    find_resume_checkpoint,
    list_checkpoints,
    newest_intact,
    run_dir_of,
)


def new_run_dir(out_dir: str, name: str) -> Path:
    """``<out_dir>/<name>-<YYYYmmdd-HHMMSS>``, with a suffix if that exists already."""
    base = Path(out_dir) / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def plan_run(cfg: Config, restart_count: int = 0) -> tuple[Config, Path | None]:
    """Fix ``run.dir`` and the checkpoint to resume from, if any.

    Called once by the launching process (so every rank and every elastic restart
    shares one directory) and again by rank 0, where it is then a no-op except that
    after an elastic restart the newest checkpoint of the run is picked up. Under
    torchrun (which restarts ranks itself) the directory is named after torchrun's run
    id, so restarted ranks find it again.

    Returns:
        The config with ``run.dir`` and ``checkpoint.resume`` set to concrete paths, and
        the checkpoint file to load (None for a fresh start).

    Raises:
        ConfigError: ``run.dir`` already holds checkpoints of another run and this is
            neither a resume nor a restart (training on would mix, then prune, the two).
    """
    run, ckpt = cfg.run, cfg.checkpoint
    run_dir = run.dir
    if not run_dir and os.environ.get("TORCHELASTIC_RUN_ID"):
        run_dir = str(Path(run.out_dir) / f"{run.name}-{os.environ['TORCHELASTIC_RUN_ID']}")
    resume_from: Path | None = None
    existing = list_checkpoints(run_dir) if run_dir else []
    if restart_count > 0 and existing:
        resume_from = newest_intact(existing)  # the agent restarted us: carry on
        if resume_from is None:
            raise CheckpointError(f"restart {restart_count}: every checkpoint in "
                                  f"{run_dir!r} failed its checksum; nothing to resume.")
    elif ckpt.resume:
        resume_from = find_resume_checkpoint(ckpt.resume, run.out_dir, run.name, run_dir)
    elif existing:
        raise ConfigError(
            f"run.dir = {run_dir!r} already holds checkpoints of an earlier run "
            f"(newest: {existing[-1].name}). Continue it with --resume "
            "latest, or start a new run with another --run-dir (or none, for a fresh "
            "timestamped one)."
        )
    if not run_dir:
        run_dir = str((resume_from and run_dir_of(resume_from))
                      or new_run_dir(run.out_dir, run.name))
    cfg = dataclasses.replace(
        cfg,
        run=dataclasses.replace(run, dir=str(run_dir)),
        checkpoint=dataclasses.replace(ckpt, resume=str(resume_from) if resume_from else ""),
    )
    return cfg, resume_from


def plan_and_lock(cfg: Config, restart_count: int = 0
                  ) -> tuple[Config, Path | None, runlock.RunLock | None]:
    """:func:`plan_run`, with the run directory locked for this run (see
    :mod:`gpufleet.train.runlock`; the lock is None where this run holds it already).

    A directory named up front is locked before it is looked at: a second run started
    at the same moment is refused naming the first, not judged on a half-written
    directory.
    """
    lock = runlock.acquire(cfg.run.dir) if cfg.run.dir else None
    try:
        cfg, resume_from = plan_run(cfg, restart_count)
        if lock is None:
            lock = runlock.acquire(cfg.run.dir)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return cfg, resume_from, lock
