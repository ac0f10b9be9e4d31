"""``gpufleet checkpoint migrate PATH``: convert a checkpoint written before format 2.

gpufleet loads checkpoints with ``torch.load(weights_only=True)`` only. Files written by
earlier versions (format 1) kept numpy's RNG state as a numpy array, which that loader
refuses. This command loads such a file the old, unrestricted way (it can run code from
the file: run it only on files you trust, e.g. ones you wrote yourself), turns the numpy
arrays into tensors, checks that the result loads with ``weights_only=True`` and writes it
back in place, atomically, with a new checksum. A sharded checkpoint directory has its
``trainer.pt`` converted and its manifest updated.

Imports only the standard library at the top; torch loads inside ``run``.
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path
from typing import Any

EPILOG = """\
Run it only on a checkpoint you trust: reading an old-format file runs whatever the file
asks for. Files written by gpufleet since format 2 need no migration.

examples:
  gpufleet checkpoint migrate runs/gpt-stdlib-20260101-120000/checkpoints/step-0000100.pt
  gpufleet checkpoint migrate runs/gpt-stdlib-20260101-120000/checkpoints/step-0000100/
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``gpufleet checkpoint migrate`` to the CLI's subparsers.

    Example:
        >>> parser = argparse.ArgumentParser(prog="gpufleet")
        >>> add_parser(parser.add_subparsers(dest="command"))
        >>> parser.parse_args(["checkpoint", "migrate", "step-1.pt"]).path
        'step-1.pt'
    """
    p = sub.add_parser("checkpoint", help="checkpoint tools (migrate an old-format file)",
                       description="Checkpoint tools.")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    m = actions.add_parser(
        "migrate", help="convert a checkpoint written before format 2 (trusted files only)",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description="Convert a checkpoint written by an earlier gpufleet so that it loads "
                    "with torch.load(weights_only=True). The file is rewritten in place.")
    m.add_argument("path", metavar="PATH", help="a step-N.pt file or a sharded step-N/ folder")


def run(args: argparse.Namespace) -> int:
    """Migrate ``args.path`` and say what was done."""
    path = Path(args.path)
    changed = migrate(path)
    if changed:
        print(f"migrated {path}: it now loads with torch.load(weights_only=True)")
    else:
        print(f"{path} loads with torch.load(weights_only=True) already: nothing to do")
    return 0


def migrate(path: Path) -> bool:
    """Rewrite the checkpoint at ``path`` in the current format; False if it was already.

    Raises:
        CheckpointError: no such checkpoint, or it holds objects other than gpufleet's
            own old RNG state (then it is left untouched).
    """
    from gpufleet.errors import CheckpointError
    from gpufleet.train.checkpoint.format import TRAINER_STATE, safe_load

    file = path / TRAINER_STATE if path.is_dir() else path
    if not file.is_file():
        raise CheckpointError(f"{str(path)!r} is not a checkpoint file (step-N.pt) or a "
                              "sharded checkpoint folder (step-N/ with trainer.pt).")
    try:
        safe_load(file, shown=path, mmap=True)
        return False
    except CheckpointError:
        pass
    state = _convert(_unsafe_load(file, path))
    if path.is_dir():
        _replace_in_sharded(path, file, state)
    else:
        from gpufleet.train.checkpoint.format import write_checkpoint_file

        write_checkpoint_file(file, state)
    return True


def _unsafe_load(file: Path, shown: Path) -> dict[str, Any]:
    import torch

    from gpufleet.errors import CheckpointError

    try:
        state = torch.load(file, map_location="cpu", weights_only=False)  # trusted: see doc
    except Exception as e:
        raise CheckpointError(f"{str(shown)!r} cannot be read ({type(e).__name__}: {e}); "
                              "it is damaged or not a checkpoint.") from None
    if not isinstance(state, dict) or "format" not in state:
        raise CheckpointError(f"{str(shown)!r} is not a gpufleet checkpoint; nothing done.")
    return state


def _convert(state: dict[str, Any]) -> dict[str, Any]:
    """numpy arrays in the RNG states become tensors; then the result must load safely."""
    import numpy as np
    import torch

    from gpufleet.errors import CheckpointError
    from gpufleet.train.checkpoint.format import FORMAT_VERSION

    for rng in state.get("rng") or []:
        name, keys, *rest = rng["numpy"]
        if isinstance(keys, np.ndarray):
            rng["numpy"] = [name, torch.from_numpy(keys.astype(np.int64)),
                            *(x.item() if isinstance(x, np.generic) else x for x in rest)]
    state["format"] = FORMAT_VERSION
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except Exception as e:
        raise CheckpointError(f"the checkpoint holds objects other than gpufleet's own "
                              f"({str(e).splitlines()[-1][:200]}); it is not a file gpufleet "
                              "wrote, so it was left untouched.") from None
    return state


def _replace_in_sharded(folder: Path, file: Path, state: dict[str, Any]) -> None:
    """Write the new trainer.pt and its line of the manifest, each atomically."""
    import os

    import torch

    from gpufleet.files import fsync_dir
    from gpufleet.train.checkpoint.format import MANIFEST, _HashingWriter

    tmp = file.with_name(f".{file.name}.tmp-migrate")
    with open(tmp, "wb") as f:
        out = _HashingWriter(f)
        torch.save(state, out.file)
        f.flush()
        os.fsync(f.fileno())
    lines = (folder / MANIFEST).read_text().splitlines()
    lines = [f"{out.sha256.hexdigest()}  {file.name}" if line.split(maxsplit=1)[-1] == file.name
             else line for line in lines]
    manifest_tmp = folder / f".{MANIFEST}.tmp-migrate"
    manifest_tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, file)
    os.replace(manifest_tmp, folder / MANIFEST)
    fsync_dir(folder)
