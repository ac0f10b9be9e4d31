"""Bad multi-node input gets one clear error naming the problem and the fix, within the
rendezvous timeout, and leaves no run directory behind: a wrong address, a port in use,
a node that never comes. And `gpufleet doctor` explains the route and the store host."""

from __future__ import annotations

import subprocess
import time

import pytest

from .conftest import PYTHON, node_env
from .nodes import TOY, start, wait

pytestmark = pytest.mark.timeout(180)


def _static(netbed, addr: str, rank: int, port: int = 29500) -> list[str]:
    return [*TOY, "--data", "toyjob:make_data", "--max-steps", "4", "--nproc", "1",
            "--batch-size", "16", "--nnodes", "2", "--node-rank", str(rank),
            "--master-addr", addr, "--master-port", str(port), "--rdzv-id", "bad",
            "--run.out_dir", "runs", "--dist.rdzv_timeout", "6"]


def _one_error(node) -> str:
    out = node.output()
    assert "Traceback" not in out.split("gpufleet: error:")[-1]
    assert out.count("gpufleet: error:") == 1, out[-3000:]
    return out.split("gpufleet: error:")[1]


def test_node_0_given_an_address_it_does_not_have(netbed, tmp_path):
    wrong = netbed.addr(1)  # node 1's address, given to node 0 as its own
    node = start(netbed, 0, _static(netbed, wrong, 0), tmp_path)
    assert wait([node], timeout=60, expect=None) == [1]
    error = _one_error(node)
    assert f"--master-addr {wrong}" in error and f"--master-addr {netbed.addr(0)}" in error
    assert not (tmp_path / "runs").exists()


def test_a_port_in_use_on_the_store_node(netbed, tmp_path):
    holder = netbed.popen(0, [PYTHON, "-c", "import socket, time; s = socket.socket(); "
                                            "s.bind(('', 29500)); s.listen(); time.sleep(120)"])
    time.sleep(1.0)
    node = start(netbed, 0, _static(netbed, netbed.addr(0), 0), tmp_path)
    assert wait([node], timeout=60, expect=None) == [1]
    error = _one_error(node)
    assert "Port 29500 is in use on this node" in error and f"process {holder.pid}" in error
    assert not (tmp_path / "runs").exists()


def test_a_node_that_never_comes(netbed, tmp_path):
    node = start(netbed, 1, _static(netbed, netbed.addr(0), 1), tmp_path)  # no node 0
    began = time.monotonic()
    assert wait([node], timeout=90, expect=None) == [1]
    took = time.monotonic() - began
    error = _one_error(node)
    assert "did not meet" in error and "a node never came" in error
    assert "waited up to 6 s" in error
    # 6 s of rendezvous plus start-up (torch's import alone takes seconds on a busy
    # machine): far from the 600 s default or a hang.
    assert took < 6 + 60, f"took {took:.0f} s with a 6 s rendezvous timeout"
    assert not (tmp_path / "runs").exists()


def test_doctor_names_the_interface_and_the_store_host(netbed):
    endpoint = f"{netbed.addr(0)}:29400"
    out = [subprocess.run(["ip", "netns", "exec", netbed.ns(i), PYTHON, "-m", "gpufleet",
                           "doctor", "--rdzv-endpoint", endpoint], capture_output=True,
                          text=True, env=node_env(), timeout=120).stdout for i in (0, 1)]
    assert f"leaves through eth0 ({netbed.addr(1)})" in out[1]
    assert "GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME=eth0" in out[1]
    assert "does not own" in out[1] and "hosts the store" in out[0]
