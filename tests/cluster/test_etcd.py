"""No node the run cannot lose: with --rdzv-backend etcd and a 3-member etcd cluster (one
member per node of the bed, started with `gpufleet etcd`), kill -9 node 0, the node that
started the job and whose rank was rank 0, mid-run: node 1 goes on in its own process
from its in-memory snapshot, at most one step repeated, reading exactly the rest of the
epoch. Prints the seconds it took."""

from __future__ import annotations

import time

import pytest

from .etcdbed import EtcdBed, etcd_missing
from .nodes import TOY, start, train_records, wait, wait_for
from .test_recovery import JOINED, RECOVERED, reads

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def etcd_bed(netbed, tmp_path):
    """A member on each node of the bed; skips without etcd; always torn down."""
    reason = etcd_missing()
    if reason:
        pytest.skip(reason)
    bed = EtcdBed(netbed, tmp_path / "etcd", list(range(netbed.nodes)))
    try:
        yield bed
    finally:
        bed.close()


def etcd_args(endpoint: str, run_dir: str, data: list[str], steps: int, nnodes: str = "1:2",
              extra: tuple[str, ...] = ()) -> list[str]:
    """An elastic job on the etcd cluster, a snapshot every step, no checkpoint before
    the end: whatever a survivor goes on from can only be in memory."""
    return [*TOY, *data, "--max-steps", str(steps), "--nproc", "1", "--batch-size", "16",
            "--strategy", "ddp", "--fault.snapshot_every", "1", "--checkpoint.every", "0",
            "--run-dir", run_dir, "--nnodes", nnodes, "--rdzv-backend", "etcd",
            "--rdzv-endpoint", endpoint, "--rdzv-id", "job", "--dist.rdzv_last_call_s", "2",
            "--dist.rdzv_keep_alive_s", "1", "--max-restarts", "3", *extra]


def kill_past(netbed, run, nodes, node: int, step: int, world: int) -> tuple[int, float]:
    """Wait until ``world`` ranks trained past ``step``, kill ``node``; the step then
    and the time of the kill."""
    def all_past():
        records = train_records(run)
        return records and records[-1]["step"] >= step and \
            len(records[-1]["rank_phases"]) == world
    wait_for(all_past, 120, nodes)
    at = train_records(run)[-1]["step"]
    killed_at = time.time()
    assert len(netbed.kill_node(node)) >= 3  # its etcd member, the agent and its rank
    return at, killed_at


@pytest.mark.parametrize("netbed", [3], indirect=True)
def test_losing_node_0_is_survived_in_process(netbed, etcd_bed, tmp_path):
    run, out = tmp_path / "runs" / "e", tmp_path / "reads"
    data = ["--data", "toyjob:make_data_read_log",
            f"--data.kwargs={{out = '{out}', delay = 0.004}}"]
    # 16 steps: node 1 alone (16 samples a step) reads the rest of epoch 0 by then,
    # whatever step it goes on from.
    args = etcd_args(etcd_bed.endpoint, "runs/e", data, steps=16)
    nodes = [start(netbed, 0, args, tmp_path), start(netbed, 1, args, tmp_path)]
    _, killed_at = kill_past(netbed, run, nodes, 0, 3, 2)
    # Node 1 trains to the end alone, writing the metrics as the new rank 0 (its
    # launcher then waits a while for node 0's agent: the test does not).
    wait_for(lambda: (train_records(run) or [{}])[-1].get("step") == 16, 60, nodes[1:])
    said = nodes[1].output()
    found = RECOVERED.search(said)
    assert found, said[-4000:]
    step, world_from, world_to = map(int, found.groups())
    assert (world_from, world_to) == (2, 1)
    assert "restarts the ranks from the newest checkpoint" not in said
    # At most one step both ranks finished is trained again (see test_recovery.py).
    both = max(r["step"] for r in train_records(run) if len(r["rank_phases"]) == 2)
    assert both - 1 <= step <= both + 1, (step, both, said[-3000:])
    # Node 1's one process from start to end; every sample of epoch 0 read once.
    per_process = reads(out)
    assert len(per_process) == 2, sorted(per_process)
    survivor = max(per_process.values(), key=len)
    lost = min(per_process.values(), key=len)
    together = [i for i, world in survivor if world == 2]
    alone = [i for i, world in survivor if world == 1]
    epoch = together[:16 * step] + [i for i, _ in lost][:16 * step] + \
        alone[:256 - 32 * step]
    assert sorted(epoch) == list(range(256))
    records = train_records(run)
    assert records[-1]["step"] == 16 and len(records[-1]["rank_phases"]) == 1
    back = next(r["time"] for r in records if len(r["rank_phases"]) == 1)
    print(f"\netcd, node 0 lost: node 1 trained again {back - killed_at:.1f} s after the "
          f"kill, from the step-{step} snapshot ({max(0, both - step)} step(s) repeated)")


