"""DistEnv: reading the rank layout from torchrun's, SLURM's, horovodrun's and mpirun's
environment variables."""

from __future__ import annotations

import os

import pytest

from gpufleet.errors import LaunchError
from gpufleet.launch import DistEnv, export_for_torch
from gpufleet.launch.env import (
    expand_hostlist,
    parse_tasks_per_node,
    slurm_port,
    slurm_step_id,
)

TORCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT")


def slurm(**extra: str) -> dict[str, str]:
    """The variables `srun -N2 -n8` sets for task 5 of 8 (node 1 of 2, 4 tasks a node)."""
    env = {"SLURM_JOB_ID": "12345", "SLURM_JOBID": "12345", "SLURM_JOB_NAME": "train",
           "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_NPROCS": "8",
           "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_NNODES": "2",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS_PER_NODE": "4",
           "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_NODELIST": "gpu[07-08]",
           "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_STEP_ID": "0", "SLURM_STEPID": "0",
           "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_NUM_NODES": "2",
           "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_STEP_NODELIST": "gpu[07-08]"}
    env.update(extra)
    return env


def job_shell(**extra: str) -> dict[str, str]:
    """What the batch script of `sbatch --ntasks=2` (or an `salloc -n2` shell) sees: the
    job's task count and SLURM_PROCID=0, but no SLURM_STEP_* variables."""
    env = {key: value for key, value in slurm(SLURM_PROCID="0", SLURM_NODEID="0",
                                              SLURM_LOCALID="0", SLURM_NTASKS="2",
                                              SLURM_NPROCS="2").items()
           if not key.startswith(("SLURM_STEP", "SLURM_STEPID"))}
    env.update(extra)
    return env


def test_single_process_by_default():
    env = DistEnv.detect({})
    assert (env.rank, env.world_size, env.source) == (0, 1, "none")
    assert not env.is_distributed and env.is_main and env.is_local_main


def test_torchrun_variables():
    env = DistEnv.detect({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                          "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1", "MASTER_ADDR": "n0",
                          "MASTER_PORT": "29500", "TORCHELASTIC_RESTART_COUNT": "2"})
    assert env == DistEnv(rank=5, local_rank=1, world_size=8, local_world_size=4, node_rank=1,
                          master_addr="n0", master_port=29500, source="torchrun",
                          restart_count=2)
    assert env.is_distributed and not env.is_main and not env.is_local_main


def test_torchrun_with_one_rank_is_still_distributed():
    env = DistEnv.detect({"RANK": "0", "WORLD_SIZE": "1"})
    assert env.is_distributed and env.local_world_size == 1 and env.node_rank == 0


