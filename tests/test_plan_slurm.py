"""The plan of an srun step records the layout srun started in the run's config."""

from __future__ import annotations

import os

import pytest

from gpufleet.config import load_config
from gpufleet.errors import ConfigError
from gpufleet.launch.env import slurm_port
from gpufleet.plan import make_plan

# What real srun sets for task 1 of `srun -N2 -n2` in job 77 (step 3), node n2.
SRUN_RANK_1 = {"SLURM_JOB_ID": "77", "SLURM_JOB_NAME": "interactive", "SLURM_PROCID": "1",
               "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_LOCALID": "0",
               "SLURM_NODEID": "1", "SLURM_NNODES": "2", "SLURM_NODELIST": "n[1-2]",
               "SLURM_STEP_ID": "3", "SLURM_STEPID": "3", "SLURM_STEP_NUM_TASKS": "2",
               "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
               "SLURM_STEP_NODELIST": "n[1-2]"}


@pytest.fixture(autouse=True)
def _no_other_launcher(monkeypatch):
    """No rank variables of another launcher (an earlier in-process test of this worker
    may have left RANK or WORLD_SIZE): they would be read before srun's."""
    for name in list(os.environ):
        if name.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                            "GROUP_RANK", "MASTER_", "TORCHELASTIC_", "OMPI_", "PMI_",
                            "HOROVOD_", "SLURM_")):
            monkeypatch.delenv(name)


def test_config_records_the_nodes_ranks_master_and_launcher_srun_started(monkeypatch):
    for name, value in SRUN_RANK_1.items():
        monkeypatch.setenv(name, value)
    plan = make_plan(load_config(None, {}))
    assert plan.launcher == "external" and plan.world_size == 2
    seen = plan.cfg.dist
    assert {k: getattr(seen, k) for k in ("launcher", "nproc", "nnodes", "node_rank", "master_addr",
                                 "master_port")} == {
        "launcher": "slurm", "nproc": 1, "nnodes": "2", "node_rank": 1, "master_addr": "n1",
        "master_port": slurm_port(77, 3)}


def test_a_recorded_slurm_config_outside_srun_says_what_to_do():
    with pytest.raises(ConfigError, match=r"not a rank of an srun step.*--launcher auto"):
        make_plan(load_config(None, {"dist.launcher": "slurm"}))
