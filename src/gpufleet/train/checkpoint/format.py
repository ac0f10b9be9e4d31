"""Checkpoint files: where they live, how they are written, checked and found again.

A checkpoint is one ``torch.save`` file, ``<run_dir>/checkpoints/step-<N>.pt``, plus its
SHA-256 in ``step-<N>.pt.sha256`` (the format of ``sha256sum``, so ``sha256sum -c`` checks
it too). Rank 0 writes the file to a temporary name while hashing the bytes it writes,
fsyncs it, puts the checksum in place, then renames the file: a crash mid-write never
leaves a half-written file under the real name, and a file damaged later (a truncated
copy, a bad disk) fails its checksum on load. Older checkpoints are pruned only after
the new one is complete, so a failed write leaves the previous ones intact. The newest
``keep_last`` are kept.

Sharded strategies (``fsdp``) write a directory instead, ``step-<N>/``: see
:mod:`gpufleet.train.checkpoint.sharded`. Listing, pruning, verifying and finding checkpoints here
handle both kinds.

Every checkpoint holds tensors and plain data only (RNG states as tensors and ints, the
config as a dict of plain values) and every load goes through :func:`safe_load`
(``torch.load(weights_only=True)``): a received file cannot run code when it is loaded,
whatever its checksum says (a sender sends a matching ``.sha256``). A file that needs
arbitrary pickled objects is refused; one written by gpufleet before format 2 (numpy
arrays in its RNG state) is converted once with ``gpufleet checkpoint migrate FILE``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import zipfile
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any

import torch

from gpufleet.config.loader import tomllib
from gpufleet.errors import CheckpointError
from gpufleet.files import fsync_dir
from gpufleet.train.checkpoint.files import (
    _CHUNK,
    FORMAT_VERSION,
    MANIFEST,
    TRAINER_STATE,
    _HashingWriter,
    checkpoint_dir,
    checkpoint_path,
    checksum_path,
    list_checkpoints,
    prune,
    safe_load,
)

log = logging.getLogger(__name__)

def save_checkpoint(run_dir: str | Path, step: int, state: dict[str, Any],
                    keep_last: int, keep: Collection[int] = ()) -> Path:
    """Write ``state`` for ``step`` atomically with its checksum, then prune all but the
    newest ``keep_last`` and the steps in ``keep``.

    Raises:
        OSError: the write failed (e.g. no space left on device). Nothing is left under
            the checkpoint's name and the older checkpoints are untouched.
    """
    folder = checkpoint_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = checkpoint_path(run_dir, step)
    write_checkpoint_file(path, {"format": FORMAT_VERSION, **state})
    prune(run_dir, keep_last, keep)
    return path


def write_checkpoint_file(path: Path, state: dict[str, Any]) -> None:
    """``torch.save`` ``state`` to ``path`` atomically, with ``path.sha256`` beside it.

    Raises:
        OSError: the write failed; nothing is left under ``path``'s name.
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    sums = checksum_path(path)
    sums_tmp = sums.with_name(f".{sums.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            out = _HashingWriter(f)
            try:
                torch.save(state, out.file)
            except RuntimeError as e:
                # torch's zip writer turns a failed write into a RuntimeError: give the
                # caller the OSError (ENOSPC, EIO, ...) that caused it.
                if out.error is not None:
                    raise out.error from e
                raise
            f.flush()
            os.fsync(f.fileno())
        with open(sums_tmp, "w") as f:
            f.write(f"{out.sha256.hexdigest()}  {path.name}\n")
            f.flush()
            os.fsync(f.fileno())
        # The checksum goes in place first: a checkpoint under its real name always has
        # one (a crash between the two renames leaves only a stray .sha256).
        os.replace(sums_tmp, sums)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)
        sums_tmp.unlink(missing_ok=True)


# Set by the launcher for its ranks: a checkpoint file it has just verified, so that
# rank 0 does not hash the same (possibly many-GB) bytes again before loading them.
VERIFIED_ENV = "GPUFLEET_VERIFIED_CHECKPOINT"


def _fingerprint(path: Path) -> str:
    stat = path.stat()
    return f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"


def mark_verified(path: str | Path) -> None:
    """Tell processes started from here that ``path`` passed its checksum as it is now
    (the same size and modification time); a changed file is checked again."""
    os.environ[VERIFIED_ENV] = _fingerprint(Path(path))


def _verified_here(path: Path) -> bool:
    return os.environ.get(VERIFIED_ENV) == _fingerprint(path)


