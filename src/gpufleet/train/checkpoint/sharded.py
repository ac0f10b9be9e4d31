"""Sharded checkpoints: one directory, every rank writes its own shards.

Sharded strategies (``fsdp``) write a directory instead of one file,
``<run_dir>/checkpoints/step-<N>/``:
every rank writes its own shards of model and optimizer state with
``torch.distributed.checkpoint`` (DCP: ``.metadata`` plus ``__<rank>_<i>.distcp`` files),
rank 0 adds ``trainer.pt`` (the rest of the training state, as in a single file) and,
once every rank is done, ``MANIFEST.sha256`` (the SHA-256 of every file, ``sha256sum -c``
format). The directory is built under a temporary name and renamed when complete. DCP
reshards on load, so such a checkpoint loads at any world size, and into ``single`` or
``ddp`` runs too. Every rank must see the same file system (one shared directory).
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import shutil
import warnings
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch

from gpufleet.errors import CheckpointError
from gpufleet.files import fsync_dir
from gpufleet.launch import broadcast_object, gather_objects, is_initialized
from gpufleet.train.checkpoint.files import (
    _CHUNK,
    FORMAT_VERSION,
    MANIFEST,
    TRAINER_STATE,
    _HashingWriter,
    checkpoint_dir,
    prune,
    safe_load,
)

log = logging.getLogger(__name__)


def sharded_checkpoint_path(run_dir: str | Path, step: int) -> Path:
    return checkpoint_dir(run_dir) / f"step-{step:07d}"


def save_sharded_checkpoint(run_dir: str | Path, step: int, shards: dict[str, Any],
                            state: dict[str, Any] | None, keep_last: int,
                            keep: Collection[int] = (), group: Any = None) -> Path:
    """Write a sharded checkpoint for ``step``, then prune all but the newest ``keep_last``
    and the steps in ``keep``.

    COLLECTIVE: every rank calls it with its own ``shards`` (``{"model": ...,
    "optimizer": ...}`` of DTensors, as ``get_state_dict`` returns them); ``state`` (the
    rest of the training state) is used on rank 0 only. ``group``: the process group of
    every rank that the write's own collectives run over (default: the default group);
    a background write passes a group of its own, so that its collectives never stand
    between the training step's.

    Example:
        >>> save_sharded_checkpoint(run_dir, 100, strategy.state_dict(model, opt),
        ...                         {"step": 100, ...}, keep_last=3)  # doctest: +SKIP

    Raises:
        OSError: on every rank, when any rank's write failed. Nothing is left under the
            checkpoint's name and the older checkpoints are untouched.
    """
    path = sharded_checkpoint_path(run_dir, step)
    return write_sharded(path, shards, state, group,
                         then=lambda: prune(run_dir, keep_last, keep))


def write_sharded(path: str | Path, shards: dict[str, Any], state: dict[str, Any] | None,
                  group: Any = None, then: Callable[[], None] | None = None) -> Path:
    """Write a sharded checkpoint directory at ``path``: every rank its ``shards``
    through DCP, rank 0 ``state`` as ``trainer.pt`` and the manifest of every file's
    SHA-256, all under a temporary name renamed to ``path`` when complete (a directory
    there before is replaced only then). ``then`` runs on rank 0 after the rename (its
    errors count as the write's). ``group``: as in :func:`save_sharded_checkpoint`.

    COLLECTIVE: every rank calls it with its own ``shards``.

    Raises:
        OSError: on every rank, when any rank's write failed. Nothing is left under
            ``path``'s name but what was there before.
    """
    dcp = _dcp()
    rank = _rank()
    path = Path(path)
    staging = path.with_name(f".{path.name}.tmp-sharded")
    error: str | None = None
    if rank == 0:
        try:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        except OSError as e:
            error = str(e)
    _raise_if(broadcast_object(error, group=group))  # COLLECTIVE: the folder exists
    digests: dict[str, str] = {}
    try:
        with warnings.catch_warnings():  # without a process group: one process, as meant
            warnings.filterwarnings("ignore", ".*single process.*")
            # COLLECTIVE: each rank its shards (given no process group, DCP's default).
            dcp.save(shards, checkpoint_id=str(staging),
                     **({"process_group": group} if group is not None else {}))
        # Each rank hashes what it wrote (in parallel); rank 0 hashes the rest.
        digests = {p.name: _sha256(p) for p in staging.glob(f"__{rank}_*")}
    except (OSError, dcp.api.CheckpointException) as e:
        # DCP reports a failed write on any rank to all ranks.
        error = f"{type(e).__name__}: {e}"
    reports = gather_objects((error, digests), group)  # COLLECTIVE: a few bytes per rank
    error = next((e for e, _ in reports if e), None)
    if rank == 0 and error is None:
        try:
            _finish_sharded(path, staging, state or {}, {k: v for _, d in reports
                                                          for k, v in d.items()})
            if then is not None:
                then()
        except (OSError, RuntimeError) as e:  # torch.save: a failed write is a RuntimeError
            error = str(e)
    error = broadcast_object(error, group=group)  # COLLECTIVE: everyone learns the end
    if error is not None and rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
    _raise_if(error)
    return path


def _finish_sharded(path: Path, staging: Path, state: dict[str, Any],
                    digests: dict[str, str]) -> None:
    """Rank 0, after every rank wrote its shards: the training state, the manifest, the
    rename to the final name."""
    with open(staging / TRAINER_STATE, "wb") as f:
        out = _HashingWriter(f)
        torch.save({"format": FORMAT_VERSION, "sharded": True, **state}, out.file)
        f.flush()
        os.fsync(f.fileno())
    digests[TRAINER_STATE] = out.sha256.hexdigest()
    for p in staging.iterdir():  # .metadata, and shards of a naming DCP may change
        if p.is_file() and p.name not in digests:
            digests[p.name] = _sha256(p)
    manifest_tmp = staging / f".{MANIFEST}.tmp"
    with open(manifest_tmp, "w") as f:
        f.writelines(f"{digest}  {name}\n" for name, digest in sorted(digests.items()))
        f.flush()
        os.fsync(f.fileno())
    os.replace(manifest_tmp, staging / MANIFEST)
    fsync_dir(staging)
    # The same name written again (a step after a restart, a loop saving to one path):
    # the previous directory steps aside, the new one takes the name, then the previous
    # one goes. A crash in between leaves the previous one complete under old_name.
    old = previous_name(path)
    _remove(old)
    if path.exists():
        os.replace(path, old)
    os.replace(staging, path)
    fsync_dir(path.parent)
    _remove(old)


def previous_name(path: Path) -> Path:
    """Where :func:`write_sharded` keeps the checkpoint it replaces at ``path`` until
    the new one has the name (a reader finds it there after a crash in that moment)."""
    return path.with_name(f".{path.name}.old-sharded")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def verify_sharded(path: Path) -> None:
    try:
        lines = (path / MANIFEST).read_text().splitlines()
    except OSError:
        raise CheckpointError(
            f"sharded checkpoint {str(path)!r} has no readable {MANIFEST}: it was never "
            "completed or was damaged since. Resume from an earlier checkpoint in "
            f"{str(path.parent)!r}.") from None
    for line in lines:
        expected, name = line.split(maxsplit=1)
        try:
            digest = _sha256(path / name)
        except OSError:
            digest = "missing"
        if digest != expected:
            raise CheckpointError(
                f"sharded checkpoint {str(path)!r} is damaged: {name} is "
                f"{'missing' if digest == 'missing' else 'not what was written'} (SHA-256 "
                f"check). Resume from an earlier checkpoint in {str(path.parent)!r}.")


def read_trainer_state(path: str | Path) -> dict[str, Any]:
    """A sharded checkpoint's training state (step, scheduler, sampler, RNG, config).
    Every load of a sharded checkpoint starts here, so its DCP metadata is checked too."""
    check_metadata(path)
    return safe_load(Path(path) / TRAINER_STATE, shown=path)  # tensors and plain data only


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` (which DCP itself reads with plain ``pickle.load``)
    allowing only what DCP writes there: its own metadata classes, tensor sizes, dtypes
    and layouts, paths. Anything else, e.g. a function a crafted file calls, is refused."""

    def find_class(self, module: str, name: str) -> Any:
        obj = super().find_class(module, name)
        if module.startswith("torch.distributed.checkpoint.") and isinstance(obj, type) \
                and obj.__module__.startswith("torch.distributed.checkpoint."):
            return obj
        allowed = ((module == "torch" and (name == "Size" or isinstance(obj, torch.dtype)))
                   or (module, name) == ("torch.serialization", "_get_layout")
                   or (module == "pathlib" and name in ("PosixPath", "WindowsPath",
                                                        "PurePosixPath", "PureWindowsPath")))
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name}")
        return obj


