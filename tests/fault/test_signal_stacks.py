"""A rank's stacks written on a signal while its only thread holds the interpreter lock
in native code (a real process stuck in libc's sleep through ctypes.PyDLL)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

from gpufleet.fault import signal_stacks
from gpufleet.fault.signal_stacks import SignalStacks, ask_silent

STUCK = """
import ctypes, sys
from gpufleet.fault.signal_stacks import SignalStacks
assert SignalStacks(sys.argv[1], 1).start()
libc = ctypes.PyDLL(None)  # PyDLL: the call keeps the interpreter lock
libc.write(1, b"ready\\n", 6)
libc.sleep(60)  # stuck here, no Python thread can run
"""


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_rank_stuck_holding_the_interpreter_lock_writes_its_stacks_on_request(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", STUCK, str(tmp_path)],
                             stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline() == b"ready\n"
        deadline = time.monotonic() + 30
        while _state(child.pid) != "S":  # asleep in libc's sleep
            assert time.monotonic() < deadline, _state(child.pid)
            time.sleep(0.05)
        beat = {"rank": 1, "host": socket.gethostname(), "pid": child.pid, "proc_state": "S"}
        said = ask_silent(tmp_path, {1: beat})
        path = signal_stacks.stacks_file(tmp_path, 1)
        assert said == (f"\nrank 1's Python stacks, written on a signal (its own threads "
                        f"did not answer): {path}")
        line = 1 + STUCK.splitlines().index("libc.sleep(60)  # stuck here, no Python "
                                            "thread can run")
        assert f'File "<string>", line {line}' in path.read_text(), path.read_text()
    finally:
        child.kill()
        child.wait()


def test_no_signal_to_a_process_that_did_not_register_and_no_file_left(tmp_path):
    other = subprocess.Popen(["sleep", "30"])  # the signal's default would end it
    try:
        beat = {"rank": 2, "host": socket.gethostname(), "pid": other.pid, "proc_state": "S"}
        assert ask_silent(tmp_path, {2: beat}, wait_s=0.1) == ""
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()
    stacks = SignalStacks(tmp_path, 0)
    assert stacks.start() and stacks.path.is_file()
    stacks.stop()  # nothing written: a clean run leaves no hangs/ folder
    assert not (tmp_path / "hangs").exists()
