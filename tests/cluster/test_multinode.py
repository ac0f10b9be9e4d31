"""Two nodes of a network-namespace cluster train as one job, with no variable set by hand:
static (--master-addr) and elastic (c10d --rdzv-endpoint), ddp and fsdp, each ending with
the weights `single` reaches on the same global batch."""

from __future__ import annotations

import subprocess

import pytest

from equivalence import assert_same_weights
from gpufleet.config import load_config

from .conftest import PYTHON, node_env
from .nodes import TOY, final_weights, start, wait

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The reference: one process, the global batch of 32."""
    cwd = tmp_path_factory.mktemp("single")
    subprocess.run([PYTHON, "-m", "gpufleet", "train", *TOY, "--data", "toyjob:make_data",
                    "--max-steps", "10", "--batch-size", "32", "--run-dir", "runs/single"],
                   cwd=cwd, env=node_env(), check=True, capture_output=True, timeout=120)
    return final_weights(cwd / "runs" / "single")


def _two_nodes(netbed, tmp_path, how: str, strategy: str) -> list:
    addr = netbed.addr(0)
    where = {
        "static": lambda i: ["--nnodes", "2", "--node-rank", str(i), "--master-addr", addr,
                             "--master-port", "29500"],
        "elastic": lambda i: ["--nnodes", "1:2", "--rdzv-endpoint", f"{addr}:29400",
                              "--rdzv-id", "job", "--dist.rdzv_last_call_s", "20"],
    }[how]
    nodes = [start(netbed, i, [*TOY, "--data", "toyjob:make_data", "--max-steps", "10",
                               "--nproc", "1", "--batch-size", "16", "--strategy", strategy,
                               "--run-dir", f"runs/{how}-{strategy}", *where(i)], tmp_path)
             for i in range(2)]
    wait(nodes, timeout=180)
    return nodes


@pytest.mark.parametrize(("how", "strategy"), [
    ("static", "ddp"), ("elastic", "fsdp"),
    # The other two pairs prove nothing new in the default run; `pytest -m slow` has them.
    pytest.param("static", "fsdp", marks=pytest.mark.slow),
    pytest.param("elastic", "ddp", marks=pytest.mark.slow)])
def test_two_nodes_equal_single_without_hand_set_variables(netbed, tmp_path, single, how,
                                                           strategy):
    nodes = _two_nodes(netbed, tmp_path, how, strategy)
    log = nodes[0].output()
    assert "GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME=eth0" in log, log[-3000:]
    if how == "elastic":
        assert "this node hosts the store" in log
        assert "does not host the store" in nodes[1].output()
    run = tmp_path / "runs" / f"{how}-{strategy}"
    # In-memory snapshots by default on an elastic node range (its ranks left may go
    # on without a lost node), not on a fixed node count.
    recorded = load_config(run / "config.toml").fault.snapshot_every
    assert recorded == (10 if how == "elastic" else 0)
    assert_same_weights(final_weights(run), single)