def verify_checkpoint(path: str | Path) -> None:
    """Check a checkpoint file against its recorded SHA-256.

    Raises:
        CheckpointError: the file is missing, or its bytes do not match the checksum
            written with it (truncated or damaged after it was written).
    """
    path = Path(path)
    if path.is_dir():
        from gpufleet.train.checkpoint.sharded import verify_sharded

        verify_sharded(path)
        return
    sums = checksum_path(path)
    try:
        expected = sums.read_text().split()[0]
    except FileNotFoundError:
        if not path.exists():
            raise CheckpointError(f"checkpoint {str(path)!r} does not exist.") from None
        log.warning("checkpoint %s has no checksum file (%s): only its structure is "
                    "checked", path, sums.name)
        _check_structure(path)
        return
    except (OSError, IndexError) as e:
        raise CheckpointError(f"checksum file {str(sums)!r} cannot be read ({e}).") from e
    digest, size = hashlib.sha256(), 0
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
                size += len(chunk)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist.") from None
    if digest.hexdigest() != expected:
        raise CheckpointError(
            f"checkpoint {str(path)!r} is damaged: its SHA-256 does not match the one "
            f"written with it ({size:,} bytes now; truncated or corrupted after writing). "
            f"Resume from an earlier checkpoint in {str(path.parent)!r}."
        )