def test_torchrun_wins_over_slurm():
    env = DistEnv.detect({**slurm(), "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    assert env.source == "torchrun" and env.world_size == 2


def test_slurm_step():
    env = DistEnv.detect(slurm())
    assert env == DistEnv(rank=5, local_rank=1, world_size=8, local_world_size=4, node_rank=1,
                          master_addr="gpu07", master_port=slurm_port(12345, 0),
                          source="slurm", restart_count=0, nodes=("gpu07", "gpu08"))


def test_slurm_master_port_from_job_id_and_overrides():
    env = DistEnv.detect(slurm(SLURM_JOB_ID="987654"))
    assert env.master_port == slurm_port(987654, 0)
    assert 10000 <= env.master_port < 30000
    env = DistEnv.detect(slurm(MASTER_ADDR="10.0.0.9", MASTER_PORT="29400"))
    assert (env.master_addr, env.master_port) == ("10.0.0.9", 29400)


def test_concurrent_steps_of_one_job_take_distinct_ports():
    # `srun ... &` twice in one batch script: steps 0 and 1 run at once in job 12345.
    ports = {DistEnv.detect(slurm(SLURM_STEP_ID=str(step), SLURM_STEPID=str(step))).master_port
             for step in range(16)}
    assert len(ports) == 16
    assert slurm_port(12345, 1) != slurm_port(12346, 0)  # the next job's first step


def test_slurm_step_nodelist_wins_over_job_nodelist():
    env = DistEnv.detect(slurm(SLURM_STEP_NODELIST="node[003-004]"))
    assert env.master_addr == "node003" and env.nodes == ("node003", "node004")


def test_step_layout_wins_over_the_jobs():
    # Job: -N2 --ntasks-per-node=2 (4 tasks); step: `srun -N2 -n2`, one rank a node.
    env = DistEnv.detect(slurm(SLURM_NTASKS="4", SLURM_NTASKS_PER_NODE="2",
                               SLURM_TASKS_PER_NODE="2(x2)", SLURM_STEP_NUM_TASKS="2",
                               SLURM_STEP_TASKS_PER_NODE="1(x2)", SLURM_PROCID="1",
                               SLURM_LOCALID="0", SLURM_NODEID="1"))
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank) == (
        1, 2, 0, 1, 1)


@pytest.mark.parametrize("value, local_world", [
    ("4", 4), ("4(x2)", 4),
    ("5,3", 3),  # node 1 takes the second entry
    ("2(x1),6", 6),
])
def test_slurm_tasks_per_node_forms(value, local_world):
    env = slurm(SLURM_STEP_TASKS_PER_NODE=value)
    assert DistEnv.detect(env).local_world_size == local_world


def test_slurm_without_tasks_per_node_assumes_even_spread():
    env = slurm()
    del env["SLURM_STEP_TASKS_PER_NODE"]
    assert DistEnv.detect(env).local_world_size == 4


def test_single_task_step_is_not_a_rank():
    # `srun -n1 gpufleet train --nproc 4`: we launch the ranks.
    env = DistEnv.detect(slurm(SLURM_STEP_NUM_TASKS="1", SLURM_PROCID="0",
                               SLURM_LOCALID="0", SLURM_NODEID="0"))
    assert env.source == "none" and not env.is_distributed


@pytest.mark.parametrize("name", ["train", "bash", "interactive", "wrap"])
def test_batch_script_and_salloc_shell_are_not_ranks(name):
    # The batch step of `sbatch --ntasks=2` running `gpufleet train --nproc 2`, and the
    # shell of `salloc -n2`, whatever the job is named: our launcher starts the ranks.
    assert DistEnv.detect(job_shell(SLURM_JOB_NAME=name)).source == "none"


def test_salloc_job_named_interactive_runs_one_job_of_two_ranks():
    # `salloc -N1 -n2` then `srun gpufleet train`: Slurm names the job `interactive`, and
    # both tasks are ranks of one run (not two runs of one rank each).
    envs = [DistEnv.detect(slurm(SLURM_JOB_NAME="interactive", SLURM_PROCID=str(rank),
                                 SLURM_LOCALID=str(rank), SLURM_NODEID="0",
                                 SLURM_STEP_NUM_TASKS="2", SLURM_STEP_NUM_NODES="1",
                                 SLURM_STEP_TASKS_PER_NODE="2", SLURM_STEP_NODELIST="n1"))
            for rank in (0, 1)]
    assert [(e.source, e.rank, e.world_size) for e in envs] == [("slurm", 0, 2), ("slurm", 1, 2)]
    assert envs[0].master_port == envs[1].master_port


@pytest.mark.parametrize("step", ["4294967291", "4294967290", "4294967292", "batch", ""])
def test_special_steps_are_not_ranks(step):
    # The batch script, interactive and extern steps carry these ids on some versions.
    env = slurm(SLURM_STEP_ID=step, SLURM_STEPID=step)
    assert slurm_step_id(env) is None and DistEnv.detect(env).source == "none"


def test_horovodrun_variables():
    # What horovodrun's Gloo mode sets for rank 3 of 4 on two hosts (2 each).
    env = DistEnv.detect({"HOROVOD_RANK": "3", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1",
                          "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_RANK": "1",
                          "HOROVOD_CROSS_SIZE": "2", "HOROVOD_HOSTNAME": "n1"})
    assert env == DistEnv(rank=3, local_rank=1, world_size=4, local_world_size=2, node_rank=1,
                          master_addr="127.0.0.1", master_port=0, source="horovod")
    assert env.is_distributed and not env.is_main


@pytest.mark.parametrize("variables", [
    {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
     "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},  # Open MPI
    {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0",
     "MPI_LOCALNRANKS": "2"},  # MPICH and Intel MPI (Hydra)
])
def test_mpirun_variables(variables):
    env = DistEnv.detect({**variables, "MASTER_ADDR": "n0", "MASTER_PORT": "29400"})
    assert env == DistEnv(rank=2, local_rank=0, world_size=4, local_world_size=2, node_rank=1,
                          master_addr="n0", master_port=29400, source="mpi")


def test_torchrun_wins_over_horovodrun():
    env = DistEnv.detect({"RANK": "0", "WORLD_SIZE": "2", "HOROVOD_RANK": "1",
                          "HOROVOD_SIZE": "2"})
    assert env.source == "torchrun" and env.rank == 0


def test_horovodrun_without_local_variables_assumes_one_node():
    env = DistEnv.detect({"HOROVOD_RANK": "1", "HOROVOD_SIZE": "3"})
    assert (env.local_rank, env.local_world_size, env.node_rank) == (1, 3, 0)


@pytest.mark.parametrize("text, hosts", [
    ("node[001-003],gpu5", ["node001", "node002", "node003", "gpu5"]),
    ("node[001-002,007]", ["node001", "node002", "node007"]),
    ("gpu5", ["gpu5"]),
    ("a1,b[9-10]", ["a1", "b9", "b10"]),
    ("rack[1-2]-gpu[1-2]", ["rack1-gpu1", "rack1-gpu2", "rack2-gpu1", "rack2-gpu2"]),
])
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts


def test_expand_hostlist_rejects_garbage():
    with pytest.raises(LaunchError, match="MASTER_ADDR"):
        expand_hostlist("node[a-c]")


@pytest.mark.parametrize("text, counts", [
    ("4", [4]), ("4(x2)", [4, 4]), ("2,1", [2, 1]), ("2(x2),1", [2, 2, 1]),
])
def test_parse_tasks_per_node(text, counts):
    assert parse_tasks_per_node(text) == counts


def test_bad_numbers_name_the_variable():
    with pytest.raises(LaunchError, match="RANK = 'x'"):
        DistEnv.detect({"RANK": "x", "WORLD_SIZE": "2"})
    with pytest.raises(LaunchError, match="rank 3 of 2"):
        DistEnv.detect({"RANK": "3", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})


def test_export_for_torch(monkeypatch):
    for name in TORCH_VARS:
        monkeypatch.setenv(name, "stale")  # restored (removed) when the test ends
    export_for_torch(DistEnv.detect(slurm()))
    assert {name: os.environ[name] for name in TORCH_VARS} == {
        "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "gpu07", "MASTER_PORT": str(slurm_port(12345, 0))}
    assert DistEnv.detect().source == "torchrun"  # now readable the torchrun way
