"""A rank's Python stacks, written on a signal even when none of its Python runs.

On a stall the watchdog thread of each rank writes that rank's stacks. A rank stuck in
native code that holds the interpreter lock (a C extension call that never lets go) runs
no Python thread at all: no stacks from its watchdog, no heartbeat. ``faulthandler``'s
signal handler is native code: registered when the rank starts, :data:`SIGNAL` makes the
process write every thread's Python stack to ``<run_dir>/hangs/signal-stacks-rank-<R>.txt``
whatever it is doing. Rank 0 sends it to a silent rank on its own node before it reports
that rank (``gpufleet.fault.watchdog``).

SIGUSR1 is preemption's (``gpufleet.fault.preempt``); SIGUSR2 is used here, unless the
program handles SIGUSR2 itself (then nothing is registered). An empty file is removed
when the rank ends.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import socket
import time
from pathlib import Path
from typing import IO, Any

log = logging.getLogger(__name__)

#: The signal that makes a rank write its stacks.
SIGNAL = signal.SIGUSR2


def stacks_file(run_dir: str | Path, rank: int) -> Path:
    """Where rank ``rank`` writes its stacks on :data:`SIGNAL`."""
    return Path(run_dir) / "hangs" / f"signal-stacks-rank-{rank}.txt"


class SignalStacks:
    """This rank's stacks on :data:`SIGNAL` (see the module docs).

    Args:
        run_dir: the run directory (the file goes to its ``hangs/``).
        rank: this rank.
    """

    def __init__(self, run_dir: str | Path, rank: int) -> None:
        self.path = stacks_file(run_dir, rank)
        self._file: IO[str] | None = None

    def start(self) -> bool:
        """Register the handler; False where it cannot be (the program handles the
        signal itself, or the file cannot be opened)."""
        if signal.getsignal(SIGNAL) not in (signal.SIG_DFL, None):
            log.debug("%s is handled by the program: no stacks on it", SIGNAL.name)
            return False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "w")  # held open: the handler writes to it
            faulthandler.register(SIGNAL, file=self._file, all_threads=True)
        except (OSError, RuntimeError, ValueError) as e:
            log.debug("stacks on %s not available: %s", SIGNAL.name, e)
            self._close()
            return False
        return True

    def stop(self) -> None:
        """Unregister; remove the file (and an empty ``hangs/``) if nothing was written."""
        if self._file is None:
            return
        faulthandler.unregister(SIGNAL)
        self._close()
        try:
            if self.path.stat().st_size == 0:
                self.path.unlink()
                self.path.parent.rmdir()  # only when empty: a hang's folders stay
        except OSError:
            pass

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def request(pid: int) -> bool:
    """Ask process ``pid`` (a rank on this node) to write its stacks; False if it is
    gone or not ours to signal."""
    try:
        os.kill(pid, SIGNAL)
    except OSError as e:
        log.debug("could not ask pid %d for its stacks: %s", pid, e)
        return False
    return True


def ask_silent(run_dir: str | Path, silent: dict[int, dict[str, Any] | None],
               wait_s: float = 2.0) -> str:
    """Ask the silent ranks on this node whose process runs (not stopped, not dead) for
    their stacks, and wait up to ``wait_s`` for them; returns the report's lines naming
    the files written ("" when none was)."""
    asked = {}
    for r, beat in silent.items():
        path = stacks_file(run_dir, r)
        # Only a rank that registered the handler (its file exists): to any other
        # process the signal's default action would be to end it.
        if beat and beat.get("host") == socket.gethostname() and path.is_file() and \
                beat.get("proc_state") not in ("T", "t", "Z", "X", "", None) and \
                request(int(beat["pid"])):
            asked[r] = path
    deadline = time.monotonic() + wait_s
    while asked and time.monotonic() < deadline and \
            not all(p.stat().st_size for p in asked.values()):
        time.sleep(0.1)
    return "".join(f"\nrank {r}'s Python stacks, written on a signal (its own threads did "
                   f"not answer): {p}" for r, p in asked.items() if p.stat().st_size)
