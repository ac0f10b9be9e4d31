"""A cluster of network namespaces for the multi-node tests (see gpufleet.bench.netbed)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpufleet.bench.netbed import NetBed, netbed_available

TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture
def netbed(request: pytest.FixtureRequest) -> Iterator[NetBed]:
    """A 2-node bed (``@pytest.mark.parametrize("netbed", [3], indirect=True)`` for more);
    skips with the reason when this machine cannot make namespaces; always torn down."""
    reason = netbed_available()
    if reason:
        pytest.skip(reason)
    with NetBed(getattr(request, "param", 2)) as bed:
        yield bed


def node_env(extra: dict | None = None) -> dict:
    """Environment for a process on a node: this checkout's code, one thread, no rank
    variables inherited from whoever runs the tests."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "GLOO_", "NCCL_",
                                "TORCHELASTIC_", "SLURM_", "OMPI_", "PMI_", "HOROVOD_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    env.update(extra or {})
    return env


PYTHON = sys.executable


@pytest.fixture
def slurm(netbed, tmp_path):
    """A Slurm cluster (munged, slurmctld, a slurmd per node) on the bed; skips with the
    reason when Slurm's tools are missing; always torn down."""
    from .slurmbed import SlurmBed, slurm_missing

    reason = slurm_missing()
    if reason:
        pytest.skip(reason)
    bed = SlurmBed(netbed, tmp_path / "slurm")
    try:
        yield bed
    finally:
        bed.close()


@pytest.fixture
def sshd(netbed, tmp_path):
    """An sshd on every node of the bed and a client config of the test's own (ssh -F);
    skips with the reason when OpenSSH is missing; always torn down."""
    from .sshbed import SshBed, ssh_missing

    reason = ssh_missing()
    if reason:
        pytest.skip(reason)
    bed = SshBed(netbed, tmp_path / "ssh")
    try:
        yield bed
    finally:
        bed.close()