@pytest.mark.slow
@pytest.mark.parametrize("netbed", [3], indirect=True)
def test_losing_a_member_only_node_changes_nothing(netbed, etcd_bed, tmp_path):
    """Node 2 runs only an etcd member: killed mid-run, the two nodes train on, at world
    2, to the end, on the two members left."""
    run = tmp_path / "runs" / "m"
    data = ["--data", "toyjob:make_slow_data", "--data.kwargs={delay = 0.004}"]
    args = etcd_args(etcd_bed.endpoint, "runs/m", data, steps=40)
    nodes = [start(netbed, 0, args, tmp_path), start(netbed, 1, args, tmp_path)]
    def both_past_5():
        records = train_records(run)
        return records and records[-1]["step"] >= 5 and len(records[-1]["rank_phases"]) == 2
    wait_for(both_past_5, 120, nodes)
    assert len(netbed.kill_node(2)) >= 1
    wait(nodes, 120)
    records = train_records(run)
    assert records[-1]["step"] == 40 and len(records[-1]["rank_phases"]) == 2
    assert not RECOVERED.search(nodes[0].output() + nodes[1].output())


@pytest.mark.slow
@pytest.mark.parametrize("netbed", [3], indirect=True)
def test_node_0_lost_then_a_node_joins_the_survivor(netbed, etcd_bed, tmp_path):
    """Node 0 killed: node 1 goes on alone; node 0 started again (its etcd member first,
    from its data folder) joins node 1's live rank in process."""
    run = tmp_path / "runs" / "j"
    # About 0.5 s a step, 160 steps: node 1 still trains alone when node 0's new rank is
    # up, which takes up to a minute after the loss on a loaded machine (the member, the
    # launcher and the rank each import torch).
    data = ["--data", "toyjob:make_slow_data", "--data.kwargs={delay = 0.03, n = 4096}"]
    args = etcd_args(etcd_bed.endpoint, "runs/j", data, steps=160,
                     extra=("--dist.rdzv_poll_s", "0.1"))
    nodes = [start(netbed, 0, args, tmp_path), start(netbed, 1, args, tmp_path)]
    kill_past(netbed, run, nodes, 0, 3, 2)
    wait_for(lambda: RECOVERED.search(nodes[1].output()), 60, nodes[1:])
    etcd_bed.start(0)
    etcd_bed.wait_healthy([0, 1, 2])
    joined_at = time.time()
    nodes.append(start(netbed, 0, args, tmp_path, tag="-again"))
    wait(nodes[1:], 180)
    said = nodes[1].output()
    joined = JOINED.search(said)
    assert joined, said[-4000:]
    assert (joined.group(1), joined.group(3), joined.group(4)) == ("1", "1", "2")
    assert "restarts the ranks" not in said + nodes[2].output()
    records = train_records(run)
    assert records[-1]["step"] == 160 and len(records[-1]["rank_phases"]) == 2
    together = next(r["time"] for r in records
                    if r["time"] > joined_at and len(r["rank_phases"]) == 2)
    print(f"\netcd: node 0 started again trained with node 1 {together - joined_at:.1f} s "
          "after its start")


@pytest.mark.slow
@pytest.mark.parametrize("netbed", [3], indirect=True)
def test_2_to_3_nodes_lose_node_0(netbed, etcd_bed, tmp_path):
    """--nnodes 2:3 on three nodes: node 0 killed, nodes 1 and 2 go on in process."""
    run = tmp_path / "runs" / "t"
    data = ["--data", "toyjob:make_slow_data", "--data.kwargs={delay = 0.004, n = 768}"]
    args = etcd_args(etcd_bed.endpoint, "runs/t", data, steps=24, nnodes="2:3")
    nodes = [start(netbed, i, args, tmp_path) for i in range(3)]
    kill_past(netbed, run, nodes, 0, 3, 3)
    wait_for(lambda: all("step-0000024" in n.output() for n in nodes[1:2]), 150, nodes[1:])
    said = nodes[1].output() + nodes[2].output()
    found = RECOVERED.search(said)
    assert found and found.groups()[1:] == ("3", "2"), said[-4000:]
    assert "restarts the ranks from the newest checkpoint" not in said
    records = train_records(run)
    assert records[-1]["step"] == 24 and len(records[-1]["rank_phases"]) == 2
