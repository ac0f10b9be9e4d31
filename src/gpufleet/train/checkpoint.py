"""Checkpoint files: where they live, how they are written and found again.

A checkpoint is one ``torch.save`` file, ``<run_dir>/checkpoints/step-<N>.pt``, written
by rank 0 to a temporary name and renamed, so a crash mid-write never leaves a
half-written file under the real name. The newest ``keep_last`` are kept.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

import torch

from gpufleet.config.loader import tomllib
from gpufleet.errors import CheckpointError

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_NAME = re.compile(r"^step-(\d+)\.pt$")


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Checkpoints of a run, oldest step first."""
    folder = checkpoint_dir(run_dir)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    return checkpoint_dir(run_dir) / f"step-{step:07d}.pt"


def save_checkpoint(run_dir: str | Path, step: int, state: dict[str, Any],
                    keep_last: int) -> Path:
    """Write ``state`` for ``step`` atomically and prune all but the newest ``keep_last``."""
    folder = checkpoint_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = checkpoint_path(run_dir, step)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save({"format": FORMAT_VERSION, **state}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    for old in list_checkpoints(run_dir)[:-keep_last]:
        old.unlink(missing_ok=True)
    return path


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint on the CPU; a damaged file raises :class:`CheckpointError`."""
    path = Path(path)
    try:
        # weights_only=False: the file holds RNG states and the config, which are plain
        # Python objects. Only load checkpoints you wrote yourself.
        state = torch.load(path, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist.") from None
    except Exception as e:
        raise CheckpointError(
            f"checkpoint {str(path)!r} cannot be read ({type(e).__name__}: {e}). "
            "The file is damaged or not a gpufleet checkpoint; resume from an earlier one "
            f"in {str(path.parent)!r}."
        ) from e
    if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {str(path)!r} is not a gpufleet checkpoint of format "
            f"{FORMAT_VERSION}. Pass a file written by `gpufleet train`."
        )
    return state


def find_resume_checkpoint(resume: str, out_dir: str | Path, run_name: str,
                           run_dir: str = "") -> Path:
    """Turn ``checkpoint.resume`` into a checkpoint file.

    ``latest`` means the newest checkpoint of ``run_dir`` when it is set, else the newest
    checkpoint of any run named ``run_name`` under ``out_dir`` (the name recorded in each
    run's ``config.toml``, so ``gpt`` never picks up a run named ``gpt-stdlib``). A
    directory means the newest checkpoint inside it (a run directory or its
    ``checkpoints`` folder).
    """
    if resume == "latest":
        candidates = [Path(run_dir)] if run_dir else [
            p for p in Path(out_dir).glob(f"{glob_escape(run_name)}-*")
            if _recorded_name(p) == run_name]
        found = [c[-1] for c in map(list_checkpoints, candidates) if c]
        if found:
            return max(found, key=lambda p: p.stat().st_mtime)
        where = run_dir or f"{out_dir}/{run_name}-*"
        raise CheckpointError(
            f"--resume latest found no checkpoint under {where!r}. Start without --resume, "
            "or pass a checkpoint path, or set run.name / run.dir to the run to continue."
        )
    path = Path(resume)
    if path.is_dir():
        found = list_checkpoints(path) or list_checkpoints(path.parent)
        if not found:
            raise CheckpointError(f"no checkpoint (step-N.pt) in {resume!r}. "
                                  "Pass a run directory that has checkpoints/ or a .pt file.")
        return found[-1]
    if not path.is_file():
        raise CheckpointError(f"--resume {resume!r}: no such file or directory. "
                              "Use 'latest' or the path of a checkpoint or run directory.")
    return path


def run_dir_of(checkpoint: Path) -> Path | None:
    """The run directory a checkpoint file belongs to (None for a file kept elsewhere)."""
    return checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else None


def _recorded_name(run_dir: Path) -> str | None:
    try:
        with open(run_dir / "config.toml", "rb") as f:
            return tomllib.load(f).get("run", {}).get("name")
    except (OSError, tomllib.TOMLDecodeError):
        return None


def glob_escape(text: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", text)
