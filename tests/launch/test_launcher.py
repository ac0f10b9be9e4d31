"""The launchers and the process group, with real gloo ranks on CPU (2 ranks a run)."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.launcher import api as torch_launcher

from conftest import _env
from gpufleet.launch import (
    DistEnv,
    LaunchError,
    LaunchPlan,
    barrier,
    broadcast_object,
    init_process_group,
    launch,
    rank_zero_first,
    world_size,
)
from gpufleet.launch.elastic_setup import agent_made_with, rendezvous_poll
from gpufleet.launch.launcher import ELASTIC_EXIT_BARRIER_S
from ports import refused_port

HERE = Path(__file__).resolve().parent
# The rank functions live in a module of their own, importable by name in spawned ranks
# (they inherit sys.path; PYTHONPATH is set too, in the fixture, for any other child).
sys.path.insert(0, str(HERE))
workers = importlib.import_module("_launch_workers")

pytestmark = pytest.mark.timeout(60)


def _children() -> list[str]:
    """Command lines of this process's live children (Linux /proc), bar mp's tracker."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError):
            continue  # the process ended while we looked
        zombie_or_dead = fields[0] in ("Z", "X")
        if int(fields[1]) == os.getpid() and not zombie_or_dead and \
                "resource_tracker" not in cmdline:
            found.append(cmdline)
    return found


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No launcher variables from outside; one thread a rank; no rank left behind."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
                 "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.setenv(name, "")  # registers the old value for restoring ...
        monkeypatch.delenv(name)  # ... then removes it
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # 2 ranks share 2 cores
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
    yield
    deadline = time.monotonic() + 10
    while _children() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _children(), f"processes left behind: {_children()}"


# --- real multi-process runs -------------------------------------------------------------

@pytest.mark.parametrize("launcher", ["elastic", "spawn"])
def test_two_ranks_all_reduce(launcher):
    results = launch(workers.all_reduce_rank, nproc=2, launcher=launcher)
    assert sorted(results) == [0, 1]
    for rank, result in results.items():
        assert result == {"sum": 3.0, "rank": rank, "world": 2, "source": "torchrun",
                          "local_rank": rank}


def test_elastic_passes_arguments_and_returns_per_rank(tmp_path):
    assert launch(workers.zero_first, (str(tmp_path),), nproc=2) == {0: True, 1: True}


@pytest.mark.slow  # the agent's restart: test_distributed.py's killed rank keeps it
def test_elastic_restarts_after_a_rank_dies():
    # Attempt 0: rank 1 exits with code 3. The agent restarts both ranks once.
    assert launch(workers.fail_once, nproc=2, max_restarts=1) == {0: 1, 1: 1}
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in os.environ  # restored


def test_elastic_failure_names_rank_traceback_and_restarts():
    with pytest.raises(LaunchError) as info:
        launch(workers.raise_on_rank_one, nproc=2, max_restarts=0)
    message = str(info.value)
    assert "rank 1 (local rank 1" in message and "exit code 1" in message
    assert message.count("ValueError: boom from rank 1") == 1  # the rank's own error, once
    assert "error.json" in message
    # A ValueError is a mistake in the code or config: restarts would not fix it.
    assert "fix it and run again" in message and "--dist.max_restarts" not in message


def test_elastic_writes_rank_logs_to_log_dir(tmp_path):
    logs = tmp_path / "logs"
    with pytest.raises(LaunchError, match=str(logs)):
        # Rank 1 fails only after rank 0 started: on a loaded machine the agent could
        # otherwise stop rank 0 before it opened its log files.
        launch(workers.raise_on_rank_one_after_zero, (str(tmp_path),), nproc=2,
               log_dir=str(logs))
    # Per rank and attempt: stdout.log / stderr.log (what the rank printed) and, for a
    # rank that raised, error.json with its traceback.
    assert len(list(logs.rglob("stderr.log"))) == 2
    assert "boom from rank 1" in next(logs.rglob("1/error.json")).read_text()


