import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))  # `import toyjob` in this process


def _env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = "1"  # several ranks share 2 cores
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
              "SLURM_PROCID", "SLURM_NTASKS", "TORCHELASTIC_RESTART_COUNT",
              "GPUFLEET_RUN_ID"):
        env.pop(k, None)
    for k in [k for k in env if k.startswith(("HOROVOD_", "OMPI_COMM_WORLD_", "PMI_"))]:
        env.pop(k)  # a test started inside horovodrun or mpirun is not one of its ranks
    env.update(extra or {})
    return env


@pytest.fixture
def run_cli(tmp_path):
    """Run `python -m gpufleet ARGS` (or another module) as a user would; returns the
    CompletedProcess. Fails the test with the output when the exit code is not `expect`."""

    def run(*args: str, module: str = "gpufleet", expect: int | None = 0, timeout=240,
            env: dict | None = None) -> subprocess.CompletedProcess:
        proc = subprocess.run([sys.executable, "-m", module, *args], cwd=tmp_path,
                              env=_env(env), capture_output=True, text=True, timeout=timeout)
        if expect is not None and proc.returncode != expect:
            pytest.fail(f"exit {proc.returncode} (wanted {expect})\nSTDOUT:\n{proc.stdout}"
                        f"\nSTDERR:\n{proc.stderr}")
        return proc

    return run


def final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    """The model weights in a run's newest checkpoint."""
    ckpts = sorted((Path(run_dir) / "checkpoints").glob("step-*.pt"))
    assert ckpts, f"no checkpoint in {run_dir}"
    return torch.load(ckpts[-1], map_location="cpu", weights_only=True)["model"]


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` skip, saying why, where torch sees no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False "
                                   f"(torch {torch.__version__})")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _environment_restored():
    """Each test gets the environment the worker started with: code under test that
    exports a rank's variables (RANK=1, WORLD_SIZE=2, MASTER_PORT ... for torch) would
    otherwise make a later in-process run of the same worker believe it is that rank."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(autouse=True)
def _no_process_group_left_behind(request):
    """A test that leaves this process in a default process group fails, naming itself;
    the group is ended so the next test of the same worker starts clean (a leaked group
    made later tests fail far from their cause: "default process group twice")."""
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail(f"{request.node.nodeid} left a default process group behind: end it "
                    "(destroy_process_group, Fleet.finish) before the test returns")
