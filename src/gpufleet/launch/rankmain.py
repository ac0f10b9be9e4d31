"""A rank started as its own light process: ``python -m gpufleet.launch.rankmain PAYLOAD``.

torch's elastic agent runs a *function* in each rank through ``multiprocessing``: every
rank then imports the agent's machinery to unpickle its wrapper, waits for the agent to
read its result from a queue, and ends with a full interpreter shutdown. Started as a
command instead (as torchrun starts a script), a rank imports only what the function
and its arguments need, and hands its result back through a file.

The launching process writes the payload (:func:`write_payload`): what the new process
needs to import what it is sent (the launcher's ``sys.path``, working directory,
``sys.argv`` and, as ``multiprocessing`` does, its main script, so that objects defined
there unpickle), then the function and its arguments. Each rank runs the function under
torch's ``record`` (a traceback lands in the agent's error file, as before), writes
``result-<RANK>.pkl`` next to the payload (:func:`read_results` collects them; an empty
``started-<RANK>`` there says it began), and ends
without tearing down every module: waiting threads are joined, ``atexit`` handlers and
logging flushed, then the process exits.

The standard library only at the top: the function's own imports come with it.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

PAYLOAD = "payload.pkl"
#: Set (to "1") in a rank whose node's agent started ranks before in this launch: a
#: restart, also one the agent made because a node joined (which leaves
#: TORCHELASTIC_RESTART_COUNT as it was).
RESTARTED = "GPUFLEET_RANKS_RESTARTED"
#: The command a rank runs, before the payload's path.
COMMAND = ("-m", "gpufleet.launch.rankmain")


def write_payload(directory: Path, fn: Callable[..., Any], args: tuple) -> Path:
    """Write what every rank runs (``fn(*args)``) into ``directory``; returns its path.

    Raises:
        pickle.PicklingError, TypeError, AttributeError: ``args`` cannot be pickled.
    """
    path = directory / PAYLOAD
    with path.open("wb") as f:
        pickle.dump(_preparation(), f, protocol=pickle.HIGHEST_PROTOCOL)
        pickle.dump((fn, args), f, protocol=pickle.HIGHEST_PROTOCOL)
    return path


def read_results(directory: Path) -> dict[int, Any]:
    """``{global rank: result}`` of the ranks that ran the payload in ``directory``."""
    results = {}
    for path in directory.glob("result-*.pkl"):
        with path.open("rb") as f:
            results[int(path.stem.rpartition("-")[2])] = pickle.load(f)
    return results


def _preparation() -> dict[str, Any]:
    """What a new process needs to import what the launching one pickles (the subset of
    ``multiprocessing.spawn.get_preparation_data`` that concerns imports)."""
    from multiprocessing import process

    origin = process.ORIGINAL_DIR
    data: dict[str, Any] = {
        "sys_path": [origin if p == "" else p for p in sys.path],
        "sys_argv": list(sys.argv), "dir": os.getcwd(), "orig_dir": origin}
    main = sys.modules.get("__main__")
    if main is None or _is_gpufleet_command(main):
        return data  # `gpufleet ...` itself: nothing sent is defined in its script
    name = getattr(getattr(main, "__spec__", None), "name", None)
    path = getattr(main, "__file__", None)
    if name is not None:
        data["init_main_from_name"] = name  # `python -m pkg.mod`
    elif path is not None:
        data["init_main_from_path"] = os.path.normpath(os.path.join(origin or "", path))
    return data


def _is_gpufleet_command(main: Any) -> bool:
    """The ``gpufleet`` console script (``from gpufleet.cli import main``)."""
    return getattr(getattr(main, "main", None), "__module__", None) == "gpufleet.cli"


def main(argv: list[str]) -> None:
    """Run the payload at ``argv[0]`` as this rank, write the result, and leave."""
    from multiprocessing import spawn

    payload = Path(argv[0])
    rank = int(os.environ.get("RANK", "0"))
    # The agents met and started this rank: the launcher tells a store lost mid-run
    # from agents that never met by these marks, and a rank that finds one is a restart.
    if any(payload.parent.glob("started-*")):
        os.environ[RESTARTED] = "1"
    (payload.parent / f"started-{rank}").touch()
    # Where this node's agent leaves word of a node joining (gpufleet.launch.grow).
    os.environ["GPUFLEET_RANKS_DIR"] = str(payload.parent)
    with payload.open("rb") as f:
        spawn.prepare(pickle.load(f))  # sys.path, cwd, argv, the main script
        fn, args = pickle.load(f)
    from torch.distributed.elastic.multiprocessing.errors import record

    try:
        result = record(fn)(*args)  # an exception: its traceback to the error file
    except Exception:
        if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
            raise  # no agent to tell it: the traceback goes to stderr
        leave(1)  # the launcher says it once, from the error file
    final = payload.parent / f"result-{rank}.pkl"
    partial = final.with_suffix(".partial")
    with partial.open("wb") as f:
        pickle.dump(result, f, protocol=pickle.HIGHEST_PROTOCOL)
    partial.replace(final)
    leave(0)


def restarts(restart_count: int) -> int:
    """The agent's restart count, or 1 when it is 0 and this node's agent started ranks
    before (it restarted them because a node joined: torch counts only failures)."""
    return restart_count or int(os.environ.get(RESTARTED) == "1")


def leave(code: int) -> None:
    """End this process as the interpreter would, minus the module teardown and the
    last full garbage collection (seconds, with torch loaded, that nobody waits for):
    threads that are not daemons are joined, ``atexit`` handlers run, logs and the
    console flushed."""
    # What the interpreter does first at exit: tell thread pools to stop (their
    # callbacks), then join every thread that is not a daemon.
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None and threading.current_thread() is threading.main_thread():
        shutdown()
    import atexit

    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
