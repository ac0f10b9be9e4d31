"""`gpufleet store` and a training node's side of a store it does not host (real
TCPStores on loopback, free ports; the two-node runs are in tests/cluster)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from gpufleet.errors import LaunchError
from gpufleet.launch.launcher import RendezvousTimeouts, _store_elsewhere, launch
from gpufleet.launch.rendezvous import LaunchPlan
from gpufleet.launch.store import endpoint_hint, serve_store
from gpufleet.launch.store_client import RunGenerations, torch_run_id, wait_for_store
from ports import refused_endpoint


@pytest.fixture
def store_port():
    """A `serve_store` in a thread of this process; yields its port, stops it after."""
    stop, ports = threading.Event(), []
    got = threading.Event()
    thread = threading.Thread(target=serve_store, args=(0,), daemon=True,
                              kwargs={"stop": stop, "ready": lambda p: (ports.append(p),
                                                                        got.set())})
    thread.start()
    assert got.wait(30), "the store did not start"
    yield ports[0]
    stop.set()
    thread.join(10)


def test_the_command_serves_a_store_clients_share_and_stops_on_sigterm():
    proc = subprocess.Popen([sys.executable, "-m", "gpufleet", "store", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        line = proc.stdout.readline()
        assert "listening on port" in line and "--rdzv-endpoint" in line, \
            line + proc.stderr.read()
        port = int(line.split("listening on port ")[1].split(";")[0])
        # Two clients, as two agents would be: what one writes, the other reads.
        one, two = (dist.TCPStore("127.0.0.1", port, is_master=False,
                                  timeout=timedelta(seconds=10)) for _ in range(2))
        one.set("torch.rendezvous.job", "state")
        assert two.get("torch.rendezvous.job") == b"state"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert "stopped" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_taken_port_is_named_with_the_fix():
    with socket.socket() as holder:  # another program listens on the port
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        port = holder.getsockname()[1]
        stop = threading.Event()
        stop.set()  # should it start after all, it ends at once
        with pytest.raises(OSError, match=rf"port {port}.*another --port"):
            serve_store(port, stop=stop)


def test_the_printed_endpoint_is_an_address_the_nodes_can_use():
    assert endpoint_hint(29400, ["10.0.0.5", "192.168.1.2"]) == "--rdzv-endpoint 10.0.0.5:29400"
    assert endpoint_hint(7, ["fe80::1"]) == "--rdzv-endpoint [fe80::1]:7"
    assert endpoint_hint(7, []) == f"--rdzv-endpoint {socket.gethostname()}:7"


def test_an_unreachable_endpoint_names_itself_and_the_store_to_start():
    with refused_endpoint() as endpoint, pytest.raises(LaunchError) as err:
        wait_for_store(endpoint, timeout_s=0.3, poll_s=0.1)
    port = endpoint.rsplit(":", 1)[1]
    assert f"Nothing answers at the rendezvous endpoint {endpoint}" in str(err.value)
    assert f"gpufleet store --port {port}" in str(err.value)


def test_the_launch_path_checks_a_store_it_does_not_host(store_port):
    quick = RendezvousTimeouts(join_s=0.3)
    with refused_endpoint() as endpoint:
        plan = LaunchPlan.resolve(nnodes="1:2", rdzv_endpoint=endpoint, rdzv_id="job")
        with pytest.raises(LaunchError, match="Nothing answers at the rendezvous endpoint"):
            _store_elsewhere(plan, {"is_host": False}, quick)
        assert _store_elsewhere(plan, {"is_host": True}, quick) is None  # this node hosts it
    reachable = LaunchPlan.resolve(nnodes="1:2", rdzv_endpoint=f"127.0.0.1:{store_port}",
                                   rdzv_id="job")
    generations = _store_elsewhere(reachable, {"is_host": False}, quick)
    assert generations is not None and generations.current() == 0


def test_nodes_of_one_start_agree_on_the_generation_after_a_closed_rendezvous(store_port):
    endpoint = f"127.0.0.1:{store_port}"
    node0, node1 = (RunGenerations(endpoint, "exp1", 10) for _ in range(2))
    assert node0.current() == node1.current() == 0
    # Both found 'exp1' closed: one moves the id on, the other follows, neither skips.
    assert node0.after_closed(0) == 1
    assert node1.after_closed(0) == 1
    assert node1.current() == 1 and torch_run_id("exp1", 1) == "exp1.1"
    assert RunGenerations(endpoint, "other", 10).current() == 0  # ids are apart


# Slow: two elastic launches (about 4 s each); the generation logic is tested above.
@pytest.mark.slow
def test_a_store_that_outlives_runs_takes_the_same_id_again(store_port):
    """torch closes a rendezvous when its run ends; the next start under the same id
    goes on to the next generation instead of failing with RendezvousClosedError."""
    endpoint = f"127.0.0.1:{store_port}"  # this machine's store: this node is a client
    first = launch(os.getpid, nproc=1, nnodes="1:1", rdzv_endpoint=endpoint, rdzv_id="same",
                   rdzv_timeout=30)
    again = launch(os.getpid, nproc=1, nnodes="1:1", rdzv_endpoint=endpoint,
                   rdzv_id="same", rdzv_timeout=30)
    assert set(first) == set(again) == {0} and first[0] != again[0]
    assert RunGenerations(endpoint, "same", 10).current() == 1
