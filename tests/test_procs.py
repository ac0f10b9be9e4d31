"""`gpufleet cleanup`: recorded processes of a run are ended by pid, and only those."""

import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from gpufleet.procs import cleanup_run, forget_process, list_records, record_process

# A rank-like process: records itself, optionally ignores SIGTERM, starts a grandchild
# (think data-loader worker), says it is ready, then sleeps.
CHILD = """
import signal, subprocess, sys, time
from pathlib import Path
from gpufleet.procs import record_process
run_dir, mode = Path(sys.argv[1]), sys.argv[2]
if mode == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
record_process(run_dir, "rank", rank=0)
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
(run_dir / "worker.pid").write_text(str(worker.pid))
time.sleep(120)
"""


def _start(run_dir: Path, mode: str = "normal") -> tuple[subprocess.Popen, int]:
    """Start CHILD; returns it and its worker's pid once both run and it is recorded."""
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(run_dir), mode])
    deadline = time.monotonic() + 60
    while not (run_dir / "worker.pid").exists():
        assert child.poll() is None, "the child process died at start"
        assert time.monotonic() < deadline, "the child did not start in 60 s"
        time.sleep(0.05)
    return child, int((run_dir / "worker.pid").read_text())


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def _exited(pid: int, timeout: float = 10.0) -> bool:
    """True once ``pid`` is gone or a zombie (waiting for its parent to reap it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def _kill(*pids: int) -> None:
    """End the test's own leftover processes, by pid."""
    for pid in pids:
        try:
            psutil.Process(pid).kill()
        except psutil.NoSuchProcess:
            pass


def test_record_holds_pid_role_rank_host_start_time_and_command(tmp_path):
    path = record_process(tmp_path, "rank", rank=3)
    data = json.loads(path.read_text())
    me = psutil.Process()
    assert path == tmp_path / "procs" / f"{socket.gethostname()}-{me.pid}.json"
    assert (data["pid"], data["role"], data["rank"], data["host"]) == (
        me.pid, "rank", 3, socket.gethostname())
    assert data["create_time"] == pytest.approx(me.create_time())
    assert data["cmdline"] == me.cmdline() and data["started"]
    assert [r.pid for r in list_records(tmp_path)] == [me.pid]
    assert forget_process(tmp_path) is True
    assert list_records(tmp_path) == [] and forget_process(tmp_path) is False
    with pytest.raises(ValueError, match="'launcher'"):
        record_process(tmp_path, "lancher")


def test_cleanup_ends_recorded_process_and_its_children(tmp_path, run_cli):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    child, worker = _start(run_dir)
    try:
        out = run_cli("cleanup", str(run_dir), "--grace", "10").stdout
        assert child.wait(timeout=10) == -signal.SIGTERM
        assert _exited(worker), "the grandchild (worker) is still running"
        assert f"pid {child.pid} (rank 0 on" in out and "ended by SIGTERM" in out
        assert f"pid {worker} (child of {child.pid})" in out
        assert list_records(run_dir) == []  # records of ended processes are removed
        again = run_cli("cleanup", str(run_dir)).stdout
        assert "no process records" in again
    finally:
        _kill(child.pid, worker)


def test_process_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path, run_cli):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    child, worker = _start(run_dir, "ignore-term")
    try:
        out = run_cli("cleanup", str(run_dir), "--grace", "0.5").stdout
        assert child.wait(timeout=10) == -signal.SIGKILL
        assert _exited(worker)
        assert "ignored SIGTERM for 0.5 s, ended by SIGKILL" in out
    finally:
        _kill(child.pid, worker)


def test_reused_pid_is_left_alone(tmp_path, run_cli):
    """A record whose start time does not match the live pid names another process."""
    other = _sleeper()
    try:
        path = record_process(tmp_path, "rank", rank=1, pid=other.pid)
        data = json.loads(path.read_text())
        data["create_time"] -= 3600.0  # the recorded process started an hour earlier
        path.write_text(json.dumps(data))
        out = run_cli("cleanup", str(tmp_path), "--grace", "0.5").stdout
        assert other.poll() is None, "cleanup ended a process it did not record"
        assert "now belongs to another process" in out and "left alone" in out
        assert path.exists()
    finally:
        _kill(other.pid)
        other.wait()


def test_dry_run_lists_without_ending(tmp_path, run_cli):
    proc = _sleeper()
    try:
        record_process(tmp_path, "launcher", pid=proc.pid)
        out = run_cli("cleanup", str(tmp_path), "--dry-run").stdout
        assert re.search(rf"^would end +pid {proc.pid} \(launcher on ", out, re.M), out
        assert proc.poll() is None and len(list_records(tmp_path)) == 1
    finally:
        _kill(proc.pid)
        proc.wait()


def test_gone_and_other_host_records(tmp_path):
    proc = _sleeper()
    record_process(tmp_path, "rank", rank=0, pid=proc.pid)
    proc.kill()
    proc.wait()
    remote = {"pid": 4242, "role": "rank", "rank": 1, "host": "node-b", "create_time": 1.0,
              "cmdline": [], "started": ""}
    (tmp_path / "procs" / "node-b-4242.json").write_text(json.dumps(remote))
    report = cleanup_run(tmp_path, grace_s=0.5)
    assert report.gone == [f"pid {proc.pid} (rank 0 on {socket.gethostname()}): "
                           "not running any more"]
    assert report.other_hosts == [f"pid 4242 (rank 1 on node-b): run `gpufleet cleanup "
                                  f"{tmp_path}` on node-b"]
    assert [r.host for r in list_records(tmp_path)] == ["node-b"]  # stale one removed


def test_missing_run_dir_and_empty_run_dir(tmp_path, run_cli):
    missing = run_cli("cleanup", str(tmp_path / "nope"), expect=2)
    assert "does not exist" in missing.stderr and "nope" in missing.stderr
    empty = run_cli("cleanup", str(tmp_path))
    assert "no process records" in empty.stdout and "nothing to clean up" in empty.stdout
