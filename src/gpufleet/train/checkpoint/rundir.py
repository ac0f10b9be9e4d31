"""Where a run writes: its name and directory, decided once for all ranks and restarts."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path

from gpufleet.config import Config
from gpufleet.errors import CheckpointError, ConfigError
from gpufleet.plan import named, run_name
from gpufleet.train.checkpoint import runlock
from gpufleet.train.checkpoint.format import (
    find_latest_checkpoint,
    find_resume_checkpoint,
    glob_escape,
    list_checkpoints,
    newest_intact,
    run_dir_of,
)

__all__ = ["as_new_run", "named", "new_run_dir", "plan_and_lock", "plan_run", "run_name"]

log = logging.getLogger(__name__)

TORCHRUN_MARK = ".torchelastic_run_id"  # in a run directory made under torchrun


def as_new_run(cfg: Config, config_path: str | Path | None) -> tuple[Config, str]:
    """A run's own ``config.toml`` read back starts a new run, not the old one again.

    The file records the directory it was written to (``run.dir``) and the checkpoint
    that run resumed from; when ``config_path`` lies in that directory both are
    cleared, so the rerun gets a fresh timestamped directory. To continue the old run
    instead, pass ``--resume RUN_DIR``.

    Returns:
        The config, and a sentence for the user when it was changed ("" otherwise).
    """
    if config_path is None or not cfg.run.dir:
        return cfg, ""
    if Path(config_path).resolve().parent != Path(cfg.run.dir).resolve():
        return cfg, ""
    note = (f"{config_path} is the config of run {cfg.run.dir}: starting a new run with it "
            f"(continue that run with --resume {cfg.run.dir})")
    return dataclasses.replace(
        cfg, run=dataclasses.replace(cfg.run, dir=""),
        checkpoint=dataclasses.replace(cfg.checkpoint, resume="")), note


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
    torchrun (which restarts ranks itself) rank 0 makes a timestamped directory like
    any other run and marks it with torchrun's run id, so restarted ranks find it again.

    Returns:
        The config with ``run.dir`` and ``checkpoint.resume`` set to concrete paths, and
        the checkpoint file to load (None for a fresh start).

    Raises:
        ConfigError: ``run.dir`` already holds checkpoints of another run and this is
            neither a resume nor a restart (training on would mix, then prune, the two).
    """
    run, ckpt = cfg.run, cfg.checkpoint
    run_dir = run.dir
    if not run_dir and os.environ.get("TORCHELASTIC_RUN_ID") and not ckpt.resume:
        run_dir = str(_torchrun_run_dir(run.out_dir, run.name, restart_count))
    resume_from: Path | None = None
    existing = list_checkpoints(run_dir) if run_dir else []
    if restart_count > 0 and existing:
        resume_from = newest_intact(existing)  # the agent restarted us: carry on
        if resume_from is None:
            raise CheckpointError(f"restart {restart_count}: every checkpoint in "
                                  f"{run_dir!r} failed its checksum; nothing to resume.")
    elif ckpt.resume == "auto":  # latest if any (a requeued job), else a fresh start
        resume_from = find_latest_checkpoint(run.out_dir, run.name, run_dir)
    elif ckpt.resume:
        resume_from = find_resume_checkpoint(ckpt.resume, run.out_dir, run.name, run_dir)
    elif existing:
        raise ConfigError(
            f"run.dir = {run_dir!r} already holds checkpoints of an earlier run "
            f"(newest: {existing[-1].name}). Continue it with --resume "
            "latest (your own loop: Fleet(resume=\"latest\")), or start a new run with "
            "another --run-dir (or none, for a fresh timestamped one)."
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
    :mod:`gpufleet.train.checkpoint.runlock`; the lock is None where this run holds it already).

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
def _torchrun_run_dir(out_dir: str, name: str, restart_count: int) -> Path:
    """Under torchrun: a new timestamped directory on the first attempt, marked with
    torchrun's run id; on a restart, the newest directory of this name with that mark."""
    run_id = os.environ["TORCHELASTIC_RUN_ID"]
    if restart_count > 0:
        marked = [p for p in Path(out_dir).glob(f"{glob_escape(name)}-*")
                  if (p / TORCHRUN_MARK).is_file()
                  and (p / TORCHRUN_MARK).read_text() == run_id]
        if marked:
            return max(marked, key=lambda p: p.stat().st_mtime)
    path = new_run_dir(out_dir, name)
    path.mkdir(parents=True)
    (path / TORCHRUN_MARK).write_text(run_id)
    return path
