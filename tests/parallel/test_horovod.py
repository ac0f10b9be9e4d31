"""``horovod``: launched by the real ``horovodrun`` (Gloo mode, two CPU ranks) when Horovod
is installed; without it, and when started the wrong way, a clear error that names the fix.

Horovod builds from source against the installed torch: ``scripts/install-horovod.sh``
(which ``.ci/run`` calls) does it; the tests that need it skip with that hint otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import _env, final_params
from equivalence import assert_same_weights
from gpufleet.config import ParallelConfig
from gpufleet.errors import ConfigError, GpufleetError, LaunchError
from gpufleet.launch import DistEnv, init_process_group
from gpufleet.parallel import build_strategy, strategy_names
from gpufleet.parallel.horovod import Horovod, horovod_available

TOY = ["--model", "toyjob:make_model", "--data", "toyjob:make_data", "--max-steps", "8",
       "--model.loss", "torch.nn.functional:mse_loss", "--log.every", "1",
       "--optim.warmup_steps", "2", "--run.out_dir", "runs", "--data.num_workers", "0"]

needs_horovod = pytest.mark.skipif(
    not horovod_available(), reason="Horovod is not installed: scripts/install-horovod.sh")


@pytest.fixture
def no_horovod(monkeypatch):
    """Make ``import horovod.torch`` fail here, as on a machine without Horovod."""
    for name in ("horovod", "horovod.torch"):
        monkeypatch.setitem(sys.modules, name, None)


def test_without_horovod_building_it_names_the_install(no_horovod):
    assert "horovod" in strategy_names()
    with pytest.raises(GpufleetError) as err:
        build_strategy("horovod", ParallelConfig(), torch.device("cpu"))
    message = str(err.value)
    assert "scripts/install-horovod.sh" in message and "horovodrun" in message


def test_the_cli_reports_it_as_a_gpufleet_error(run_cli, tmp_path):
    # A `horovod` package that fails to import stands in for a machine without Horovod.
    blocker = tmp_path / "no-horovod" / "horovod"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('No module named horovod')\n")
    tests = str(Path(__file__).resolve().parents[1])  # for toyjob
    path = os.pathsep.join([str(blocker.parent), tests, os.environ.get("PYTHONPATH", "")])
    proc = run_cli("train", *TOY, "--strategy", "horovod", "--max-steps", "1", expect=2,
                   env={"PYTHONPATH": path})
    assert "gpufleet: error:" in proc.stderr and "scripts/install-horovod.sh" in proc.stderr


def test_nproc_with_horovod_says_to_use_horovodrun(run_cli):
    proc = run_cli("train", *TOY, "--strategy", "horovod", "--nproc", "2", expect=2)
    assert "horovodrun -np 2 gpufleet train --strategy horovod" in proc.stderr


@needs_horovod
def test_ranks_from_another_launcher_are_refused(monkeypatch):
    # torchrun's variables: Horovod, not started by horovodrun, sees one rank alone.
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="horovodrun -np 2") as err:
        build_strategy("horovod", ParallelConfig(), torch.device("cpu"))
    assert "a job of 2 ranks, but Horovod sees 1" in str(err.value)


def test_mpirun_without_an_address_or_horovod_names_both_fixes(no_horovod):
    env = DistEnv(rank=1, local_rank=1, world_size=2, local_world_size=2, source="mpi")
    with pytest.raises(LaunchError) as err:
        init_process_group(env, "gloo", timeout_s=5)
    message = str(err.value)
    assert "MASTER_ADDR" in message and "MASTER_PORT" in message
    assert "mpirun -x MASTER_ADDR" in message and "scripts/install-horovod.sh" in message


def _horovodrun(tmp_path: Path, name: str, *args: str, np: int = 2) -> Path:
    """``horovodrun -np N -H localhost:N --gloo gpufleet train ...``, as a user would."""
    horovodrun = shutil.which("horovodrun") or str(Path(sys.executable).parent / "horovodrun")
    command = [horovodrun, "-np", str(np), "-H", f"localhost:{np}", "--gloo",
               "--start-timeout", "120", sys.executable, "-m", "gpufleet", "train", *TOY,
               "--run-dir", f"runs/{name}", *args]
    proc = subprocess.run(command, cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=300)
    if proc.returncode != 0:
        pytest.fail(f"horovodrun exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-6000:]}"
                    f"\nSTDERR:\n{proc.stderr[-6000:]}")
    return tmp_path / "runs" / name


def _records(run_dir: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, open(run_dir / "metrics.jsonl")) if r["kind"] == kind]


@needs_horovod
@pytest.mark.parametrize("extra", [
    [],  # gradient clipping on (the default): synchronize() before the norm
    # accumulation, no clipping (slow: the clip case proves the strategy by default)
    pytest.param(["--optim.clip_norm", "0", "--optim.grad_accum", "2"],
                 marks=pytest.mark.slow),
], ids=["clip", "accum"])
def test_horovodrun_two_ranks_equal_single_on_the_same_global_batch(run_cli, tmp_path, extra):
    accum = 2 if "--optim.grad_accum" in extra else 1
    single = tmp_path / "runs" / "single"
    run_cli("train", *TOY, "--run-dir", "runs/single", "--batch-size", str(32 // accum),
            *extra)
    hvd_args = ["--strategy", "horovod", "--batch-size", str(16 // accum),
                "--checkpoint.every", "4", *extra]
    hvd = _horovodrun(tmp_path, "hvd", *hvd_args)
    # One run directory for the job (rank 0's, agreed through the process group), and
    # the metrics of a 2-rank job in it.
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["hvd", "single"]
    assert (tmp_path / "runs" / "hvd" / "checkpoints" / "step-0000008.pt").exists()
    train = _records(hvd, "train")
    assert [r["step"] for r in train] == list(range(1, 9))
    assert all(len(r["rank_phases"]) == 2 for r in train)  # both ranks' rows arrived
    assert_same_weights(final_params(hvd), final_params(single))
    got_losses = [r["loss"] for r in train]
    want_losses = [r["loss"] for r in _records(single, "train")]
    assert got_losses == pytest.approx(want_losses, rel=1e-4, abs=1e-6)
    if accum == 1:
        # Resumed at step 4 by horovodrun again: the same data position and optimizer
        # state on both ranks, so the same weights bit for bit.
        step4 = hvd / "checkpoints" / "step-0000004.pt"
        resumed = _horovodrun(tmp_path, "resumed", *hvd_args, "--resume", str(step4))
        assert [r["loss"] for r in _records(resumed, "train")] == got_losses[4:]
        for name, p in final_params(resumed).items():
            torch.testing.assert_close(p, final_params(hvd)[name], rtol=0, atol=0)


@needs_horovod
@pytest.mark.slow  # ddp under horovodrun; the horovod strategy itself is proven in the default run
def test_horovodrun_can_launch_ddp_and_the_ranks_meet_through_horovod(run_cli, tmp_path):
    # horovodrun sets no MASTER_ADDR/PORT: the store address travels through Horovod.
    ddp = _horovodrun(tmp_path, "ddp", "--strategy", "ddp", "--batch-size", "16")
    run_cli("train", *TOY, "--run-dir", "runs/single", "--batch-size", "32")
    assert_same_weights(final_params(ddp), final_params(tmp_path / "runs" / "single"))
    assert not list((ddp / "procs").glob("*")), "process records left behind"
    assert os.environ.get("HOROVOD_RANK") is None  # the test process itself is no rank


def test_one_mpirun_rank_needs_no_address(no_horovod, monkeypatch):
    from gpufleet.launch import destroy_process_group, gather_objects, job_store

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT"):
        # Joining exports these; setenv records their state so the end of the test
        # restores it (delenv of an unset name would record nothing).
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    env = DistEnv(world_size=1, source="mpi")
    init_process_group(env, "gloo", timeout_s=30)
    try:
        assert gather_objects("x") == ["x"] and job_store() is not None
    finally:
        destroy_process_group()


def test_an_all_reduce_over_a_group_is_refused_naming_the_fix():
    # Horovod reduces over every rank: a torch.distributed group asked for is refused
    # (the check comes before Horovod is reached, so none is needed here).
    strategy = Horovod.__new__(Horovod)
    with pytest.raises(ConfigError, match=r"group=None"):
        strategy.all_reduce(torch.ones(1), "sum", group=object())
