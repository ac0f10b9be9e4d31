"""Ranks started by Open MPI's real ``mpirun`` (2 CPU ranks): read from OMPI_COMM_WORLD_*,
they train like gpufleet's own launcher; without an address to meet at, a clear error.

``.ci/run`` installs Open MPI (Debian's ``openmpi-bin``); without ``mpirun`` these skip.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import _env, final_params
from equivalence import assert_same_weights
from gpufleet.launch import free_port

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None,
                                reason="Open MPI is not installed: apt-get install openmpi-bin")

TOY = ["--model", "toyjob:make_model", "--data", "toyjob:make_data", "--max-steps", "8",
       "--model.loss", "torch.nn.functional:mse_loss", "--log.every", "1",
       "--optim.warmup_steps", "2", "--run.out_dir", "runs", "--data.num_workers", "0"]


def _mpirun(tmp_path: Path, *args: str, address: bool) -> subprocess.CompletedProcess:
    forward = ["PYTHONPATH", "OMP_NUM_THREADS"]
    env = _env()
    if address:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        forward += ["MASTER_ADDR", "MASTER_PORT"]
    command = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2",
               *[x for name in forward for x in ("-x", name)],
               sys.executable, "-m", "gpufleet", "train", *TOY, *args]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)


def test_mpirun_ranks_train_like_our_launcher(run_cli, tmp_path):
    proc = _mpirun(tmp_path, "--run-dir", "runs/mpi", "--strategy", "ddp", "--batch-size",
                   "16", address=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    run_cli("train", *TOY, "--run-dir", "runs/single", "--batch-size", "32")
    runs = tmp_path / "runs"
    assert sorted(p.name for p in runs.iterdir()) == ["mpi", "single"]  # one per job
    records = [r for r in map(json.loads, open(runs / "mpi" / "metrics.jsonl"))
               if r["kind"] == "train"]
    assert all(len(r["rank_phases"]) == 2 for r in records)  # both ranks in the table
    assert_same_weights(final_params(runs / "mpi"), final_params(runs / "single"))
    assert proc.stdout.count("gpufleet run summary") == 1  # rank 0 alone prints it


def _horovod_with_mpi() -> bool:
    from gpufleet.parallel.horovod import horovod_available

    if not horovod_available():
        return False
    import horovod.torch as hvd

    return bool(hvd.mpi_built())


@pytest.mark.skipif(_horovod_with_mpi(), reason="this Horovod's MPI wires mpirun's ranks up")
def test_mpirun_without_an_address_names_the_fix(tmp_path):
    # No Horovod, or one built without MPI (scripts/install-horovod.sh): it cannot find
    # the other ranks either, and both ways the message names MASTER_ADDR and MASTER_PORT.
    proc = _mpirun(tmp_path, "--run-dir", "runs/mpi", "--strategy", "ddp", address=False)
    assert proc.returncode != 0
    assert "gpufleet: error:" in proc.stderr
    assert "mpirun -x MASTER_ADDR=node1 -x MASTER_PORT=29500" in proc.stderr
    assert "Traceback" not in proc.stderr
