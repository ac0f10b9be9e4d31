"""``gpufleet run script.py --nproc N``: start N ranks of your own script.

gpufleet's options (``--nproc``, ``--max-restarts``, ``--launcher``, and for several
nodes ``--nnodes``, ``--node-rank``, ``--master-addr``, ``--master-port``,
``--rdzv-endpoint``, ``--rdzv-id``, ``--rdzv-backend``, as ``gpufleet train`` takes
them) go before SCRIPT,
or right after it as the docs write them (``gpufleet run train.py --nproc 2 -- --lr
0.1``): then they end at ``--`` or at the first argument that is not one of them, and
the rest is the script's. Each rank runs ``python script.py ARGS`` with the variables
torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...), started by torch's
elastic agent through :func:`gpufleet.launch.launch`, as ``gpufleet train`` starts its
ranks (restarts with ``--max-restarts``); ``--launcher spawn`` runs the script in each
process that ``torch.multiprocessing`` starts. A :class:`~gpufleet.fleet.Fleet` made in
the script finds its rank there. The standard library and the config's flags (which
``gpufleet train`` reads too) only at the top: building the CLI's parser stays fast.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from collections.abc import Callable
from typing import Any

from gpufleet.config.flags import SHORTCUTS


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``gpufleet run`` to the CLI's subparsers.

    Example:
        >>> parser = argparse.ArgumentParser(prog="gpufleet")
        >>> add_parser(parser.add_subparsers(dest="command"))
        >>> args = parser.parse_args(["run", "--nproc", "2", "train.py", "--lr", "0.1"])
        >>> args.nproc, args.script, args.script_args
        (2, 'train.py', ['--lr', '0.1'])
    """
    p = sub.add_parser(
        "run", help="run your own training script on N local ranks (like torchrun)",
        description="Run SCRIPT on N ranks of this node, started by torch's elastic agent "
                    "(the machinery behind torchrun). A gpufleet.Fleet in the script "
                    "finds its rank; so does plain torch.distributed code.")
    _add_options(p)
    p.add_argument("script", metavar="SCRIPT", help="your Python script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                   help="arguments for the script (after gpufleet's options and `--` "
                        "when those follow SCRIPT)")


# The options across nodes, as gpufleet train takes them (its help texts): the name
# and the type of each.
_NODES = {"--nnodes": str, "--node-rank": int, "--master-addr": str, "--master-port": int,
          "--rdzv-endpoint": str, "--rdzv-id": str, "--rdzv-backend": str}


def _add_options(p: argparse.ArgumentParser) -> None:
    """gpufleet's own options (None when not given: see :func:`_options_after_script`)."""
    p.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="ranks on this node (default: one per visible GPU, 1 on a CPU)")
    p.add_argument("--max-restarts", type=int, default=None, metavar="K",
                   help="restart every rank up to K times after a rank fails")
    p.add_argument("--launcher", default=None, choices=("elastic", "spawn"),
                   help="torch's elastic agent (default) or torch.multiprocessing")
    for flag, kind in _NODES.items():
        p.add_argument(flag, type=kind, default=None, help=SHORTCUTS[flag][1])


_OWN = ("--nproc", "--max-restarts", "--launcher", *_NODES)
_DESTS = tuple(flag[2:].replace("-", "_") for flag in _OWN)


def _options_after_script(args: argparse.Namespace) -> None:
    """Take gpufleet's options written right after SCRIPT out of the script's arguments
    (``gpufleet run train.py --nproc 2 --max-restarts 1 -- --lr 0.1``): those up to a
    ``--`` (dropped) or to the first argument that is not one of them. When an option
    came before SCRIPT, every argument after it is the script's, as before.

    Example:
        >>> ns = argparse.Namespace(nproc=None, max_restarts=None, launcher=None,
        ...                         script_args=["--nproc=2", "--", "--lr", "0.1"])
        >>> _options_after_script(ns)
        >>> ns.nproc, ns.script_args
        (2, ['--lr', '0.1'])
    """
    if any(getattr(args, k, None) is not None for k in _DESTS):
        return
    argv, end = list(args.script_args), 0
    while end < len(argv) and argv[end].split("=", 1)[0] in _OWN:
        end += 1 if "=" in argv[end] else 2
    own, rest = argv[:end], argv[end:]
    if own and rest[:1] == ["--"]:
        rest = rest[1:]
    if own:
        parser = argparse.ArgumentParser(prog="gpufleet run SCRIPT", allow_abbrev=False)
        _add_options(parser)
        vars(args).update({k: v for k, v in vars(parser.parse_args(own)).items()
                           if v is not None})
        args.script_args = rest


def run(args: argparse.Namespace) -> int:
    """Start the ranks and wait for them; returns the exit code (0: every rank ended
    well)."""
    from gpufleet.errors import LaunchError
    from gpufleet.launch import launch

    script = os.path.abspath(args.script)
    if not os.path.isfile(script):
        raise LaunchError(f"script {args.script!r} does not exist. Pass the path of a "
                          "Python file: gpufleet run train.py --nproc 2.")
    _options_after_script(args)
    nproc = args.nproc or _visible_gpus() or 1
    launcher = args.launcher or "elastic"
    if launcher == "elastic":
        # As torchrun does: the agent starts ``python SCRIPT ARGS`` per rank (a command,
        # which torch's elastic_launch takes besides a function), so a rank imports only
        # what the script imports.
        entry: str | Callable[..., Any] = sys.executable
        entry_args: tuple[Any, ...] = (script, *args.script_args)
    else:  # torch.multiprocessing runs a function in each rank
        entry, entry_args = run_script, (script, list(args.script_args))
    given = {k: getattr(args, k) for k in _DESTS[3:] if getattr(args, k, None) is not None}
    launch(entry, entry_args, nproc=nproc, launcher=launcher,
           max_restarts=args.max_restarts or 0, **given)
    return 0


def _visible_gpus() -> int:
    import torch  # deferred: the parser is built without it

    return torch.cuda.device_count()


def run_script(path: str, argv: list[str]) -> Any:
    """What each rank runs: ``path`` as ``__main__`` with ``argv`` (a script that exits
    with status 0 ended well)."""
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(path))
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    return None
