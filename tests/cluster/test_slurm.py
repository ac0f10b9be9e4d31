"""gpufleet under a real Slurm cluster (tests/cluster/slurmbed.py): srun steps, salloc,
batch scripts, step layouts, config.toml recording what srun started."""

from __future__ import annotations

import re
import time

import pytest
import tomllib

from .conftest import PYTHON
from .nodes import TOY

pytestmark = pytest.mark.timeout(300)

TRAIN = [PYTHON, "-m", "gpufleet", "train", *TOY, "--data", "toyjob:make_data",
         "--max-steps", "4", "--batch-size", "16"]


def test_srun_on_two_nodes_records_the_layout(slurm, tmp_path):
    run = tmp_path / "runs" / "two"
    out = slurm.client(0, ["srun", "-N2", "-n2", f"--chdir={tmp_path}", *TRAIN,
                           "--run-dir", str(run), "--log.level", "INFO"])
    text = out.stdout + out.stderr
    dist = tomllib.loads((run / "config.toml").read_text())["dist"]
    assert (dist["launcher"], dist["nnodes"], dist["nproc"], dist["master_addr"]) == (
        "slurm", "2", 1, "n1"), text[-3000:]
    # n1's name maps to 127.0.1.1 there: its ranks still talk over eth0, never lo.
    assert "=lo " not in text and "SOCKET_IFNAME=eth0" in text, text[-3000:]


def _records(run) -> list[dict]:
    from .nodes import train_records

    return train_records(run)


@pytest.mark.slow
def test_srun_on_one_node_two_ranks(slurm, tmp_path):
    run = tmp_path / "runs" / "one"
    slurm.client(0, ["srun", "-N1", "-n2", f"--chdir={tmp_path}", *TRAIN, "--run-dir", str(run)])
    dist = tomllib.loads((run / "config.toml").read_text())["dist"]
    assert (dist["launcher"], dist["nnodes"], dist["nproc"]) == ("slurm", "1", 2)
    assert len(_records(run)) == 4


@pytest.mark.slow
def test_salloc_then_srun_is_one_run_of_two_ranks(slurm, tmp_path):
    # The job is named `interactive`; both tasks are ranks of one run, not two runs.
    slurm.client(0, ["salloc", "-N1", "-n2", "srun", f"--chdir={tmp_path}", *TRAIN,
                     "--run.out_dir", str(tmp_path / "runs")])
    runs = [p for p in (tmp_path / "runs").iterdir() if (p / "config.toml").exists()]
    assert len(runs) == 1, runs
    dist = tomllib.loads((runs[0] / "config.toml").read_text())["dist"]
    assert (dist["launcher"], dist["nproc"]) == ("slurm", 2)


@pytest.mark.slow
def test_batch_script_with_nproc_starts_two_ranks_without_hanging(slurm, tmp_path):
    # The batch step has SLURM_PROCID=0 and SLURM_NTASKS=2 but is no rank: --nproc 2
    # starts the ranks here.
    run = tmp_path / "runs" / "batch"
    argv = " ".join([*TRAIN, "--nproc", "2", "--run-dir", str(run)])
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/sh\nexec {argv}\n")
    slurm.client(0, ["sbatch", "--wait", "-N1", "--ntasks=2", f"--chdir={tmp_path}",
                     f"--output={tmp_path}/job.out", str(script)], timeout=240)
    dist = tomllib.loads((run / "config.toml").read_text())["dist"]
    assert (dist["launcher"], dist["nproc"]) == ("elastic", 2)
    assert len(_records(run)) == 4


@pytest.mark.slow
def test_step_layout_unlike_the_jobs_is_read_from_the_step(slurm, tmp_path):
    # Job: 2 tasks a node on 2 nodes; step: one rank a node.
    run = tmp_path / "runs" / "step"
    slurm.client(0, ["salloc", "-N2", "--ntasks-per-node=2", "srun", "-N2", "-n2",
                     f"--chdir={tmp_path}", *TRAIN, "--run-dir", str(run)])
    dist = tomllib.loads((run / "config.toml").read_text())["dist"]
    assert (dist["nnodes"], dist["nproc"]) == ("2", 1)


