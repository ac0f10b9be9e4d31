"""A node lost mid-run costs seconds, not a person: with --nnodes 1:2 --max-restarts K,
kill -9 every process of node 1; node 0 goes on alone from the newest checkpoint, and
node 1, started again, rejoins. Prints the seconds of progress lost and steps repeated."""

from __future__ import annotations

import math
import time

import pytest

from .nodes import TOY, start, train_records, wait, wait_for

pytestmark = pytest.mark.timeout(300)


def elastic_args(addr: str, run_dir: str, steps: int, delay: float) -> list[str]:
    """A 1:2-node elastic job whose steps take ~16 x ``delay`` seconds, a checkpoint
    every 5 steps, and rendezvous settings small enough for a test. Snapshots off: the
    agents' restart from the newest checkpoint, the path a run without in-memory
    snapshots takes (test_recovery.py covers the survivors going on in process)."""
    return [*TOY, "--data", "toyjob:make_slow_data", f"--data.kwargs={{delay = {delay}}}",
            "--max-steps", str(steps), "--nproc", "1", "--batch-size", "16",
            "--strategy", "ddp", "--checkpoint.every", "5", "--run-dir", run_dir,
            "--nnodes", "1:2", "--rdzv-endpoint", f"{addr}:29400", "--rdzv-id", "job",
            "--dist.rdzv_last_call_s", "2", "--dist.rdzv_keep_alive_s", "1",
            "--max-restarts", "3", "--fault.snapshot_every", "0"]


def test_survivor_goes_on_alone_and_the_lost_node_rejoins(netbed, tmp_path):
    run = tmp_path / "runs" / "elastic"
    # Long enough to outlast the rejoin on a busy machine; the bed ends it afterwards.
    args = elastic_args(netbed.addr(0), "runs/elastic", steps=5000, delay=0.004)
    nodes = [start(netbed, 0, args, tmp_path)]
    time.sleep(0.5)  # node 0 hosts the store: let it listen first
    nodes.append(start(netbed, 1, args, tmp_path))

    def two_ranks_past_step_20():
        records = train_records(run)
        return records and records[-1]["step"] >= 22 and len(records[-1]["rank_phases"]) == 2
    wait_for(two_ranks_past_step_20, 120, nodes)
    before = train_records(run)
    killed_at, step_at_kill = time.time(), before[-1]["step"]
    assert len(netbed.kill_node(1)) >= 2  # the agent and its rank, at least

    def alone_again():
        return [r for r in train_records(run)[len(before):] if len(r["rank_phases"]) == 1]
    alone = wait_for(alone_again, 90, nodes[:1])
    resumed_from = alone[0]["step"] - 1
    assert resumed_from % 5 == 0 and step_at_kill - 5 <= resumed_from <= step_at_kill

    nodes.append(start(netbed, 1, args, tmp_path, tag="-rejoined"))
    def together_again():
        records = train_records(run)
        return [r for r in records[len(before) + len(alone):] if len(r["rank_phases"]) == 2]
    together = wait_for(together_again, 120, nodes)
    assert nodes[0].proc.poll() is None  # node 0's agent never gave up
    records = train_records(run)
    solo = [r for r in records[len(before):] if len(r["rank_phases"]) == 1]
    last_solo, rejoined_from = solo[-1]["step"], together[0]["step"] - 1
    # Both nodes start again from the newest checkpoint node 0 wrote alone.
    assert last_solo - 5 <= rejoined_from <= last_solo
    assert all(math.isfinite(r["loss"]) for r in records)
    back_at = next(r["time"] for r in solo if r["step"] >= step_at_kill)
    print(f"\nnode loss: node 0 trained again {alone[0]['time'] - killed_at:.1f} s after the "
          f"kill, repeated {step_at_kill - resumed_from} step(s) (resumed from step "
          f"{resumed_from}, killed at {step_at_kill}), was back at step {step_at_kill} "
          f"{back_at - killed_at:.1f} s after the kill; node 1 rejoined at step "
          f"{together[0]['step']}")


# Slow: the node-loss test above keeps the bed's elastic path in the default run.
@pytest.mark.slow
def test_losing_the_store_host_ends_the_survivor_with_what_happened(netbed, tmp_path):
    """Node 0 hosts the rendezvous store: killed mid-run, node 1 cannot go on. Its
    launcher ends promptly and says the store was lost while the job ran (not that the
    nodes never met), with the way back."""
    run = tmp_path / "runs" / "elastic"
    args = elastic_args(netbed.addr(0), "runs/elastic", steps=5000, delay=0.004)
    nodes = [start(netbed, 0, args, tmp_path)]
    time.sleep(0.5)
    nodes.append(start(netbed, 1, args, tmp_path))

    def two_ranks_training():
        records = train_records(run)
        return records and len(records[-1]["rank_phases"]) == 2
    wait_for(two_ranks_training, 120, nodes)
    netbed.kill_node(0)
    [code] = wait(nodes[1:], 60, expect=None)
    said = nodes[1].log.read_text()
    assert code != 0
    assert "stopped answering while the job ran" in said, said[-3000:]
    assert "--resume auto" in said and "did not meet" not in said
