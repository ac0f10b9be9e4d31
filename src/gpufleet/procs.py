"""The processes of a run, recorded by pid, and ``gpufleet cleanup RUN_DIR`` to end them.

Each process of a run (the launcher, every rank) calls :func:`record_process` when it
starts, which writes ``<run_dir>/procs/<host>-<pid>.json`` with its pid, role, rank, host,
command line and the kernel's start time of the process. A process that ends normally
removes its record with :func:`forget_process`; records left behind belong to a run that
crashed, hung or was killed.

:func:`cleanup_run` ends what is left, on this host, by those recorded pids and never by
matching process names, so it cannot touch another user's or another run's job:

* a pid that no longer exists is reported as gone and its record removed;
* a pid whose start time differs from the recorded one belongs to a new process that
  reused the number: it is left alone, and said so;
* otherwise the process and all its children (data-loader workers, the agent's ranks)
  are first suspended, so that no agent restarts a rank while the others end, then sent
  SIGTERM and resumed; whatever still runs after ``grace_s`` seconds gets SIGKILL;
* records of other hosts are listed and left alone (run cleanup on those hosts).

Example:
    >>> import tempfile
    >>> run_dir = tempfile.mkdtemp()
    >>> path = record_process(run_dir, "launcher")
    >>> [r.role for r in list_records(run_dir)]
    ['launcher']
    >>> forget_process(run_dir)
    True
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from gpufleet.errors import ConfigError, unknown_choice

log = logging.getLogger(__name__)

ROLES = ("launcher", "rank")
RECORDS_DIR = "procs"
# Start times read back from the kernel for the same process agree to the clock tick
# (10 ms); a different process that got the same pid started at a different time.
CREATE_TIME_TOLERANCE_S = 0.05


@dataclass(frozen=True)
class ProcRecord:
    """One recorded process of a run (the JSON fields of its record file)."""

    pid: int
    role: str
    rank: int | None
    host: str
    create_time: float  # psutil's start time (s since the epoch): tells pid reuse apart
    cmdline: list[str]
    started: str  # ISO time the record was written
    path: Path = field(compare=False, default=Path())

    def describe(self) -> str:
        rank = f" {self.rank}" if self.rank is not None else ""
        return f"pid {self.pid} ({self.role}{rank} on {self.host})"


def record_process(run_dir: str | os.PathLike[str], role: str, rank: int | None = None,
                   pid: int | None = None) -> Path:
    """Record a process of the run in ``<run_dir>/procs/<host>-<pid>.json``.

    Args:
        run_dir: the run directory.
        role: ``"launcher"`` or ``"rank"``.
        rank: the global rank, for ``role="rank"``.
        pid: the process to record; this process by default.

    Returns:
        The record's path.

    Example:
        >>> import tempfile
        >>> record_process(tempfile.mkdtemp(), "rank", rank=0).suffix
        '.json'
    """
    import psutil

    if role not in ROLES:
        raise ValueError(unknown_choice("process role", role, ROLES))
    proc = psutil.Process(os.getpid() if pid is None else pid)
    with proc.oneshot():
        try:
            cmdline = proc.cmdline()
        except psutil.AccessDenied:
            cmdline = []
        fields = {"pid": proc.pid, "role": role, "rank": rank, "host": socket.gethostname(),
                  "create_time": proc.create_time(), "cmdline": cmdline,
                  "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    folder = Path(run_dir) / RECORDS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{fields['host']}-{proc.pid}.json"
    tmp = path.with_name(f".{path.name}.{threading.get_ident()}.tmp")  # unique per writer
    tmp.write_text(json.dumps(fields, indent=1))
    os.replace(tmp, path)  # a reader never sees half a record
    return path


def forget_process(run_dir: str | os.PathLike[str], pid: int | None = None) -> bool:
    """Remove this host's record of ``pid`` (this process by default) at a clean exit.

    Returns:
        True if there was a record to remove.
    """
    path = Path(run_dir) / RECORDS_DIR / f"{socket.gethostname()}-{pid or os.getpid()}.json"
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def list_records(run_dir: str | os.PathLike[str]) -> list[ProcRecord]:
    """Every process record of the run, on any host, launchers first.

    Unreadable record files are logged and skipped.
    """
    records = []
    for path in sorted((Path(run_dir) / RECORDS_DIR).glob("*.json")):
        try:
            data = json.loads(path.read_text())
            if not isinstance(data["pid"], int) or data["pid"] <= 0:
                # kill(-1) would signal every process we may signal: never act on it.
                raise ValueError(f"pid {data['pid']!r} is not a process id")
            records.append(ProcRecord(
                pid=int(data["pid"]), role=str(data["role"]), rank=data.get("rank"),
                host=str(data["host"]), create_time=float(data["create_time"]),
                cmdline=list(data.get("cmdline", [])), started=str(data.get("started", "")),
                path=path))
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("skipping unreadable process record %s: %s", path, e)
    return sorted(records, key=lambda r: (r.role != "launcher", r.rank or 0, r.pid))


@dataclass
class CleanupReport:
    """What :func:`cleanup_run` did; each list holds one line per process.

    Attributes:
        ended: ended by SIGTERM within the grace period.
        killed: still running after the grace period, ended by SIGKILL.
        gone: recorded processes that were not running any more.
        reused: recorded pids now used by another process, left alone.
        other_hosts: records of other hosts, left alone.
        failed: processes that could not be ended (permissions, or survived SIGKILL).
        planned: with ``dry_run``, what would be ended.
    """

    ended: list[str] = field(default_factory=list)
    killed: list[str] = field(default_factory=list)
    gone: list[str] = field(default_factory=list)
    reused: list[str] = field(default_factory=list)
    other_hosts: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    planned: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, list[str]]:
        return asdict(self)


def cleanup_run(run_dir: str | os.PathLike[str], grace_s: float = 5.0,
                dry_run: bool = False) -> CleanupReport:
    """End the recorded processes of ``run_dir`` on this host, and their children.

    Args:
        run_dir: the run directory whose ``procs/`` records to use.
        grace_s: seconds between SIGTERM and SIGKILL.
        dry_run: only report what would be ended.

    Example:
        >>> import tempfile
        >>> cleanup_run(tempfile.mkdtemp()).ended
        []
    """
    import psutil

    report = CleanupReport()
    host = socket.gethostname()
    targets: dict[int, tuple[psutil.Process, str]] = {}  # pid -> (process, description)
    records: dict[int, Path] = {}  # pid -> its record, removed once the process ended
    for rec in list_records(run_dir):
        if rec.host != host:
            report.other_hosts.append(f"{rec.describe()}: run `gpufleet cleanup {run_dir}` "
                                      f"on {rec.host}")
            continue
        proc, state = _recorded_process(rec, report)
        if proc is None:
            if state == "gone" and not dry_run:
                rec.path.unlink(missing_ok=True)  # a stale record
            continue
        for child in _children(proc):
            targets.setdefault(child.pid, (child, f"pid {child.pid} (child of {rec.pid})"))
        targets[proc.pid] = (proc, rec.describe())
        records[proc.pid] = rec.path
    for pid in _self_and_parents() & set(targets):  # e.g. cleanup run from a rank's shell
        report.reused.append(f"{targets.pop(pid)[1]}: this cleanup runs inside it; left "
                             "alone")
    if dry_run:
        report.planned = [d for _, d in targets.values()]
        return report
    for pid in _end(targets, grace_s, report):
        if pid in records:
            records[pid].unlink(missing_ok=True)
    return report


def _recorded_process(rec: ProcRecord, report: CleanupReport) -> tuple[Any, str]:
    """The live process a record names and ``"live"``, or None and ``"gone"``/``"reused"``."""
    import psutil

    try:
        proc = psutil.Process(rec.pid)
        started = proc.create_time()
        zombie = proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        report.gone.append(f"{rec.describe()}: not running any more")
        return None, "gone"
    if abs(started - rec.create_time) > CREATE_TIME_TOLERANCE_S:
        report.reused.append(
            f"{rec.describe()}: that pid now belongs to another process (started "
            f"{_clock(started)}, the recorded one {_clock(rec.create_time)}); left alone")
        return None, "reused"
    if zombie:
        report.gone.append(f"{rec.describe()}: exited (a zombie waiting for its parent)")
        return None, "gone"
    return proc, "live"


def _self_and_parents() -> set[int]:
    import psutil

    me = psutil.Process()
    return {me.pid, *(p.pid for p in me.parents())}


def _children(proc: Any) -> list[Any]:
    import psutil

    try:
        return proc.children(recursive=True)
    except psutil.Error:
        return []


def _end(targets: dict[int, tuple[Any, str]], grace_s: float,
         report: CleanupReport) -> set[int]:
    """Suspend all, SIGTERM all, resume all; SIGKILL what is left after ``grace_s``.

    Suspending first means no process (an elastic agent, say) can react to the others
    ending, e.g. by restarting a rank, before it has its own SIGTERM. Returns the pids
    that ended.
    """
    import psutil

    procs = {pid: p for pid, (p, _) in targets.items()}
    ended: set[int] = set()

    def signal_all(action: str) -> None:
        for pid, proc in list(procs.items()):
            try:
                getattr(proc, action)()
            except psutil.NoSuchProcess:
                procs.pop(pid)
                ended.add(pid)
                report.ended.append(f"{targets[pid][1]}: ended")
            except psutil.AccessDenied:
                procs.pop(pid)
                report.failed.append(f"{targets[pid][1]}: not allowed to signal it (owned "
                                     "by another user?); run cleanup as that user")

    try:
        signal_all("suspend")
        signal_all("terminate")  # pending until resumed
    finally:
        signal_all("resume")  # never leave a process stopped
    alive = _wait(list(procs.values()), grace_s)
    for proc in procs.values():
        if proc not in alive:
            ended.add(proc.pid)
            report.ended.append(f"{targets[proc.pid][1]}: ended by SIGTERM")
    for proc in alive:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    survivors = _wait(alive, 5.0)
    for proc in alive:
        line = f"{targets[proc.pid][1]}: ignored SIGTERM for {grace_s:g} s"
        if proc in survivors:
            report.failed.append(f"{line}, and still runs after SIGKILL")
        else:
            ended.add(proc.pid)
            report.killed.append(f"{line}, ended by SIGKILL")
    return ended


def _wait(procs: list[Any], timeout: float) -> list[Any]:
    """Wait until every process has exited (zombies count as exited); the ones left."""
    deadline = time.monotonic() + timeout
    alive = list(procs)
    while alive:
        alive = [p for p in alive if _running(p)]
        if not alive or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    return alive


def _running(proc: Any) -> bool:
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _clock(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M:%S")


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``gpufleet cleanup`` to the CLI's subparsers.

    Example:
        >>> parser = argparse.ArgumentParser(prog="gpufleet")
        >>> add_parser(parser.add_subparsers(dest="command"))
        >>> parser.parse_args(["cleanup", "runs/x", "--grace", "1"]).grace
        1.0
    """
    p = sub.add_parser(
        "cleanup", help="end the leftover processes of a run (by their recorded pids)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="End the processes a run left behind on this host: the launcher and "
                    "ranks recorded in RUN_DIR/procs/, and their children (data-loader "
                    "workers). Processes are found by recorded pid and start time, never "
                    "by name; a pid that now belongs to another process is left alone.",
        epilog="exit status: 0 when nothing of the run is left running here, 1 when some "
               "process could not be ended.\n\nexamples:\n"
               "  gpufleet cleanup runs/gpt-20250101-120000 --dry-run\n"
               "  gpufleet cleanup runs/gpt-20250101-120000 --grace 10")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory")
    p.add_argument("--grace", type=float, default=5.0, metavar="S",
                   help="seconds between SIGTERM and SIGKILL (default 5)")
    p.add_argument("--dry-run", action="store_true", help="list, do not end anything")


def run(args: argparse.Namespace) -> int:
    """Run ``gpufleet cleanup``; prints what it did, returns 1 if a process is left."""
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"run directory {str(run_dir)!r} does not exist. Give the "
                          "directory of the run to clean up (it holds config.toml and procs/).")
    if args.grace < 0:
        raise ConfigError(f"--grace {args.grace:g}: must be 0 or more seconds")
    if not list_records(run_dir):
        print(f"no process records in {run_dir / RECORDS_DIR}: nothing to clean up "
              "(the run ended cleanly, or it recorded no processes)")
        return 0
    report = cleanup_run(run_dir, grace_s=args.grace, dry_run=args.dry_run)
    sections = [("would end", report.planned), ("ended", report.ended),
                ("killed", report.killed), ("gone", report.gone),
                ("left alone", report.reused), ("other host", report.other_hosts),
                ("FAILED", report.failed)]
    for label, lines in sections:
        for line in lines:
            print(f"{label:<10}  {line}")
    if not args.dry_run and not (report.ended or report.killed or report.failed):
        print("nothing of this run was running on this host")
    sys.stdout.flush()
    return 1 if report.failed else 0
