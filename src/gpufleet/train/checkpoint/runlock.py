"""One run per run directory: a lock held for the life of the run.

The launcher of each node (or rank 0, for a run started without gpufleet's launcher)
takes an OS lock, ``fcntl.flock`` on ``<run_dir>/run.lock``, and writes who holds it
(host, pid, since when, run id) to ``<run_dir>/run.lock.json``. A second run that wants
the same directory is refused with that record. Processes of the *same* run share the
lock: they carry the same run id (the launcher's, passed to its ranks and restarts in
``GPUFLEET_RUN_ID``; the rendezvous id on every node of a multi-node run, whose nodes
share the run directory over a shared file system).

The kernel releases a flock when its process dies, however it dies (``kill -9``
included): a record whose holder is gone is taken over, saying so. On a file system
without flock support the record alone is checked, with a warning.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from gpufleet.errors import ConfigError

log = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
RECORD_FILE = "run.lock.json"
RUN_ID_ENV = "GPUFLEET_RUN_ID"
_RECORD_WAIT_S = 5.0  # how long a held lock's record may take to appear


class RunDirInUse(ConfigError):
    """Another run holds the run directory."""


_OWN_RUN_ID = uuid.uuid4().hex  # a process started alone is a run of its own


def run_id() -> str:
    """This process's run id: the launcher's (inherited), torchrun's, or its own. The
    launcher puts its id in the environment of the ranks it starts (not of itself for
    longer than the launch: later runs of the same Python process are other runs)."""
    return (os.environ.get(RUN_ID_ENV) or os.environ.get("TORCHELASTIC_RUN_ID")
            or _OWN_RUN_ID)


@dataclass
class RunLock:
    """A held run-directory lock; :meth:`release` (or the end of the process) frees it."""

    run_dir: Path
    fd: int | None  # the flock's file; None where the file system has no flock

    def release(self) -> None:
        """Remove the record and free the lock (a clean end leaves nothing to take over)."""
        if self.fd is None and not (self.run_dir / RECORD_FILE).exists():
            return
        record = _read_record(self.run_dir)
        if record.get("pid") == os.getpid() and record.get("host") == socket.gethostname():
            (self.run_dir / RECORD_FILE).unlink(missing_ok=True)
        if self.fd is not None:
            os.close(self.fd)  # closing the file releases the flock
            self.fd = None


def remove_lock_file(run_dir: str | Path) -> None:
    """Remove the (released) lock file of a run directory that holds nothing else, so a
    launch whose ranks never met leaves no folder behind."""
    run_dir = Path(run_dir)
    held = {p.name for p in run_dir.iterdir() if not (p.is_dir() and not any(p.iterdir()))}
    if held <= {LOCK_FILE, RECORD_FILE}:  # empty folders (procs/) go with the directory
        (run_dir / LOCK_FILE).unlink(missing_ok=True)


def acquire(run_dir: str | Path, run: str | None = None) -> RunLock | None:
    """Take the lock of ``run_dir`` for run ``run`` (default: :func:`run_id`).

    Returns:
        The held lock, or None when another process of the same run holds it (a node's
        launcher above this rank, or another node of a multi-node run).

    Raises:
        RunDirInUse: a different run holds it; the message names the holder.
    """
    import fcntl

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    run = run or run_id()
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    held_fd: int | None = fd  # None where the file system has no flock
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        held = e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
        record = _holder_record(run_dir, run) if held else _read_record(run_dir)
        if held:
            if record.get("run_id") == run:
                return None  # the same run: its launcher or another of its nodes
            raise RunDirInUse(_in_use(run_dir, record)) from None
        log.warning("run directory %s: this file system cannot lock files (%s); only the "
                    "lock record is checked", run_dir, e)
        if record and record.get("run_id") != run and _alive(record):
            raise RunDirInUse(_in_use(run_dir, record)) from None
        held_fd = None
    previous = _read_record(run_dir)
    if previous and previous.get("run_id") != run:
        log.warning("run directory %s: taking over the lock of %s, which no longer holds "
                    "it (that process has ended)", run_dir, _holder(previous))
    _write_record(run_dir, run)
    return RunLock(run_dir, held_fd)


def _in_use(run_dir: Path, record: dict[str, Any]) -> str:
    return (f"run directory {str(run_dir)!r} is in use by another run: {_holder(record)}. "
            "Two runs in one directory would mix their checkpoints and metrics. Wait for "
            f"that run to end (or stop it: gpufleet cleanup {run_dir}), or train into "
            "another --run-dir.")


def _holder(record: dict[str, Any]) -> str:
    if not record:
        return "a process that left no record (see run.lock.json)"
    return (f"pid {record.get('pid')} on host {record.get('host')}, since "
            f"{record.get('since')} (run id {record.get('run_id')})")


def _alive(record: dict[str, Any]) -> bool:
    """Whether the recorded holder still runs (unknowable on another host: assume so)."""
    if record.get("host") != socket.gethostname():
        return True
    try:
        os.kill(int(record["pid"]), 0)
    except (ProcessLookupError, ValueError, KeyError, TypeError):
        return False
    except PermissionError:
        return True
    return True


def _holder_record(run_dir: Path, run: str) -> dict[str, Any]:
    """The record of the process holding the lock. It writes it right after taking the
    lock: until then the file is missing or names an ended holder, so another node of
    the same run starting at the same moment waits for it rather than refuse."""
    deadline = time.monotonic() + _RECORD_WAIT_S
    while True:
        record = _read_record(run_dir)
        if (record and (record.get("run_id") == run or _alive(record))) \
                or time.monotonic() >= deadline:
            return record
        time.sleep(0.02)


def _read_record(run_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads((run_dir / RECORD_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_record(run_dir: Path, run: str) -> None:
    record = {"host": socket.gethostname(), "pid": os.getpid(),
              "since": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "run_id": run}
    tmp = run_dir / f".{RECORD_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, run_dir / RECORD_FILE)  # readers never see half a record
