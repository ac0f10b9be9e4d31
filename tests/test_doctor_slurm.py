"""gpufleet doctor inside a SLURM job, with the variables real srun and sbatch set."""

from __future__ import annotations

import socket

import pytest

from gpufleet.doctor import slurm as doctor_slurm
from gpufleet.doctor.result import FAIL, OK, WARN
from gpufleet.launch import netif
from gpufleet.launch.env import slurm_port
from gpufleet.launch.netif import Route


def srun_task(rank: int, **extra: str) -> dict[str, str]:
    """Task ``rank`` of `srun -N2 -n2` in job 77, step 3, on nodes n1 and n2."""
    env = {"SLURM_JOB_ID": "77", "SLURM_JOB_NAME": "train", "SLURM_PROCID": str(rank),
           "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": str(rank),
           "SLURM_NNODES": "2", "SLURM_NODELIST": "n[1-2]", "SLURM_STEP_ID": "3",
           "SLURM_STEPID": "3", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "2",
           "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_STEP_NODELIST": "n[1-2]"}
    env.update(extra)
    return env


@pytest.fixture
def node(monkeypatch):
    """This machine as node ``name`` of a two-node bed whose names map as Debian's hosts
    files map them (own name → 127.0.1.1): the kernel's routes, fixed."""
    def become(name: str) -> None:
        own = Route(name, "127.0.1.1", "127.0.1.1", "lo")
        peers = {"n1": Route("n1", "10.77.0.2", "10.77.0.3", "veth0"),
                 "n2": Route("n2", "10.77.0.3", "10.77.0.2", "veth0")}
        table = {**peers, name: own}
        monkeypatch.setattr(netif, "route_to", lambda host: table[host])
        monkeypatch.setattr(doctor_slurm, "route_to", lambda host: table[host])
        monkeypatch.setattr(socket, "gethostname", lambda: name)
        monkeypatch.setattr(socket, "gethostbyname", lambda host: table[host].target_ip)
    return become


def test_outside_slurm_nothing_is_said():
    assert doctor_slurm.check_slurm({}) == []


def test_the_batch_script_is_told_it_is_not_a_rank():
    env = {k: v for k, v in srun_task(0).items() if not k.startswith("SLURM_STEP")}
    [result] = doctor_slurm.check_slurm(env)
    assert result.status == OK and "not a rank" in result.message and "--nproc" in result.message


def test_a_rank_says_which_rank_of_which_step_and_checks_the_master_from_its_node(node):
    node("n2")
    results = {r.name: r for r in doctor_slurm.check_slurm(srun_task(1))}
    assert results["slurm"].message.startswith("rank 1 of 2 in step 77.3: node 1 of 2 (n2)")
    assert f"master n1:{slurm_port(77, 3)}" in results["slurm"].message
    assert results["slurm master"].status == OK
    assert "veth0 (10.77.0.3, the route to n1)" in results["slurm master"].message
    assert results["slurm host name"].status == WARN  # n2 → 127.0.1.1
    assert "127.0.1.1" in results["slurm host name"].message


def test_on_the_master_node_the_route_to_the_peers_and_the_port_are_checked(node):
    node("n1")
    with socket.socket() as s:  # a free port, held here: the step's port is taken
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        results = {r.name: r for r in doctor_slurm.check_slurm(
            srun_task(0, MASTER_PORT=str(port)))}
    master = results["slurm master"]
    assert master.status == FAIL and f"port {port}" in master.message
    assert "taken" in master.message
    assert "veth0 (10.77.0.2, the route to n2)" in master.message  # never lo
    # The socket is closed now: the same port is free.
    results = {r.name: r for r in doctor_slurm.check_slurm(srun_task(0, MASTER_PORT=str(port)))}
    assert results["slurm master"].status == OK
    assert "is free here" in results["slurm master"].message