@pytest.mark.slow  # a failed rank named: the elastic failure test keeps it in the default run
def test_spawn_failure_names_rank():
    with pytest.raises(LaunchError, match=r"(?s)Rank 1 .*boom from rank 1.*--launcher elastic"):
        launch(workers.raise_on_rank_one, nproc=2, launcher="spawn")


def test_rank_zero_first_orders_ranks(tmp_path):
    # Rank 0 writes a file (slowly) inside the body; rank 1 asserts it exists inside its own.
    results = launch(workers.zero_first, (str(tmp_path),), nproc=2, launcher="spawn")
    assert results == {0: True, 1: True}
    assert (tmp_path / "ready-False").exists() and (tmp_path / "ready-True").exists()


# --- the process group in a plain process --------------------------------------------------

def test_helpers_without_process_group(tmp_path):
    assert not dist.is_initialized()
    barrier()
    assert broadcast_object({"a": 1}) == {"a": 1}
    assert world_size() == 1
    with rank_zero_first():
        (tmp_path / "ran").write_text("yes")
    assert (tmp_path / "ran").exists()


_JOIN_A_REFUSED_PORT = """
import sys
from gpufleet.launch import DistEnv, LaunchError, init_process_group
import torch.distributed as dist
env = DistEnv(rank=1, world_size=2, local_rank=1, local_world_size=2,
              master_port=int(sys.argv[1]), source="torchrun")
try:
    init_process_group(env, "gloo", timeout_s=2)
except LaunchError as err:
    print(err)
print("initialized:", dist.is_initialized())
"""


def test_init_timeout_names_address_and_fixes():
    # In a process of its own, as a rank meets it: a failed rendezvous leaves torch's
    # count of groups raised in the process (a later group of the same process is then
    # named off by one), which would reach the next in-process test of this worker.
    with refused_port() as port:  # nobody listens there, nor can meanwhile
        out = subprocess.run([sys.executable, "-c", _JOIN_A_REFUSED_PORT, str(port)],
                             capture_output=True, text=True, timeout=60, env=_env())
    assert out.returncode == 0, out.stderr
    assert re.search(rf"(?s)127\.0\.0\.1:{port} within 2 s.*all 2 ranks", out.stdout), out
    assert out.stdout.rstrip().endswith("initialized: False")


def test_init_rejects_unknown_backend():
    with pytest.raises(LaunchError, match="Did you mean 'gloo'"):
        init_process_group(DistEnv(), "glo")


# --- options -------------------------------------------------------------------------------

def test_single_node_is_standalone_on_a_free_port():
    first, second = LaunchPlan.resolve(), LaunchPlan.resolve(master_port=29500)
    assert (first.mode, first.rdzv_backend, first.rdzv_endpoint) == (
        "standalone", "c10d", "localhost:0")
    assert second.mode == "standalone" and first.run_id != second.run_id


def test_static_and_elastic_multi_node_plans():
    static = LaunchPlan.resolve(nnodes="2", node_rank=1, master_addr="10.0.0.1",
                                master_port=29500, rdzv_id="job")
    assert (static.mode, static.rdzv_backend, static.rdzv_endpoint, static.rdzv_configs) == (
        "static", "static", "10.0.0.1:29500", {"rank": 1})
    elastic = LaunchPlan.resolve(nnodes="1:4", rdzv_endpoint="head:29400", rdzv_id="job")
    assert (elastic.mode, elastic.min_nodes, elastic.max_nodes, elastic.run_id) == (
        "elastic", 1, 4, "job")


@pytest.mark.parametrize("kwargs, match", [
    ({"nnodes": "2", "master_addr": "10.0.0.1"}, "--master-port"),
    ({"nnodes": "1:4", "master_port": 29500}, "--rdzv-endpoint"),
    ({"nnodes": "2", "rdzv_endpoint": "head:29400"}, "--rdzv-id"),
    ({"nnodes": "2", "node_rank": 2, "master_port": 29500}, "from 0 to 1"),
    ({"nnodes": "two"}, "not a node count"),
    ({"nnodes": "4:2"}, "MIN <= MAX"),
])
def test_bad_rendezvous_options(kwargs, match):
    with pytest.raises(LaunchError, match=match):
        LaunchPlan.resolve(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"launcher": "spawn", "max_restarts": 1}, "cannot restart ranks.*--launcher elastic"),
    ({"launcher": "spawn", "nnodes": "2"}, "Use --launcher elastic"),
    ({"launcher": "elastc"}, "Did you mean 'elastic'"),
    ({"nproc": 0}, "at least one rank"),
])
def test_bad_launch_options(kwargs, match):
    with pytest.raises(LaunchError, match=match):
        launch(workers.raise_on_rank_one, **{"nproc": 2, **kwargs})


