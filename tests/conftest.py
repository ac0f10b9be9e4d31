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


# The files that take longest (a minute or more of a worker on the project's 2-core
# machine: many ranks started, or mypy's first read of torch), run first. The test
# workers take whole files in collection order (`--dist loadfile`, without xdist's
# reordering by test count, which put these few-test files last), so a long file
# started near the end would leave the other worker idle until it ends.
LONGEST_FIRST = (
    "test_types.py", "parallel/test_presets.py", "cluster/test_recovery.py",
    "test_distributed.py", "test_preemption.py", "parallel/test_layouts_by_degree.py",
    "test_first_day.py", "docs/test_site.py", "test_cli.py", "launch/test_launcher.py",
    "examples/test_own_loop.py", "cluster/test_node_loss.py", "test_received_files.py",
    "cluster/test_multinode.py", "train/test_recipe.py", "parallel/test_horovod.py",
    "cluster/test_slow_link.py", "examples/test_fabric_port.py",
    "examples/test_finetune_transformers.py", "test_fault_distributed.py",
    "fleet/test_sharded_save.py", "cluster/test_bad_input.py", "parallel/test_zero.py",
)


def _file_rank(item) -> int:
    path = Path(str(item.path)).relative_to(TESTS).as_posix()
    return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config, items):
    """The longest files first (:data:`LONGEST_FIRST`); tests marked ``gpu`` skip,
    saying why, where torch sees no CUDA device."""
    items.sort(key=_file_rank)  # stable: each file's tests keep their order
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
