"""Checkpoint files: where they live, how they are written, checked and found again.

A checkpoint is one ``torch.save`` file, ``<run_dir>/checkpoints/step-<N>.pt``, plus its
SHA-256 in ``step-<N>.pt.sha256`` (the format of ``sha256sum``, so ``sha256sum -c`` checks
it too). Rank 0 writes the file to a temporary name while hashing the bytes it writes,
fsyncs it, puts the checksum in place, then renames the file: a crash mid-write never
leaves a half-written file under the real name, and a file damaged later (a truncated
copy, a bad disk) fails its checksum on load. Older checkpoints are pruned only after
the new one is complete, so a failed write leaves the previous ones intact. The newest
``keep_last`` are kept.

Sharded strategies (``fsdp``) write a directory instead, ``<run_dir>/checkpoints/step-<N>/``:
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
import re
import shutil
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from gpufleet.config.loader import tomllib
from gpufleet.errors import CheckpointError
from gpufleet.files import fsync_dir
from gpufleet.launch import broadcast_object, gather_objects, is_initialized

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
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


def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    return checkpoint_dir(run_dir) / f"step-{step:07d}.pt"


def checksum_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def save_checkpoint(run_dir: str | Path, step: int, state: dict[str, Any],
                    keep_last: int) -> Path:
    """Write ``state`` for ``step`` atomically with its checksum, then prune all but the
    newest ``keep_last``.

    Raises:
        OSError: the write failed (e.g. no space left on device). Nothing is left under
            the checkpoint's name and the older checkpoints are untouched.
    """
    folder = checkpoint_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = checkpoint_path(run_dir, step)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    sums = checksum_path(path)
    sums_tmp = sums.with_name(f".{sums.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            out = _HashingWriter(f)
            try:
                torch.save({"format": FORMAT_VERSION, **state}, out)
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
        fsync_dir(folder)
    finally:
        tmp.unlink(missing_ok=True)
        sums_tmp.unlink(missing_ok=True)
    prune(run_dir, keep_last)
    return path


def prune(run_dir: str | Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` checkpoints (files or directories), and
    what interrupted writers left behind."""
    for old in list_checkpoints(run_dir)[:-keep_last]:
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


