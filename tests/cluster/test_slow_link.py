"""A slow link: node 1's link limited to 20 Mbit/s. `gpufleet bench allreduce` run across
the nodes measures it and names the node behind it."""

from __future__ import annotations

import re

import pytest

from .conftest import PYTHON, node_env

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
