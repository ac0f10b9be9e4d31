"""The files of a run's checkpoints: names, listing, pruning, hashed writes and the
safe read (``weights_only=True``) that every checkpoint load goes through.

Both checkpoint formats build on this: one file per step (:mod:`gpufleet.train.checkpoint.format`)
and a directory of shards (:mod:`gpufleet.train.checkpoint.sharded`).
"""

from __future__ import annotations

import hashlib
import os
import pickle
import re
import shutil
from collections.abc import Collection
from pathlib import Path
from typing import IO, Any, cast

import torch

from gpufleet.errors import CheckpointError

FORMAT_VERSION = 2  # 2: loads with weights_only=True (1 had numpy arrays in "rng")
READABLE_FORMATS = (1, 2)  # a format-1 file that loads safely (no numpy state) is fine
_NAME = re.compile(r"^step-(\d+)(\.pt)?$")  # a file, or a directory of shards
MANIFEST = "MANIFEST.sha256"  # in a sharded checkpoint: every file's SHA-256
TRAINER_STATE = "trainer.pt"  # in a sharded checkpoint: all but model and optimizer
_CHUNK = 1 << 20  # bytes hashed per read when verifying


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Checkpoints of a run, oldest step first."""
    folder = checkpoint_dir(run_dir)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir()
             if (m := _NAME.match(p.name)) and (m.group(2) is not None) != p.is_dir()]
    return [p for _, p in sorted(found)]


def step_of(path: Path) -> int:
    """The step a checkpoint's name says (``step-0000400.pt``: 400)."""
    m = _NAME.match(path.name)
    if m is None:
        raise ValueError(f"{path} is not named like a checkpoint (step-NNNNNNN[.pt])")
    return int(m.group(1))


def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    return checkpoint_dir(run_dir) / f"step-{step:07d}.pt"


def checksum_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def prune(run_dir: str | Path, keep_last: int, keep: Collection[int] = ()) -> None:
    """Delete all but the newest ``keep_last`` checkpoints (files or directories) and
    those of the steps in ``keep`` (the best ones), and what interrupted writers left
    behind."""
    for old in list_checkpoints(run_dir)[:-keep_last]:
        if step_of(old) in keep:
            continue
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
            checksum_path(old).unlink(missing_ok=True)
    _remove_strays(checkpoint_dir(run_dir))


class _HashingWriter:
    """A file wrapper that hashes every byte ``torch.save`` writes through it."""

    def __init__(self, f: Any) -> None:
        self.f, self.sha256 = f, hashlib.sha256()
        self.error: OSError | None = None

    @property
    def file(self) -> IO[bytes]:
        """This writer as ``torch.save``'s file: it is written to through ``write`` and
        ``flush`` only, all torch.save calls on a file it did not open."""
        return cast("IO[bytes]", self)

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def _remove_strays(folder: Path) -> None:
    """Temporary files of writers that died mid-write, and checksums without a file."""
    for p in folder.iterdir():
        stray_tmp = p.name.startswith(".step-") and f".tmp-{os.getpid()}" not in p.name
        orphan_sum = p.suffix == ".sha256" and not p.with_suffix("").exists()
        if stray_tmp and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        elif stray_tmp or orphan_sum:
            p.unlink(missing_ok=True)


def safe_load(path: str | Path, shown: str | Path | None = None,
              mmap: bool = False) -> dict[str, Any]:
    """``torch.load(path, weights_only=True)`` on the CPU, as a gpufleet checkpoint.

    Tensors and plain data only: nothing in the file can run code. ``shown`` is the path
    named in errors and in the migration command (a sharded checkpoint's directory).

    Raises:
        CheckpointError: the file is missing, damaged, needs pickled Python objects
            (an old or foreign file: the message gives the one-line migration), or is
            not a gpufleet checkpoint.
    """
    path = Path(path)
    shown = str(shown or path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {shown!r} does not exist.") from None
    except pickle.UnpicklingError as e:
        named = re.search(r"GLOBAL ([\w.]+)", str(e))
        refused = f"it calls for {named.group(1)}" if named else "objects torch's safe " \
            "loader refuses"
        raise CheckpointError(
            f"checkpoint {shown!r} holds pickled Python objects, not only tensors and plain "
            f"data ({refused}); loading it could run code from the file, so gpufleet "
            "refuses. If you wrote it yourself with gpufleet before format 2, convert it "
            f"once (only for a file you trust): gpufleet checkpoint migrate {shown}"
        ) from None
    except Exception as e:
        raise CheckpointError(
            f"checkpoint {shown!r} cannot be read ({type(e).__name__}: {e}). "
            "The file is damaged or not a gpufleet checkpoint; resume from an earlier one "
            f"in {str(Path(shown).parent)!r}."
        ) from e
    if not isinstance(state, dict) or state.get("format") not in READABLE_FORMATS:
        raise CheckpointError(
            f"checkpoint {shown!r} is not a gpufleet checkpoint of format "
            f"{FORMAT_VERSION}. Pass a file written by `gpufleet train`."
        )
    return state