def check_metadata(path: str | Path) -> None:
    """Refuse a sharded checkpoint whose ``.metadata`` asks for more than DCP's own
    classes (loading it through DCP would run that code).

    Raises:
        CheckpointError: the metadata is missing, damaged or asks for other objects.
    """
    file = Path(path) / ".metadata"
    try:
        with open(file, "rb") as f:
            _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"sharded checkpoint {str(path)!r}: its .metadata asks for {e}, which DCP's "
            "metadata never holds; loading it could run code from the file, so gpufleet "
            "refuses. Use a checkpoint written by gpufleet.") from None
    except (OSError, EOFError, ValueError, AttributeError, ImportError) as e:
        raise CheckpointError(f"sharded checkpoint {str(path)!r}: .metadata cannot be read "
                              f"({e}). Resume from an earlier checkpoint.") from None


def read_full_model(path: str | Path) -> dict[str, torch.Tensor]:
    """The whole model state dict of a sharded checkpoint, in this process, on the CPU
    (no process group needed): for serving, exporting or comparing weights.

    Example:
        >>> weights = read_full_model("runs/gpt/checkpoints/step-0001000")  # doctest: +SKIP
    """
    dcp = _dcp()
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    check_metadata(path)  # DCP reads it with plain pickle
    reader = dcp.FileSystemReader(str(path))
    meta = reader.read_metadata().state_dict_metadata
    model = {key.removeprefix("model."): torch.empty(m.size, dtype=m.properties.dtype)
             for key, m in meta.items()
             if key.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*single process.*")  # that is the intent here
        # no_dist: read alone even inside a process group (passed only there: older
        # torch infers it and lacks the argument).
        dcp.load({"model": model}, storage_reader=reader,
                 **({"no_dist": True} if is_initialized() else {}))
    return model


def load_sharded_into(path: str | Path, model: torch.nn.Module,
                      optimizer: torch.optim.Optimizer,
                      consolidates_optimizer: bool = False) -> None:
    """Load a sharded checkpoint's model and optimizer state into ``model`` (plain, DDP or
    FSDP) and ``optimizer``, resharding to this run's world size.

    COLLECTIVE when a process group exists: every rank reads the parts of the saved
    shards that make up its own.

    Args:
        path: the checkpoint's ``step-N/`` folder.
        model: the model to fill (plain, DDP or FSDP).
        optimizer: its optimizer.
        consolidates_optimizer: the run's strategy keeps its optimizer state sharded by
            rank (its ``traits.consolidates_optimizer``: zero1), which cannot load one.

    Raises:
        RuntimeError: the checkpoint does not fit the model or optimizer, or the
            strategy consolidates its optimizer state.
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if consolidates_optimizer:  # the strategy's trait (zero1)
        raise RuntimeError("a sharded checkpoint loads into fsdp, ddp or single runs, not "
                           "zero1; resume with one of those strategies")
    # Tensors of the right shapes and shardings for this run, filled in place by DCP
    # (the optimizer's state is created first if it has taken no step yet).
    msd, osd = get_state_dict(model, optimizer)
    state = read_shards(path, {"model": msd, "optimizer": osd})
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])


def read_shards(path: str | Path, like: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``like`` (state dicts of this run's shapes and shardings, as
    ``get_model_state_dict`` and ``get_optimizer_state_dict`` return them) read from the
    sharded checkpoint at ``path``, resharded to this run's world size; head-split
    (tensor parallel) tensors are read whole, then split again.

    COLLECTIVE when a process group exists: every rank reads the parts of the saved
    shards that make up its own.

    Raises:
        RuntimeError: the checkpoint lacks an entry of ``like`` or does not fit it.
    """
    dcp = _dcp()
    from gpufleet.parallel.tensor import restore_strided, without_strided

    state = without_strided(like)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", ".*single process.*")
            dcp.load(state, checkpoint_id=str(path))
    except dcp.api.CheckpointException as e:  # a BaseException: make it an error
        raise RuntimeError(str(e)) from None
    return restore_strided(state, like)


def saved_keys(path: str | Path) -> set[str]:
    """The flattened names DCP's metadata lists for a sharded checkpoint
    (``"model.0.weight"``, ``"optimizer.state.0.weight.exp_avg"``, ...)."""
    dcp = _dcp()
    check_metadata(path)  # DCP reads it with plain pickle
    return set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def _dcp() -> Any:
    try:
        import torch.distributed.checkpoint as dcp
        import torch.distributed.checkpoint.api  # CheckpointException
    except ImportError as e:  # pragma: no cover - torch builds without distributed
        raise CheckpointError(f"sharded checkpoints need torch.distributed.checkpoint "
                              f"(torch >= 2.4); this is torch {torch.__version__}.") from e
    return dcp


def _rank() -> int:
    return torch.distributed.get_rank() if is_initialized() else 0


def _raise_if(error: str | None) -> None:
    if error is not None:
        raise OSError(error)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