def test_unpicklable_function_is_refused_before_starting_ranks():
    with pytest.raises(LaunchError, match="module level"):
        launch(lambda: 1, nproc=2)


def test_an_elastic_node_range_gets_a_shortagent_made_with(monkeypatch):
    """Survivors that went on without a lost node wait for its agent at the end: 30 s,
    not torch's 300 s; the agent class is torch's own again afterwards."""
    made = []
    monkeypatch.setattr(torch_launcher, "LocalElasticAgent",
                        lambda *a, **kw: made.append(kw) or "agent")
    fake = torch_launcher.LocalElasticAgent
    with agent_made_with(ELASTIC_EXIT_BARRIER_S):
        assert torch_launcher.LocalElasticAgent(spec="s") == "agent"
    with agent_made_with(None):  # a fixed node count: torch's default
        torch_launcher.LocalElasticAgent(spec="s")
    assert made == [{"spec": "s", "exit_barrier_timeout": 30.0}, {"spec": "s"}]
    assert torch_launcher.LocalElasticAgent is fake


def test_the_rendezvous_polls_its_state_as_often_as_asked(monkeypatch):
    """torch's rendezvous waits a hard-coded second between reads of its state; with
    dist.rdzv_poll_s it waits that long instead, its other delays (the random skew at a
    round's start) are left alone, and torch's own function is back afterwards."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    slept: list[float] = []
    monkeypatch.setattr(dynamic_rendezvous.time, "sleep", slept.append)
    torch_delay = dynamic_rendezvous._delay
    torch_holder = dynamic_rendezvous._BackendRendezvousStateHolder
    with rendezvous_poll(0.1):
        dynamic_rendezvous._delay(seconds=1)  # the poll while waiting for other nodes
        dynamic_rendezvous._delay(seconds=(0.2, 0.2))  # a round's first, random delay
        # The state is read again after 0.1 s, not served from a copy up to 1 s old.
        holder = dynamic_rendezvous._BackendRendezvousStateHolder(None, None)
        assert holder._cache_duration == 0.1
    with rendezvous_poll(1.0):  # torch's own
        assert dynamic_rendezvous._delay is torch_delay
        assert dynamic_rendezvous._BackendRendezvousStateHolder is torch_holder
        dynamic_rendezvous._delay(seconds=1)
    assert slept == [0.1, 0.2, 1]
    assert dynamic_rendezvous._delay is torch_delay
    assert dynamic_rendezvous._BackendRendezvousStateHolder is torch_holder


def test_the_default_rendezvous_poll_scales_with_the_node_count(monkeypatch):
    """dist.rdzv_poll_s = 0 (the default): 0.01 s a node of the largest node count, from
    0.1 s to torch's 1 s, so the agents' reads of the store stay about 100 a second; a
    poll given is kept."""
    from gpufleet.config import load_config
    from gpufleet.launch import launcher as launcher_module

    assert load_config().dist.rdzv_poll_s == 0.0
    assert [launcher_module.poll_for(n) for n in (1, 2, 10, 40, 100, 1000)] == \
        [0.1, 0.1, 0.1, 0.4, 1.0, 1.0]
    seen: list[float] = []
    monkeypatch.setattr(launcher_module, "_launch_elastic",
                        lambda fn, args, nproc, plan, restarts, logs, timeouts, grow:
                        seen.append(timeouts.poll_s))
    for poll in (0.0, 0.3):
        launcher_module.launch(os.getpid, (), nproc=1, nnodes="1:40",
                               rdzv_endpoint="127.0.0.1:29400", rdzv_id="x",
                               rdzv_poll_s=poll)
    assert seen == [0.4, 0.3]