def _check_structure(path: Path) -> None:
    """Without a checksum: a file ``torch.save`` wrote is a zip archive whose every
    member passes its CRC; a truncated or damaged one does not."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        bad = str(e)
    if bad is not None:
        raise CheckpointError(
            f"checkpoint {str(path)!r} cannot be read: it is not a complete checkpoint "
            f"file ({bad}; truncated, damaged or not a checkpoint). Resume from an "
            f"earlier checkpoint in {str(path.parent)!r}.")


def newest_intact(paths: Iterable[Path]) -> Path | None:
    """The newest checkpoint among ``paths`` (oldest first) that passes its checksum;
    each damaged newer one is reported and skipped."""
    for path in reversed(list(paths)):
        try:
            verify_checkpoint(path)
        except CheckpointError as e:
            log.error("%s Falling back to the previous checkpoint.", e)
            continue
        return path
    return None


def load_checkpoint(path: str | Path, verify: bool = True) -> dict[str, Any]:
    """Read a checkpoint on the CPU; a damaged file raises :class:`CheckpointError`.

    ``verify=False`` skips the checksum (for a file verified once already, so that N
    ranks do not each hash it again).
    """
    path = Path(path)
    if verify:
        verify_checkpoint(path)
    if path.is_dir():  # sharded: the training state plus the whole model, gathered
        from gpufleet.train.checkpoint.sharded import read_full_model, read_trainer_state

        return {**read_trainer_state(path), "model": read_full_model(path)}
    return safe_load(path)


def check_loadable(path: str | Path) -> None:
    """Raise :class:`CheckpointError` now, in the launching process, if the checkpoint
    would be refused by :func:`safe_load` in the ranks. Tensors are memory-mapped, not
    read: a check of the structure costs little even for a large file."""
    path = Path(path)
    if path.is_dir():
        from gpufleet.train.checkpoint.sharded import check_metadata

        check_metadata(path)
        path, shown = path / TRAINER_STATE, path
    else:
        shown = path
    safe_load(path, shown=shown, mmap=True)


def find_latest_checkpoint(out_dir: str | Path, run_name: str, run_dir: str = ""
                           ) -> Path | None:
    """The newest intact checkpoint of ``run_dir``, else of any run named ``run_name``
    under ``out_dir``; None when there is none (what ``--resume auto`` starts fresh on).

    Raises:
        CheckpointError: the newest run's checkpoints all failed their checksum.
    """
    candidates = [Path(run_dir)] if run_dir else [
        p for p in Path(out_dir).glob(f"{glob_escape(run_name)}-*")
        if _recorded_name(p) == run_name]
    runs = [c for c in map(list_checkpoints, candidates) if c]
    if not runs:
        return None
    # The run written last, then its newest intact checkpoint.
    runs.sort(key=lambda c: c[-1].stat().st_mtime)
    found = newest_intact(runs[-1])
    if found is None:
        raise CheckpointError(
            f"every checkpoint in {str(runs[-1][-1].parent)!r} failed its checksum. "
            "Start a new run without --resume.")
    return found


def find_resume_checkpoint(resume: str, out_dir: str | Path, run_name: str,
                           run_dir: str = "") -> Path:
    """Turn ``checkpoint.resume`` into a checkpoint file.

    ``latest`` means the newest checkpoint of ``run_dir`` when it is set, else the newest
    checkpoint of any run named ``run_name`` under ``out_dir`` (the name recorded in each
    run's ``config.toml``, so ``gpt`` never picks up a run named ``gpt-stdlib``). A
    directory means the newest checkpoint inside it (a run directory or its
    ``checkpoints`` folder). Both pass over damaged checkpoints (failed checksum) to the
    newest intact one, saying so; a file named explicitly must be intact. (``auto``, which
    may find nothing, is :func:`find_latest_checkpoint`.)
    """
    if resume == "latest":
        found = find_latest_checkpoint(out_dir, run_name, run_dir)
        if found is not None:
            return found
        where = run_dir or f"{out_dir}/{run_name}-*"
        raise CheckpointError(
            f"--resume latest found no checkpoint under {where!r}. Start without --resume, "
            "use --resume auto (latest if any, else a fresh start), or pass a checkpoint "
            "path, or set run.name / run.dir to the run to continue."
        )
    path = Path(resume)
    if (path / MANIFEST).exists() or (path / TRAINER_STATE).exists():
        verify_checkpoint(path)  # one sharded checkpoint, named explicitly
        return path
    if path.is_dir():
        listed = list_checkpoints(path) or list_checkpoints(path.parent)
        if not listed:
            raise CheckpointError(f"no checkpoint (step-N.pt or step-N/) in {resume!r}. "
                                  "Pass a run directory that has checkpoints/ or a .pt file.")
        intact = newest_intact(listed)
        if intact is None:
            raise CheckpointError(f"every checkpoint in {resume!r} failed its checksum. "
                                  "Start a new run without --resume.")
        return intact
    if not path.is_file():
        raise CheckpointError(f"--resume {resume!r}: no such file or directory. "
                              "Use 'latest', 'auto' or the path of a checkpoint or run "
                              "directory.")
    if not _verified_here(path):
        verify_checkpoint(path)
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


def load_into(path: str | Path, model: Any, optimizer: Any = None) -> dict[str, Any]:
    """Load a gpufleet checkpoint into your own module (and optimizer), outside gpufleet.

    ``path`` is a checkpoint (``step-0000400.pt``, or a sharded checkpoint's directory,
    gathered whole) or a run directory (its newest checkpoint). The file's checksum is
    verified and it is read with ``weights_only=True``; the model's weights are stored
    without wrapper prefixes, so they load into the plain module, strictly. The
    optimizer's state loads when the checkpoint holds it in torch's own layout (single,
    ddp, local_sgd runs). A run of several models: give dicts by model name (``model``
    and ``optimizer``; models left out are not loaded).

    Example:
        >>> # model = MyNet(); gpufleet.load_checkpoint("runs/mynet-.../", model)
        >>> # model.eval()

    Returns:
        The checkpoint's other contents: ``step``, ``epoch``, ``config``, ...

    Raises:
        CheckpointError: no checkpoint there, a damaged file, or weights that do not fit.
    """
    path = Path(path)
    if path.is_dir() and not (path / TRAINER_STATE).exists():  # a run directory
        found = list_checkpoints(path)
        if not found:
            raise CheckpointError(f"{str(path)!r} holds no checkpoint (checkpoints/step-*). "
                                  "Give a checkpoint file, or a run directory that has one.")
        path = found[-1]
    state = load_checkpoint(path)
    if "models" in state:  # several models, each with its own optimizer
        _load_models_into(path, state, model, optimizer)
        return state
    if isinstance(model, dict):
        raise CheckpointError(f"{str(path)!r} holds one model; give the module itself, "
                              "not a dict of them.")
    try:
        model.load_state_dict(state.pop("model"))
    except RuntimeError as e:
        raise CheckpointError(f"the weights in {str(path)!r} do not fit this model: {e}. "
                              "Build the model the run trained (its config.toml says "
                              "which).") from None
    saved = state.pop("optimizer", None)
    if optimizer is not None:
        if not isinstance(saved, dict) or "param_groups" not in saved:
            raise CheckpointError(f"{str(path)!r} holds no optimizer state in torch's layout "
                                  "(sharded runs keep it per parameter name); load the "
                                  "weights alone, or resume the run with gpufleet.")
        optimizer.load_state_dict(saved)
    return state


def _load_models_into(path: Path, state: dict[str, Any], models: Any,
                      optimizers: Any) -> None:
    """Each model (and optimizer) of ``models`` from its entry of a checkpoint of a run
    of several models."""
    saved = state.pop("models")
    if not isinstance(models, dict) or set(models) - set(saved):
        raise CheckpointError(
            f"{str(path)!r} holds the models {sorted(saved)}: give a dict of modules by "
            "those names (and of optimizers, to load them too).")
    for name, module in models.items():
        try:
            module.load_state_dict(saved[name]["model"])
            if optimizers is not None and name in optimizers:
                optimizers[name].load_state_dict(saved[name]["optimizer"])
        except (RuntimeError, ValueError) as e:
            raise CheckpointError(f"the {name!r} state in {str(path)!r} does not fit: {e}. "
                                  "Build the models the run trained.") from None
