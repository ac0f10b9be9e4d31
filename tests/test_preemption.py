"""Preemption with real signals on 2 ranks (gloo): SIGTERM to the launcher (Kubernetes)
or SIGUSR1 to one rank only (SLURM's warning) stops both ranks after the same step with
a checkpoint and exit status 75; --resume latest then continues bit for bit. The ranks
check every 2 steps here, so the stop waits for a step that is a multiple of 2."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from conftest import _env, final_params
from gpufleet.fault.preempt import REQUEUE_EXIT
from gpufleet.procs import list_records

STEPS = 12
TOY = ["--model", "toyjob:make_model", "--model.loss", "torch.nn.functional:mse_loss",
       "--nproc", "2", "--batch-size", "16", "--data.num_workers", "0", "--log.every", "1",
       "--log.progress", "off", "--optim.warmup_steps", "2", "--checkpoint.every", "1000",
       "--max-steps", str(STEPS), "--fault.preempt_check_every", "2"]
SLOW = ["--data", "toyjob:make_slow_data", "--data.kwargs={delay = 0.01}"]


def _train_steps(run_dir: Path) -> list[int]:
    try:
        lines = [json.loads(x) for x in open(run_dir / "metrics.jsonl")]
    except FileNotFoundError:
        return []
    return [m["step"] for m in lines if m["kind"] == "train"]


def _start(tmp_path: Path, run_dir: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gpufleet", "train", *TOY, *SLOW,
                             "--run-dir", str(run_dir)], cwd=tmp_path, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int) -> None:
    deadline = time.monotonic() + 180
    while len(_train_steps(run_dir)) < step:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run did not get going"
        time.sleep(0.05)


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, err


def _stopped_cleanly(code: int, err: str, run_dir: Path, name: str) -> int:
    assert code == REQUEUE_EXIT, err
    assert "Traceback" not in err and "SignalException" not in err, err
    assert f"stopped by {name}" in err and "--resume latest" in err, err
    steps = _train_steps(run_dir)
    assert steps == list(range(1, len(steps) + 1)) and len(steps) < STEPS
    assert steps[-1] % 2 == 0  # the ranks agree at multiples of preempt_check_every
    checkpoints = sorted((run_dir / "checkpoints").glob("step-*.pt"))
    assert [p.name for p in checkpoints] == [f"step-{steps[-1]:07d}.pt"]
    return steps[-1]


def _resume_matches_an_uninterrupted_run(tmp_path: Path, run_dir: Path) -> None:
    resumed = subprocess.run([sys.executable, "-m", "gpufleet", "train", *TOY, *SLOW,
                              "--run-dir", str(run_dir), "--resume", "latest"],
                             cwd=tmp_path, env=_env(), capture_output=True, text=True,
                             timeout=240)
    assert resumed.returncode == 0, resumed.stderr
    assert _train_steps(run_dir) == list(range(1, STEPS + 1))  # no step twice
    straight = subprocess.run([sys.executable, "-m", "gpufleet", "train", *TOY,
                               "--data", "toyjob:make_data",
                               "--run-dir", str(tmp_path / "straight")], cwd=tmp_path,
                              env=_env(), capture_output=True, text=True, timeout=240)
    assert straight.returncode == 0, straight.stderr
    want = final_params(tmp_path / "straight")
    for k, v in final_params(run_dir).items():
        assert torch.equal(v, want[k]), k


def test_sigterm_to_the_launcher_checkpoints_and_resumes_bit_for_bit(tmp_path):
    run_dir = tmp_path / "run"
    proc = _start(tmp_path, run_dir)
    _wait_for_step(proc, run_dir, 3)
    proc.send_signal(signal.SIGTERM)
    _stopped_cleanly(*_finish(proc), run_dir, "SIGTERM")
    _resume_matches_an_uninterrupted_run(tmp_path, run_dir)


def test_sigusr1_to_one_rank_stops_both_after_the_same_step(tmp_path):
    run_dir = tmp_path / "run"
    proc = _start(tmp_path, run_dir)
    _wait_for_step(proc, run_dir, 3)
    rank1 = next(r for r in list_records(run_dir) if r.role == "rank" and r.rank == 1)
    os.kill(rank1.pid, signal.SIGUSR1)  # rank 1 alone: rank 0 learns it from the flag
    step = _stopped_cleanly(*_finish(proc), run_dir, "SIGUSR1")
    state = torch.load(run_dir / "checkpoints" / f"step-{step:07d}.pt", weights_only=True)
    assert state["step"] == step and len(state["rng"]) == 2  # both ranks' states in it


def test_ctrl_c_in_one_process_checkpoints_and_exits_130(tmp_path):
    run_dir = tmp_path / "run"
    i = TOY.index("--nproc")
    args = TOY[:i] + TOY[i + 2:]  # one process, no launcher
    proc = subprocess.Popen([sys.executable, "-m", "gpufleet", "train", *args, *SLOW,
                             "--run-dir", str(run_dir)], cwd=tmp_path, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_step(proc, run_dir, 3)
    proc.send_signal(signal.SIGINT)
    code, err = _finish(proc)
    assert code == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    steps = _train_steps(run_dir)
    assert (run_dir / "checkpoints" / f"step-{steps[-1]:07d}.pt").exists()
