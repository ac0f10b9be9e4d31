"""What a rank that dies by a signal leaves: its Python stacks and its last collectives.

A rank that gloo aborts (SIGABRT on a collective mismatch), or that crashes in native
code (SIGSEGV, SIGBUS, SIGFPE), runs no Python after the signal: no exception, no crash
report. Two things survive it, both set up when training starts on a rank with peers:

- ``faulthandler`` writes every thread's Python stack from its signal handler into
  ``<run_dir>/crash/fatal-rank-R.txt`` (opened at the start; the handler only writes);
- the ring of its last collectives is kept in ``<run_dir>/crash/ring-rank-R.bin``
  (:meth:`gpufleet.core.ring.CollectiveRing.attach`), written before each collective is
  entered.

Under gpufleet's launcher (:data:`FORENSICS_ENV` names a folder the launcher made),
each rank also links its crash folder there, so the launcher, which does not know the
run directory, finds them when a rank fails (:func:`rank_folders`). Both files are
removed when the rank ends well.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
from pathlib import Path
from typing import IO

from gpufleet.core.ring import RING

log = logging.getLogger(__name__)

#: The folder (made by the launcher) where each rank links its crash folder.
FORENSICS_ENV = "GPUFLEET_FORENSICS_DIR"


def fatal_file(run_dir: str | Path, rank: int) -> Path:
    """Where rank ``rank`` writes its stacks on a fatal signal."""
    return Path(run_dir) / "crash" / f"fatal-rank-{rank}.txt"


def ring_file(run_dir: str | Path, rank: int) -> Path:
    """Where rank ``rank`` keeps its ring of last collectives."""
    return Path(run_dir) / "crash" / f"ring-rank-{rank}.bin"


def rank_folders(forensics_dir: str | Path) -> list[Path]:
    """The crash folders the ranks linked into ``forensics_dir`` (one per rank)."""
    folder = Path(forensics_dir)
    return sorted({p.resolve() for p in folder.glob("rank-*") if p.is_dir()})


class FatalDump:
    """This rank's stacks on a fatal signal and its ring in a file (see the module docs).

    Args:
        run_dir: the run directory (the files go to its ``crash/``).
        rank: this rank.
    """

    def __init__(self, run_dir: str | Path, rank: int) -> None:
        self.rank = rank
        self.path, self.ring_path = fatal_file(run_dir, rank), ring_file(run_dir, rank)
        self._file: IO[str] | None = None
        self._had_faulthandler = False

    def start(self) -> bool:
        """Enable both; False where the crash folder cannot be written."""
        if self._file is not None:
            return True
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            RING.attach(self.ring_path, self.rank)
            self._file = open(self.path, "w")  # held open: the handler writes to it
        except OSError as e:
            log.debug("no fatal-signal forensics: %s", e)
            RING.detach()
            return False
        self._had_faulthandler = faulthandler.is_enabled()
        # SIGSEGV, SIGFPE, SIGABRT, SIGBUS, SIGILL: every thread's stack, then the
        # signal's default action (the process still dies by it).
        faulthandler.enable(file=self._file, all_threads=True)
        self._link()
        return True

    def stop(self) -> None:
        """The rank ended well: disable, and remove both files (and an empty folder).
        A script ending on an uncaught exception (``sys.last_value``: your own loop's
        end at exit) did not end well: the files stay."""
        if self._file is None or getattr(sys, "last_value", None) is not None:
            return
        faulthandler.disable()
        if self._had_faulthandler:  # as it was (to stderr: pytest's, -X faulthandler)
            faulthandler.enable(file=sys.stderr, all_threads=True)
        self._file.close()
        self._file = None
        RING.detach()
        for path in (self.path, self.ring_path):
            path.unlink(missing_ok=True)
        try:
            self.path.parent.rmdir()  # only when empty: a crash report stays
        except OSError:
            pass

    def _link(self) -> None:
        folder = os.environ.get(FORENSICS_ENV)
        if not folder:
            return
        link = Path(folder) / f"rank-{self.rank}"
        try:
            link.unlink(missing_ok=True)
            link.symlink_to(self.path.parent.resolve(), target_is_directory=True)
        except OSError as e:
            log.debug("could not link %s to %s: %s", link, self.path.parent, e)
