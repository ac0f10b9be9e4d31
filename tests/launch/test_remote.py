"""The guard each node of a --hosts job runs: it starts the node's command from what
stdin sends, obeys INT/TERM/KILL, and when its input ends (the ssh session is gone) it
leaves no process behind, not even one that left the command's session."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpufleet.launch import remote

SOURCE = Path(remote.__file__).read_text()
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the guard reads /proc")


def _guard(argv: list[str], cwd: Path, env: dict | None = None,
           grace_s: float = 30.0) -> subprocess.Popen:
    """Start the guard the way ssh does on a node: ``python -c SOURCE``, spec on stdin."""
    proc = subprocess.Popen([sys.executable, "-c", SOURCE], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdin.write(json.dumps({"argv": argv, "cwd": str(cwd), "env": env or {},
                                 "grace_s": grace_s}) + "\n")
    proc.stdin.flush()
    return proc


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie is dead: it only waits to be collected)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_for(path: Path, proc: subprocess.Popen) -> str:
    deadline = time.monotonic() + 60
    while not (path.exists() and path.read_text().strip()):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} never written"
        time.sleep(0.05)
    return path.read_text().strip()


def test_command_runs_in_cwd_with_env_and_its_status_comes_back(tmp_path):
    proc = _guard(["sh", "-c", 'echo "$GF_VALUE in $(pwd)"; exit 3'], tmp_path,
                  {"GF_VALUE": "sent"})
    out = proc.stdout.read()  # stdin stays open, as the launcher keeps it
    assert proc.wait(timeout=60) == 3
    assert out.strip() == f"sent in {tmp_path}"
    proc.stdin.close()


def test_end_of_input_kills_everything_even_what_left_the_session(tmp_path):
    # The command ignores SIGTERM and starts a process in a session of its own, as torch's
    # agent does with each rank: the guard must still leave nothing behind.
    pidfile = tmp_path / "escaped.pid"
    proc = _guard(["sh", "-c", f"trap '' TERM; setsid sleep 300 & echo $! > {pidfile}; "
                               "while :; do sleep 1; done"], tmp_path, grace_s=0.5)
    escaped = int(_wait_for(pidfile, proc))
    assert _alive(escaped)
    proc.stdin.close()  # what a dropped ssh connection looks like on the node
    assert proc.wait(timeout=60) == 128 + signal.SIGKILL
    assert not _alive(escaped)


def test_leftovers_are_killed_when_the_command_ends(tmp_path):
    pidfile = tmp_path / "orphan.pid"
    proc = _guard(["sh", "-c", f"setsid sleep 300 & echo $! > {pidfile}"], tmp_path)
    assert proc.wait(timeout=60) == 0
    assert not _alive(int(pidfile.read_text()))
    proc.stdin.close()


def test_int_line_is_sigint_to_the_command(tmp_path):
    ready = tmp_path / "ready"
    code = ("import signal, sys, time, pathlib\n"
            "signal.signal(signal.SIGINT, lambda *a: sys.exit(42))\n"
            f"pathlib.Path({str(ready)!r}).write_text('1')\n"
            "time.sleep(300)\n")
    proc = _guard([sys.executable, "-c", code], tmp_path)
    _wait_for(ready, proc)
    proc.stdin.write("INT\n")
    proc.stdin.flush()
    assert proc.wait(timeout=60) == 42
    proc.stdin.close()


def test_kill_line_kills_at_once(tmp_path):
    ready = tmp_path / "ready"
    proc = _guard(["sh", "-c", f"trap '' TERM INT; echo 1 > {ready}; "
                               "while :; do sleep 1; done"], tmp_path)
    _wait_for(ready, proc)
    proc.stdin.write("TERM\nKILL\n")
    proc.stdin.flush()
    assert proc.wait(timeout=60) == 128 + signal.SIGKILL
    proc.stdin.close()


def test_missing_directory_is_named(tmp_path):
    proc = _guard(["true"], tmp_path / "not-here")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert f"{tmp_path / 'not-here'} does not exist on this host" in err


def test_descendants_are_read_from_proc():
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert child.pid in remote.descendants(os.getpid())
    finally:
        child.kill()
        child.wait()
