"""One run per run directory: a second run is refused naming the holder; a lock whose
holder died (kill -9) is taken over, saying so; processes of one run share it."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import _env
from gpufleet.train.checkpoint import runlock

_HOLD = """
import sys, time
from gpufleet.train.checkpoint import runlock
lock = runlock.acquire(sys.argv[1], sys.argv[2])
print("held" if lock else "shared", flush=True)
time.sleep(60)
"""


@pytest.fixture
def holder(tmp_path):
    """Start a process that takes the lock of a run directory for run id ``run-a``."""
    procs = []

    def start(run_dir, run="run-a"):
        proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(run_dir), run],
                                env=_env(), stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout.readline().strip() == "held"
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def test_a_second_run_is_refused_naming_the_holder(tmp_path, holder):
    first = holder(tmp_path / "run")
    with pytest.raises(runlock.RunDirInUse) as err:
        runlock.acquire(tmp_path / "run", "run-b")
    message = str(err.value)
    assert f"pid {first.pid} on host {socket.gethostname()}, since " in message
    assert "run id run-a" in message and "another --run-dir" in message


def test_processes_of_the_same_run_share_the_lock(tmp_path, holder):
    holder(tmp_path / "run")
    assert runlock.acquire(tmp_path / "run", "run-a") is None  # e.g. a second node


def test_a_lock_left_by_a_killed_process_is_taken_over_saying_so(tmp_path, holder, caplog):
    first = holder(tmp_path / "run")
    first.send_signal(signal.SIGKILL)
    first.wait()
    with caplog.at_level(logging.WARNING):
        lock = runlock.acquire(tmp_path / "run", "run-b")
    assert lock is not None
    assert f"taking over the lock of pid {first.pid}" in caplog.text
    lock.release()
    assert not (tmp_path / "run" / runlock.RECORD_FILE).exists()  # a clean end
    runlock.acquire(tmp_path / "run", "run-c").release()  # free again


def test_two_train_commands_on_one_run_dir(tmp_path):
    """A long run holds its directory; a second `gpufleet train` there is refused with
    who holds it; after the first is killed with SIGKILL, a resume takes over."""
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "gpufleet", "train", "--run-dir", str(run_dir),
            "--model", "toyjob:make_model", "--data", "toyjob:make_data",
            "--model.loss", "torch.nn.functional:mse_loss", "--log.progress", "off",
            "--checkpoint.every", "5", "--max-steps", "100000"]
    env = _env({"GPUFLEET_CACHE": str(tmp_path / "cache")})
    first = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list((run_dir / "checkpoints").glob("step-*.pt")):
            assert first.poll() is None, first.stderr.read()
            assert time.monotonic() < deadline
            time.sleep(0.2)
        second = subprocess.run([*args[:-1], "20"], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stderr
        assert "Traceback" not in second.stderr
        assert f"is in use by another run: pid {first.pid} on host" in second.stderr
        first.send_signal(signal.SIGKILL)
        first.wait()
        third = subprocess.run([*args[:-1], "20", "--resume", "latest"], cwd=tmp_path,
                               env=env, capture_output=True, text=True, timeout=120)
        assert third.returncode == 0, third.stderr
        assert f"taking over the lock of pid {first.pid}" in third.stderr
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert not os.path.exists(run_dir / runlock.RECORD_FILE)


def test_a_node_of_the_same_run_waits_for_the_holders_record(tmp_path):
    """Two nodes of one run start together: the second finds the lock taken before the
    holder wrote its record, and waits for the record instead of refusing the run."""
    import fcntl
    import threading

    fd = os.open(tmp_path / runlock.LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)  # the other node has the lock, no record yet
    try:
        late = threading.Timer(0.3, runlock._write_record, (tmp_path, "job@10.0.0.1:29500"))
        late.start()
        assert runlock.acquire(tmp_path, "job@10.0.0.1:29500") is None  # shared, not refused
        late.join()
        with pytest.raises(runlock.RunDirInUse, match=f"pid {os.getpid()}"):
            runlock.acquire(tmp_path, "another-run")  # a different run still is
    finally:
        os.close(fd)
