"""The rendezvous store off the training nodes (`gpufleet store` on a third node of the
bed): losing node 0 is then a node loss like any other. Node 1 carries on alone, and
node 0, started again, rejoins. The store-on-node-0 layout is in test_node_loss.py."""

from __future__ import annotations

import math
import subprocess
import time

import pytest

from .conftest import PYTHON, node_env
from .nodes import start, train_records, wait, wait_for
from .test_node_loss import elastic_args

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow,
              pytest.mark.parametrize("netbed", [3], indirect=True)]

STORE_NODE, PORT = 2, 29400  # the port elastic_args gives --rdzv-endpoint


def start_store(netbed, tmp_path) -> str:
    """`gpufleet store` on the bed's third node; its endpoint once it listens."""
    log = tmp_path / "store.log"
    with open(log, "w") as out:
        netbed.popen(STORE_NODE, [PYTHON, "-m", "gpufleet", "store", "--port", str(PORT)],
                     env=node_env(), stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while "listening on port" not in log.read_text(errors="replace"):
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    return netbed.addr(STORE_NODE)


def test_with_the_store_elsewhere_node_1_carries_on_after_node_0_is_killed(netbed, tmp_path):
    run = tmp_path / "runs" / "elastic"
    # The same job as the store-on-node-0 tests, its endpoint the store node's.
    args = elastic_args(start_store(netbed, tmp_path), "runs/elastic", steps=5000,
                        delay=0.004)
    nodes = [start(netbed, 0, args, tmp_path), start(netbed, 1, args, tmp_path)]

    def two_ranks_past_step_20():
        records = train_records(run)
        return records and records[-1]["step"] >= 22 and len(records[-1]["rank_phases"]) == 2
    wait_for(two_ranks_past_step_20, 120, nodes)
    for node in nodes:  # neither training node hosts the store
        assert "this node does not host the store" in node.output(), node.output()[-3000:]
    before = train_records(run)
    killed_at, step_at_kill = time.time(), before[-1]["step"]
    assert len(netbed.kill_node(0)) >= 2  # node 0's agent and its rank, at least

    def alone_again():
        return [r for r in train_records(run)[len(before):] if len(r["rank_phases"]) == 1]
    alone = wait_for(alone_again, 90, nodes[1:])
    resumed_from = alone[0]["step"] - 1
    assert resumed_from % 5 == 0 and step_at_kill - 5 <= resumed_from <= step_at_kill
    assert nodes[1].proc.poll() is None  # node 1's agent carried on
    assert "stopped answering while the job ran" not in nodes[1].output()

    nodes.append(start(netbed, 0, args, tmp_path, tag="-rejoined"))
    def together_again():
        records = train_records(run)
        return [r for r in records[len(before) + len(alone):] if len(r["rank_phases"]) == 2]
    together = wait_for(together_again, 120, nodes[1:])
    assert nodes[1].proc.poll() is None
    assert all(math.isfinite(r["loss"]) for r in train_records(run))
    print(f"\nnode 0 lost, the store elsewhere: node 1 trained alone "
          f"{alone[0]['time'] - killed_at:.1f} s after the kill, repeated "
          f"{step_at_kill - resumed_from} step(s); node 0 rejoined at step "
          f"{together[0]['step']}")


def test_a_store_that_is_not_running_is_named_at_start(netbed, tmp_path):
    """Nothing on the store node: the training node does not host it in its place, and
    says where nothing answers and what to start there."""
    endpoint = f"{netbed.addr(STORE_NODE)}:{PORT}"
    args = elastic_args(netbed.addr(STORE_NODE), "runs/none", steps=10, delay=0.0)
    args[args.index("--dist.rdzv_timeout") + 1] = "3"
    node = start(netbed, 0, args, tmp_path)
    [code] = wait([node], 60, expect=None)
    said = node.output()
    assert code == 1, said[-3000:]
    assert f"Nothing answers at the rendezvous endpoint {endpoint}" in said, said[-3000:]
    assert f"gpufleet store --port {PORT}" in said
    assert not (tmp_path / "runs" / "none").exists()  # a failed launch leaves no run dir
