"""A lost node costs the survivors no restart: with --fault.snapshot_every, kill -9 every
process of node 1 mid-run and node 0 goes on in its own process from its in-memory
snapshot, at world size 1, reading exactly the rest of the epoch, with nothing on disk
to read."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from .nodes import TOY, start, train_records, wait_for

pytestmark = pytest.mark.timeout(300)

RECOVERED = re.compile(r"recovered in-process from the step-(\d+) snapshot, world (\d+) -> (\d+)")


def recovering_args(addr: str, run_dir: str, data: list[str], steps: int,
                    extra: tuple[str, ...] = ()) -> list[str]:
    """A 1:2-node elastic ddp job with a snapshot every step and no checkpoint before
    the end: whatever the survivor goes on from can only be in memory."""
    return [*TOY, *data, "--max-steps", str(steps), "--nproc", "1", "--batch-size", "16",
            "--strategy", "ddp", "--fault.snapshot_every", "1", "--checkpoint.every", "0",
            "--run-dir", run_dir, "--nnodes", "1:2", "--rdzv-endpoint", f"{addr}:29400",
            "--rdzv-id", "job", "--dist.rdzv_last_call_s", "2",
            "--dist.rdzv_keep_alive_s", "1", "--max-restarts", "3", *extra]


def reads(out: Path) -> dict[int, list[tuple[int, int]]]:
    """``{pid: [(sample index, world size when read), ...]}`` of every process that read."""
    return {int(p.stem): [tuple(map(int, line.split())) for line in p.read_text().split("\n")
                          if line]
            for p in out.glob("*.txt")}


def kill_node_1_past(netbed, run: Path, nodes: list, step: int) -> int:
    """Wait until both nodes trained past ``step``, kill node 1; the step reached."""
    def both_past():
        records = train_records(run)
        return records and records[-1]["step"] >= step and \
            len(records[-1]["rank_phases"]) == 2
    wait_for(both_past, 120, nodes)
    at = train_records(run)[-1]["step"]
    assert len(netbed.kill_node(1)) >= 2  # the agent and its rank, at least
    return at


def test_survivor_recovers_in_process_with_exact_data_and_no_disk_read(netbed, tmp_path):
    run, out = tmp_path / "runs" / "rec", tmp_path / "reads"
    data = ["--data", "toyjob:make_data_read_log",
            f"--data.kwargs={{out = '{out}', delay = 0.004}}"]
    args = recovering_args(netbed.addr(0), "runs/rec", data, steps=24)
    nodes = [start(netbed, 0, args, tmp_path)]
    time.sleep(0.5)  # node 0 hosts the store: let it listen first
    nodes.append(start(netbed, 1, args, tmp_path))
    at = kill_node_1_past(netbed, run, nodes, 3)
    # Trained to the end (the launcher then waits a while for the lost node's agent).
    wait_for(lambda: "step-0000024.pt" in nodes[0].output(), 120, nodes[:1])
    said = nodes[0].output()
    found = RECOVERED.search(said)
    assert found, said[-4000:]
    step, world_from, world_to = map(int, found.groups())
    assert (world_from, world_to) == (2, 1)
    assert at - 1 <= step <= at + 1  # at most the step under way is repeated
    assert "restarts the ranks from the newest checkpoint" not in said
    # One process on node 0 from start to end: no restart, and no file to resume from.
    per_process = reads(out)
    assert len(per_process) == 2, sorted(per_process)
    survivor = max(per_process.values(), key=len)
    lost = min(per_process.values(), key=len)
    assert all(world == 2 for _, world in lost)
    together = [i for i, world in survivor if world == 2]
    alone = [i for i, world in survivor if world == 1]
    # Steps 1..step at world 2 on both ranks (16 samples each), then the rest of the
    # epoch on the survivor alone: every sample of epoch 0 exactly once.
    rest = 256 - 2 * 16 * step
    lost_reads = [i for i, _ in lost]
    epoch = together[:16 * step] + lost_reads[:16 * step] + alone[:rest]
    assert sorted(epoch) == list(range(256))
    records = train_records(run)
    assert records[-1]["step"] == 24 and len(records[-1]["rank_phases"]) == 1