@pytest.mark.slow
def test_two_concurrent_steps_of_one_job_take_distinct_ports(slurm, tmp_path):
    script = tmp_path / "job.sh"
    steps = [" ".join(["srun", "--overlap", "-N1", "-n2", *TRAIN, "--run-dir",
                       str(tmp_path / "runs" / f"s{i}")]) for i in range(2)]
    script.write_text(f"#!/bin/sh\n{steps[0]} &\n{steps[1]} &\nwait %1 && wait %2\n")
    slurm.client(0, ["sbatch", "--wait", "-N1", "-n2", f"--chdir={tmp_path}",
                     f"--output={tmp_path}/job.out", str(script)], timeout=280)
    ports = [tomllib.loads((tmp_path / "runs" / f"s{i}" / "config.toml").read_text())[
        "dist"]["master_port"] for i in range(2)]
    assert ports[0] != ports[1]
    assert all(len(_records(tmp_path / "runs" / f"s{i}")) == 4 for i in range(2))


REQUEUE_SCRIPT = """#!/bin/sh
#SBATCH --requeue
srun {train}
code=$?
[ $code -eq 75 ] && scontrol requeue $SLURM_JOB_ID
exit $code
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_usr1_preemption_exits_75_requeues_and_resumes_with_resume_auto(slurm, tmp_path):
    run = tmp_path / "runs" / "requeue"
    # Each read takes 2 ms: 300 steps last long enough to be preempted in the middle.
    train = [PYTHON, "-m", "gpufleet", "train", *TOY, "--data", "toyjob:make_slow_data",
             "--max-steps", "300", "--batch-size", "16", "--checkpoint.every", "10",
             "--log.every", "10", "--run-dir", str(run), "--resume", "auto"]
    script = tmp_path / "job.sh"
    script.write_text(REQUEUE_SCRIPT.format(train=" ".join(train)))
    job = slurm.client(0, ["sbatch", "--parsable", "-N2", "-n2", f"--chdir={tmp_path}",
                           "--open-mode=append", f"--output={tmp_path}/job.out",
                           str(script)]).stdout.strip()
    from .nodes import ckpt

    deadline = time.monotonic() + 120
    while not (run.exists() and ckpt.list_checkpoints(run)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ckpt.list_checkpoints(run), slurm.logs()
    slurm.client(0, ["scancel", "--signal=USR1", job])
    state = ""
    deadline = time.monotonic() + 420  # the requeued job starts after Slurm's delay
    while time.monotonic() < deadline:
        state = slurm.client(0, ["scontrol", "show", "job", job]).stdout
        if "JobState=COMPLETED" in state or "JobState=FAILED" in state:
            break
        time.sleep(2)
    # The script requeues only on exit status 75: one restart proves the ranks exited 75.
    assert "JobState=COMPLETED" in state and "Restarts=1" in state, state
    steps = [r["step"] for r in _records(run)]  # both starts append to metrics.jsonl
    assert steps[-1] == 300, steps
    # Both starts append to job.out: the first stopped on SIGUSR1, the second resumed.
    out = (tmp_path / "job.out").read_text()
    assert "SIGUSR1" in out, out[-3000:]
    resumed = re.search(r"resumed from \S+ at step (\d+)", out)
    assert resumed and int(resumed.group(1)) >= 10, out[-3000:]


@pytest.mark.slow
def test_gpufleet_sbatch_submits_a_script_that_trains_on_two_nodes(slurm, tmp_path):
    out = slurm.client(0, [PYTHON, "-m", "gpufleet", "sbatch", "--submit", "--nodes", "2",
                           "--ntasks-per-node", "1", "--gpufleet", f"{PYTHON} -m gpufleet",
                           *TRAIN[4:]], cwd=tmp_path)
    job = out.stdout.strip()
    assert job.isdigit(), out.stdout + out.stderr
    state = ""
    deadline = time.monotonic() + 200
    while time.monotonic() < deadline and "JobState=COMPLETED" not in state:
        state = slurm.client(0, ["scontrol", "show", "job", job]).stdout
        assert "JobState=FAILED" not in state, (tmp_path / f"gpufleet-{job}.out").read_text()
        time.sleep(1)
    run = tmp_path / "runs" / f"gpufleet-{job}"  # the job's own run directory
    dist = tomllib.loads((run / "config.toml").read_text())["dist"]
    assert (dist["launcher"], dist["nnodes"], dist["nproc"]) == ("slurm", "2", 1)
    assert len(_records(run)) == 4
