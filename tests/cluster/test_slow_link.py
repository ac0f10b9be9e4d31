"""A slow link: node 1's link limited to 20 Mbit/s. `gpufleet bench allreduce` run across
the nodes measures it and names the node behind it, and so does a training run's own
diagnosis (the link probe at its start)."""

from __future__ import annotations

import re

import pytest

from gpufleet.monitor.diagnose import findings_for_run

from .conftest import PYTHON, node_env
from .nodes import TOY, start, wait

pytestmark = pytest.mark.timeout(240)


def _bench(netbed, tmp_path) -> str:
    procs = []
    for i in range(2):
        log = open(tmp_path / f"bench{i}.log", "w")
        procs.append(netbed.popen(i, [PYTHON, "-m", "gpufleet", "bench", "allreduce",
                                      "--nproc", "2", "--sizes", "256K,1M", "--iters", "3",
                                      "--warmup", "1", "--nnodes", "2", "--node-rank",
                                      str(i), "--master-addr", netbed.addr(0),
                                      "--master-port", "29500"],
                                  env=node_env({"COLUMNS": "160"}), cwd=tmp_path,
                                  stdout=log, stderr=log))
    codes = [p.wait(timeout=200) for p in procs]
    out = (tmp_path / "bench0.log").read_text()
    assert codes == [0, 0], out[-3000:] + (tmp_path / "bench1.log").read_text()[-3000:]
    return out


def _link_mbit(out: str) -> float:
    match = re.search(r"rank 2 \(node 1, [\d.]+\): ([\d,.]+) Mbit/s", out)
    assert match, out[-2000:]
    return float(match.group(1).replace(",", ""))


def test_bench_allreduce_across_nodes_measures_the_slow_link(netbed, tmp_path):
    netbed.rate_limit(1, 20.0)
    slow = _bench(netbed, tmp_path)
    # Two ranks a node: rank 1 shares node 0's loopback, ranks 2 and 3 sit behind the limit.
    assert f"rank 2 (node 1, {netbed.addr(1)})" in slow
    assert 10.0 < _link_mbit(slow) < 24.0, slow[-2000:]
    assert f"slowest: node 1 ({netbed.addr(1)})" in slow and "machine:" in slow


# Slow: under a loaded machine the link probe at the start measured all three nodes alike
# (twice in this session's full runs); the rule itself is unit-tested with probe results.
@pytest.mark.slow
@pytest.mark.parametrize("netbed", [3], indirect=True)
def test_the_run_diagnosis_names_the_node_behind_the_slow_link(netbed, tmp_path):
    # Three nodes, so the probe can tell which end of the slow links is slow (node 1 is
    # slow towards both others; nodes 0 and 2 reach each other at full speed). About
    # 330 KB of gradients per step: far past the limiter's 16 KB burst.
    netbed.rate_limit(1, 20.0)
    addr = netbed.addr(0)
    nodes = [start(netbed, i, [*TOY, "--data", "toyjob:make_data", "--max-steps", "20",
                               "--model.kwargs={hidden = 8192}", "--log.every", "5",
                               "--nproc", "1", "--batch-size", "8", "--strategy", "ddp",
                               "--checkpoint.save_final", "false", "--monitor.report",
                               "false", "--run-dir", "runs/slow", "--nnodes", "3",
                               "--node-rank", str(i), "--master-addr", addr,
                               "--master-port", "29500"], tmp_path)
             for i in range(3)]
    wait(nodes, timeout=180)
    findings = {f.rule: f for f in findings_for_run(tmp_path / "runs" / "slow")}
    assert "communication-bound" in findings, nodes[0].output()[-4000:]
    f = findings["communication-bound"]
    slow = re.search(rf"node 1 \({re.escape(netbed.addr(1))}\) reaches the others at "
                     r"([\d.]+) Mbit/s at best; node 0 at ([\d.]+) (G|M)bit/s", f.message)
    assert slow, f.message
    assert 10.0 < float(slow.group(1)) < 30.0  # the 20 Mbit/s limit, both ways
    assert f"check node 1 ({netbed.addr(1)})" in f.fix
    assert "link probe (" in nodes[0].output()  # rank 0 logged what it measured
