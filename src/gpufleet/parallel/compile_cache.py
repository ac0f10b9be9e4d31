"""torch.compile's caches kept with the run, so a restarted or recovered rank starts warm.

Inductor keeps what it compiled (the FX-graph cache of generated kernels, the
AOT-autograd cache of forward/backward graphs, Triton's binaries on CUDA) under
``TORCHINDUCTOR_CACHE_DIR``, by default in the machine's temporary directory, which a
job on a fresh node or container does not have. With ``perf.compile`` on, every rank
points it at ``RUN_DIR/compile-cache/<host>/`` before its first compile: a rank the
agent restarts, a node that rejoins on the same host, or a run resumed later reads the
graphs its predecessor compiled instead of compiling them again. The ranks of one host
share one folder (inductor writes each entry under a temporary name and renames it, so
concurrent writers are safe); hosts get their own, since the C++ and Triton code is
built for the host's CPU and GPUs. A cache folder of your own (``TORCHINDUCTOR_CACHE_DIR``
set before the run) is left as it is.
"""

from __future__ import annotations

import getpass
import logging
import os
import socket
from pathlib import Path

log = logging.getLogger(__name__)

CACHE_DIR = "compile-cache"
_OURS: set[str] = set()  # folders this process pointed inductor at (earlier runs' too)


def keep_compile_cache(run_dir: str | Path, compile_on: bool) -> Path | None:
    """Point inductor's (and Triton's) caches at the run's folder for this host.

    Call it before the first compile (torch reads the variables when it compiles).

    Args:
        run_dir: the run directory.
        compile_on: ``perf.compile``; nothing is changed when it is off.

    Returns:
        The folder, or None when compile is off or the caller chose a cache folder.

    Example:
        >>> keep_compile_cache("runs/x", compile_on=False) is None
        True
    """
    if not compile_on:
        return None
    own = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if own and own not in _OURS and Path(own).name != f"torchinductor_{_user()}":
        log.info("torch.compile caches stay in TORCHINDUCTOR_CACHE_DIR=%s (yours)", own)
        return None
    folder = (Path(run_dir) / CACHE_DIR / socket.gethostname()).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    # On by default in recent torch; set for the versions where they are not.
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    triton = os.environ.get("TRITON_CACHE_DIR")
    if triton is None or str(Path(triton).parent) in _OURS:
        os.environ["TRITON_CACHE_DIR"] = str(folder / "triton")
    _OURS.add(str(folder))
    log.info("torch.compile caches kept in %s: a restarted rank reads them", folder)
    return folder


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError, ModuleNotFoundError):
        return f"uid_{os.getuid()}"
