"""The bed itself: nodes reach each other, links cut and come back, rates hold, kills reach
children, and nothing is left behind."""

from __future__ import annotations

import subprocess
import time

import pytest

from gpufleet.bench.netbed import NetBed, NetBedError, existing_namespaces, netbed_available

from .conftest import PYTHON, node_env

pytestmark = pytest.mark.timeout(60)

_SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 9000)); s.listen()
while True:
    c, _ = s.accept()
    while c.recv(1 << 16):
        pass
    c.close()
"""

_CLIENT = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], 9000), timeout=float(sys.argv[2]))
data, t = b"x" * (1 << 16), time.perf_counter()
for _ in range(int(sys.argv[3])):
    s.sendall(data)
s.shutdown(socket.SHUT_WR); s.recv(1)
print(time.perf_counter() - t)
"""


def _client(bed: NetBed, node: int, timeout: float = 3.0, chunks: int = 1):
    return subprocess.run(["ip", "netns", "exec", bed.ns(node), PYTHON, "-c", _CLIENT,
                           bed.addr(0), str(timeout), str(chunks)],
                          capture_output=True, text=True, env=node_env(), timeout=60)


def test_link_down_up_and_rate_limit(netbed):
    netbed.popen(0, [PYTHON, "-c", _SERVER], env=node_env())
    for _ in range(50):  # the server needs a moment to listen
        if _client(netbed, 1).returncode == 0:
            break
        time.sleep(0.1)
    else:
        pytest.fail("node 1 never reached node 0")
    netbed.link_down(1)
    assert _client(netbed, 1, timeout=1.0).returncode != 0  # silence, not a refusal
    netbed.link_up(1)
    assert _client(netbed, 1).returncode == 0
    # 2 MiB at 20 Mbit/s take >= 0.8 s; unlimited on loopback-speed veths far less.
    fast = float(_client(netbed, 1, chunks=32).stdout)
    netbed.rate_limit(1, 20.0)
    slow = float(_client(netbed, 1, chunks=32).stdout)
    netbed.rate_limit(1, None)
    assert slow > 0.7, f"20 Mbit/s link moved 2 MiB in {slow:.2f} s"
    assert slow > 3 * fast, (slow, fast)


def test_kill_node_reaches_children_and_close_removes_everything():
    if netbed_available():
        pytest.skip(netbed_available())
    with NetBed(2) as bed:
        parent = bed.popen(1, [PYTHON, "-c", "import subprocess, sys, time; subprocess.Popen("
                                             "[sys.executable, '-c', 'import time; "
                                             "time.sleep(600)'], start_new_session=True); "
                                             "time.sleep(600)"], env=node_env())
        time.sleep(1.0)
        killed = bed.kill_node(1)
        assert parent.pid in killed or parent.poll() is not None
        assert len(killed) >= 2, killed  # the parent and its detached child
        assert parent.wait(timeout=5) == -9
        names = bed.namespaces()
        assert set(names) <= set(existing_namespaces(bed.prefix))
    assert not existing_namespaces(bed.prefix)
    with pytest.raises(NetBedError, match="closed"):
        bed.popen(0, ["true"])


def test_bad_node_index_names_the_range(netbed):
    with pytest.raises(ValueError, match="give 0 to 1"):
        netbed.link_down(2)