def verify_checkpoint(path: str | Path) -> None:
    """Check a checkpoint file against its recorded SHA-256.

    Raises:
        CheckpointError: the file is missing, or its bytes do not match the checksum
            written with it (truncated or damaged after it was written).
    """
    path = Path(path)
    if path.is_dir():
        _verify_sharded(path)
        return
    sums = checksum_path(path)
    try:
        expected = sums.read_text().split()[0]
    except FileNotFoundError:
        if not path.exists():
            raise CheckpointError(f"checkpoint {str(path)!r} does not exist.") from None
        log.warning("checkpoint %s has no checksum file (%s): it cannot be verified",
                    path, sums.name)
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
        return {**read_trainer_state(path), "model": read_full_model(path)}
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
    ``checkpoints`` folder). Both pass over damaged checkpoints (failed checksum) to the
    newest intact one, saying so; a file named explicitly must be intact.
    """
    if resume == "latest":
        candidates = [Path(run_dir)] if run_dir else [
            p for p in Path(out_dir).glob(f"{glob_escape(run_name)}-*")
            if _recorded_name(p) == run_name]
        runs = [c for c in map(list_checkpoints, candidates) if c]
        if runs:
            # The run written last, then its newest intact checkpoint.
            runs.sort(key=lambda c: c[-1].stat().st_mtime)
            found = newest_intact(runs[-1])
            if found is None:
                raise CheckpointError(
                    f"every checkpoint in {str(runs[-1][-1].parent)!r} failed its checksum. "
                    "Start a new run without --resume.")
            return found
        where = run_dir or f"{out_dir}/{run_name}-*"
        raise CheckpointError(
            f"--resume latest found no checkpoint under {where!r}. Start without --resume, "
            "or pass a checkpoint path, or set run.name / run.dir to the run to continue."
        )
    path = Path(resume)
    if (path / MANIFEST).exists() or (path / TRAINER_STATE).exists():
        verify_checkpoint(path)  # one sharded checkpoint, named explicitly
        return path
    if path.is_dir():
        found = list_checkpoints(path) or list_checkpoints(path.parent)
        if not found:
            raise CheckpointError(f"no checkpoint (step-N.pt or step-N/) in {resume!r}. "
                                  "Pass a run directory that has checkpoints/ or a .pt file.")
        intact = newest_intact(found)
        if intact is None:
            raise CheckpointError(f"every checkpoint in {resume!r} failed its checksum. "
                                  "Start a new run without --resume.")
        return intact
    if not path.is_file():
        raise CheckpointError(f"--resume {resume!r}: no such file or directory. "
                              "Use 'latest' or the path of a checkpoint or run directory.")
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


# -- sharded checkpoints (one directory, every rank writes its shards) -------------------
def sharded_checkpoint_path(run_dir: str | Path, step: int) -> Path:
    return checkpoint_dir(run_dir) / f"step-{step:07d}"


def save_sharded_checkpoint(run_dir: str | Path, step: int, shards: dict[str, Any],
                            state: dict[str, Any] | None, keep_last: int) -> Path:
    """Write a sharded checkpoint for ``step``, then prune all but the newest ``keep_last``.

    COLLECTIVE: every rank calls it with its own ``shards`` (``{"model": ...,
    "optimizer": ...}`` of DTensors, as ``get_state_dict`` returns them); ``state`` (the
    rest of the training state) is used on rank 0 only.

    Example:
        >>> save_sharded_checkpoint(run_dir, 100, strategy.state_dict(model, opt),
        ...                         {"step": 100, ...}, keep_last=3)  # doctest: +SKIP

    Raises:
        OSError: on every rank, when any rank's write failed. Nothing is left under the
            checkpoint's name and the older checkpoints are untouched.
    """
    dcp = _dcp()
    rank = _rank()
    path = sharded_checkpoint_path(run_dir, step)
    staging = path.with_name(f".{path.name}.tmp-sharded")
    error: str | None = None
    if rank == 0:
        try:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        except OSError as e:
            error = str(e)
    _raise_if(broadcast_object(error))  # COLLECTIVE: the folder exists for everyone
    digests: dict[str, str] = {}
    try:
        with warnings.catch_warnings():  # without a process group: one process, as meant
            warnings.filterwarnings("ignore", ".*single process.*")
            dcp.save(shards, checkpoint_id=str(staging))  # COLLECTIVE: each rank its shards
        # Each rank hashes what it wrote (in parallel); rank 0 hashes the rest.
        digests = {p.name: _sha256(p) for p in staging.glob(f"__{rank}_*")}
    except (OSError, dcp.api.CheckpointException) as e:
        # DCP reports a failed write on any rank to all ranks.
        error = f"{type(e).__name__}: {e}"
    reports = gather_objects((error, digests))  # COLLECTIVE: a few bytes per rank
    error = next((e for e, _ in reports if e), None)
    if rank == 0 and error is None:
        try:
            _finish_sharded(path, staging, state or {}, {k: v for _, d in reports
                                                          for k, v in d.items()})
            prune(run_dir, keep_last)
        except (OSError, RuntimeError) as e:  # torch.save: a failed write is a RuntimeError
            error = str(e)
    error = broadcast_object(error)  # COLLECTIVE: everyone learns how it ended
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
        torch.save({"format": FORMAT_VERSION, "sharded": True, **state}, out)
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
    if path.exists():  # the same step written again (a run restarted before this step)
        shutil.rmtree(path)
    os.replace(staging, path)
    fsync_dir(path.parent)


def _verify_sharded(path: Path) -> None:
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
    """A sharded checkpoint's training state (step, scheduler, sampler, RNG, config)."""
    try:
        return torch.load(Path(path) / TRAINER_STATE, map_location="cpu", weights_only=False)
    except (OSError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint {str(path)!r}: {TRAINER_STATE} cannot be read "
                              f"({e}). Resume from an earlier checkpoint.") from e


def read_full_model(path: str | Path) -> dict[str, torch.Tensor]:
    """The whole model state dict of a sharded checkpoint, in this process, on the CPU
    (no process group needed): for serving, exporting or comparing weights.

    Example:
        >>> weights = read_full_model("runs/gpt/checkpoints/step-0001000")  # doctest: +SKIP
    """
    dcp = _dcp()
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

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
                      optimizer: torch.optim.Optimizer) -> None:
    """Load a sharded checkpoint's model and optimizer state into ``model`` (plain, DDP or
    FSDP) and ``optimizer``, resharding to this run's world size.

    COLLECTIVE when a process group exists: every rank reads the parts of the saved
    shards that make up its own.

    Raises:
        RuntimeError: the checkpoint does not fit the model or optimizer.
    """
    dcp = _dcp()
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if hasattr(optimizer, "consolidate_state_dict"):  # ZeroRedundancyOptimizer
        raise RuntimeError("a sharded checkpoint loads into fsdp, ddp or single runs, not "
                           "zero1; resume with one of those strategies")
    # Tensors of the right shapes and shardings for this run, filled in place by DCP
    # (the optimizer's state is created first if it has taken no step yet).
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optimizer": osd}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", ".*single process.*")
            dcp.load(state, checkpoint_id=str(path))
    except dcp.api.CheckpointException as e:  # a BaseException: make it an error
        raise RuntimeError(str(e)) from None
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])


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
