"""Where ``Fleet.save``'s content goes: one file from rank 0, or a directory of every
rank's shards, now or in the background (``checkpoint.async_save``), through the
checkpointer ``fit`` uses (:mod:`gpufleet.train.checkpoint`). ``start``: when the save
began (``time.perf_counter()``), for the logged times."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from gpufleet.errors import ConfigError
from gpufleet.launch import barrier, gather_objects
from gpufleet.train.checkpoint.async_writer import BackgroundSaves, log_saved
from gpufleet.train.checkpoint.format import write_checkpoint_file
from gpufleet.train.checkpoint.sharded import write_sharded


def write_directory(path: Path, shards: dict[str, Any], rest: dict[str, Any],
                    background: tuple[BackgroundSaves, Any] | None, start: float,
                    rank: int) -> Path:
    """Every rank its shards, rank 0 ``rest``, as a sharded directory at ``path``: now,
    or with ``background`` (the saver and its writers' process group) in its thread.
    COLLECTIVE."""
    if path.is_file():
        raise ConfigError(f"Fleet.save: {path} is a file (saved under a strategy whose "
                          "ranks hold the whole model); a sharded checkpoint is a "
                          "directory. Save to another path.")
    if background is None:
        write_sharded(path, shards, rest if rank == 0 else None)  # COLLECTIVE
        if rank == 0:
            log_saved(path, 0, time.perf_counter() - start, None)
        return path
    saves, group = background
    saves.submit(0, path, (shards, rest if rank == 0 else None),
                 lambda host: write_sharded(path, host[0], host[1], group), start,
                 rank == 0)
    return path


def write_file(path: Path, content: dict[str, Any],
               background: tuple[BackgroundSaves, Any] | None, start: float,
               rank: int) -> Path:
    """Rank 0 writes ``content`` as one file, now or in the background; every rank
    learns how a write now went. COLLECTIVE."""
    error: OSError | None = None
    if rank == 0:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if background is not None:
                background[0].submit(0, path, content,
                                     lambda host: write_checkpoint_file(path, host),
                                     start, True)
            else:
                write_checkpoint_file(path, content)
        except OSError as e:
            error = e
    errors = gather_objects(None if error is None else f"{type(error).__name__}: {error}")
    barrier()  # COLLECTIVE: no rank reads the file before it is complete
    if error is not None:
        raise error
    if errors[0] is not None:
        raise OSError(f"rank 0 could not write {path}: {errors[0]}")
    return path
