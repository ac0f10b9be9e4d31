"""A lost node costs the survivors no restart: with --fault.snapshot_every, kill -9 every
process of node 1 mid-run and node 0 goes on in its own process from its in-memory
snapshot, at world size 1, reading exactly the rest of the epoch, with nothing on disk
to read."""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import pytest
import torch

from gpufleet.data.audit import audit
from gpufleet.data.sampler import ResumableDistributedSampler
from gpufleet.fault.receipt import PHASES, Receipt, read_receipts
from gpufleet.train.checkpoint import format as ckpt

from .nodes import TOY, final_weights, start, train_records, wait, wait_for

pytestmark = pytest.mark.timeout(300)

RECOVERED = re.compile(r"recovered in-process from the step-(\d+) snapshot, world (\d+) -> (\d+)")
TOOK = re.compile(r"recovered in-process .* in ([0-9.]+) s; no checkpoint read")
JOINED = re.compile(r"(\d+) new rank\(s\) joined at step (\d+), world (\d+) -> (\d+)")


def recovering_args(addr: str, run_dir: str, data: list[str], steps: int,
                    extra: tuple[str, ...] = (), strategy: str = "ddp") -> list[str]:
    """A 1:2-node elastic job with a snapshot every step and no checkpoint before the
    end: whatever the survivor goes on from can only be in memory."""
    return [*TOY, *data, "--max-steps", str(steps), "--nproc", "1", "--batch-size", "16",
            "--strategy", strategy, "--fault.snapshot_every", "1", "--checkpoint.every", "0",
            "--run-dir", run_dir, "--nnodes", "1:2", "--rdzv-endpoint", f"{addr}:29400",
            "--rdzv-id", "job", "--dist.rdzv_last_call_s", "2",
            "--dist.rdzv_keep_alive_s", "1", "--max-restarts", "3", *extra]


def reads(out: Path) -> dict[int, list[tuple[int, int]]]:
    """``{pid: [(sample index, world size when read), ...]}`` of every process that read."""
    return {int(p.stem): [tuple(map(int, line.split())) for line in p.read_text().split("\n")
                          if line]
            for p in out.glob("*.txt")}


def kill_node_1_past(netbed, run: Path, nodes: list, step: int, world: int = 2) -> int:
    """Wait until both nodes (``world`` ranks) trained past ``step``, kill node 1; the
    step reached."""
    def both_past():
        records = train_records(run)
        return records and records[-1]["step"] >= step and \
            len(records[-1]["rank_phases"]) == world
    wait_for(both_past, 120, nodes)
    at = train_records(run)[-1]["step"]
    assert len(netbed.kill_node(1)) >= 2  # the agent and its rank, at least
    return at


@pytest.mark.parametrize("strategy", ["ddp", "fsdp",
                                      pytest.param("hsdp", marks=pytest.mark.slow)])
def test_survivor_recovers_in_process_with_exact_data_and_no_disk_read(netbed, tmp_path,
                                                                      strategy):
    """ddp: the survivor restores its own snapshot. fsdp: it held only its shards; it
    joins them with the lost rank's, from the partner copy it holds, and shards the
    whole state again over the new world. hsdp (one rank a node: whole replicas across
    the nodes): its own copy is a whole shard set, sharded again over the new mesh."""
    run, out = tmp_path / "runs" / "rec", tmp_path / "reads"
    # ddp: node 1 killed from outside at any moment. Sharded: a loss while a snapshot is
    # being sent leaves no whole copy of the lost rank's shards of one step (documented;
    # within the memory bound of one own and one partner copy, the agents' restart then
    # takes over), so node 1 ends itself where no send can be under way: a snapshot
    # every 3 steps, and rank 1's agent and rank killed as the rank reads its 129th
    # sample (step 9's batch, a step after snapshot 6's send began).
    sharded = strategy != "ddp"
    die = ", die_at = 129" if sharded else ""
    data = ["--data", "toyjob:make_data_read_log",
            f"--data.kwargs={{out = '{out}', delay = 0.004{die}}}"]
    args = recovering_args(netbed.addr(0), "runs/rec", data, steps=24, strategy=strategy,
                           extra=("--fault.snapshot_every", "3") if sharded else ())
    nodes = [start(netbed, 0, args, tmp_path)]
    time.sleep(0.5)  # node 0 hosts the store: let it listen first
    nodes.append(start(netbed, 1, args, tmp_path))
    if not sharded:
        kill_node_1_past(netbed, run, nodes, 3)
    # Trained to the end (the launcher then waits a while for the lost node's agent).
    wait_for(lambda: "step-0000024" in nodes[0].output(), 120, nodes[:1])
    said = nodes[0].output()
    found = RECOVERED.search(said)
    assert found, said[-4000:]
    step, world_from, world_to = map(int, found.groups())
    assert (world_from, world_to) == (2, 1)
    # At most one step the two ranks finished is trained again. The log's records of
    # steps at world 2 end with the last step whose log line both ranks reduced (the
    # metrics file can lag the kill, so the step seen when killing is not that step). A
    # kill after both ranks' gradient all-reduce of the next step but before its log
    # line leaves that step finished, and snapshotted, with no record at world 2: the
    # survivor rightly goes on from it (the data check below proves node 1 read its
    # batch).
    both = max(r["step"] for r in train_records(run) if len(r["rank_phases"]) == 2)
    assert both - 1 <= step <= both + 1 if not sharded else \
        (step, both) in ((6, 7), (6, 8)), (step, both, said[-3000:])
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
    # The run's own ledger shows it too: what the lost rank and the survivor read after
    # the snapshot's step, before the recovery, does not count.
    report = audit(run)
    assert report.ok and report.epochs[0].finished, report.lines()
    assert report.epochs[0].once == 256 and any(e.startswith(("recovery", "regroup"))
                                                for e in report.events), report.lines()
    records = train_records(run)
    assert records[-1]["step"] == 24 and len(records[-1]["rank_phases"]) == 1
    # Its receipt: rank 1 lost, found by the failed collective, the survivors' agreement
    # in the store, nothing sent (ddp: its own copy; fsdp: the lost rank's shards are
    # the partner copy it holds), the steps it had finished past the snapshot's, and
    # the samples the ledger says were read in them (on both ranks: the survivor's
    # batches at world 2 past the snapshot's steps, and those the lost rank had
    # finished reading; one it was reading when killed was never handed out).
    [receipt] = read_receipts(run)
    check_receipt(receipt, "recovery", step, (2, 1), said, float(TOOK.search(said).group(1)))
    assert receipt.ranks == [1] and receipt.detected_by.startswith("a failed collective")
    assert receipt.detection_s is not None and receipt.detection_s >= 0
    assert "agree" in receipt.phases and receipt.transfers == []
    taken = len(together) // 16  # steps whose batch the survivor took at world 2
    assert taken - step - receipt.steps_repeated in (0, 1), (taken, step, receipt)
    assert receipt.steps_repeated <= (1 if not sharded else 2)
    extra = len(lost_reads) - 16 * step
    survivor_part = 16 * (taken - step)
    assert survivor_part + 16 * (extra // 16) <= receipt.samples_replayed \
        <= survivor_part + 16 * -(-extra // 16), (receipt, taken, extra)


def check_receipt(receipt: Receipt, kind: str, step: int, worlds: tuple[int, int],
                  said: str, total_s: float) -> None:
    """What every receipt holds: its phases, in order and summing to no more than its
    total (the time the log line gave, to its two decimals), a re-warm measured against
    the median step before, its one log line."""
    assert (receipt.kind, receipt.step, (receipt.world_from, receipt.world_to)) == \
        (kind, step, worlds), receipt
    assert list(receipt.phases) == [p for p in PHASES if p in receipt.phases]
    assert {"leave", "regroup", "restore"} <= set(receipt.phases), receipt.phases
    assert all(s >= 0 for s in receipt.phases.values())
    assert sum(receipt.phases.values()) <= receipt.total_s + 1e-6, receipt
    assert abs(receipt.total_s - total_s) <= 0.006, (receipt.total_s, total_s)
    assert receipt.median_step_s and receipt.median_step_s > 0
    assert receipt.rewarm_s is not None and receipt.rewarm_steps >= 1, receipt
    assert receipt.line() in said


def phases(got: list[tuple[int, int]]) -> list[tuple[int, list[int]]]:
    """A process's reads split where the world size changed: ``[(world, [index, ...])]``."""
    out: list[tuple[int, list[int]]] = []
    for index, world in got:
        if not out or out[-1][0] != world:
            out.append((world, []))
        out[-1][1].append(index)
    return out


@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_a_node_started_again_joins_the_live_rank_with_exact_data_and_no_disk_read(
        netbed, tmp_path, strategy):
    """Node 1 killed: node 0 goes on alone in process. Node 1 started again joins it:
    node 0's rank keeps its process and loses no step, node 1's new rank takes rank 0's
    state over the new process group (no checkpoint is on disk to read before the end),
    and the samples of the epoch are read once each across 2 -> 1 -> 2 ranks. fsdp: the
    live rank's shards, joined, are sharded again over both."""
    run, out, steps, n = tmp_path / "runs" / "grow", tmp_path / "reads", 100, 4096
    data = ["--data", "toyjob:make_data_read_log",
            # Alone, node 0 reads slowly (0.8 s a step): on a loaded machine it would
            # otherwise finish its 100 steps before the restarted node 1 is up to join.
            f"--data.kwargs={{out = '{out}', delay = 0.01, n = {n}, alone_delay = 0.05}}"]
    args = recovering_args(netbed.addr(0), "runs/grow", data, steps,
                           ("--dist.rdzv_poll_s", "0.1"), strategy)
    nodes = [start(netbed, 0, args, tmp_path)]
    time.sleep(0.5)
    nodes.append(start(netbed, 1, args, tmp_path))
    kill_node_1_past(netbed, run, nodes, 3)
    wait_for(lambda: RECOVERED.search(nodes[0].output()), 60, nodes[:1])
    nodes.append(start(netbed, 1, args, tmp_path, tag="-again"))
    wait(nodes[::2], 180)
    said, again = nodes[0].output(), nodes[2].output()
    joined = JOINED.search(said)
    assert joined, said[-4000:]
    s1, s2 = int(RECOVERED.search(said).group(1)), int(joined.group(2))
    assert (joined.group(1), joined.group(3), joined.group(4)) == ("1", "1", "2")
    assert f"joined the 1 live rank(s) at step {s2}" in again, again[-4000:]
    assert not re.search(r"resumed from \S+\.pt", said + again)  # no file read
    assert "restarts the ranks" not in said + again
    # Node 0: one process throughout, at world 2, then 1, then 2 again; node 1: two.
    by_process = {pid: phases(got) for pid, got in reads(out).items()}
    assert len(by_process) == 3, sorted(by_process)
    [survivor] = [p for p in by_process.values() if len(p) == 3]
    assert [world for world, _ in survivor] == [2, 1, 2]
    lost, new = sorted((p for p in by_process.values() if len(p) == 1),
                       key=lambda p: len(p[0][1]))
    used = (survivor[0][1][:16 * s1] + lost[0][1][:16 * s1]
            + survivor[1][1][:16 * (s2 - s1)]
            + survivor[2][1][:16 * (steps - s2)] + new[0][1][:16 * (steps - s2)])
    # The first samples of epoch 0's order, each once (the epoch is longer than the run).
    order = list(ResumableDistributedSampler(n, seed=1337))
    assert len(used) == 32 * s1 + 16 * (s2 - s1) + 32 * (steps - s2) < n
    assert sorted(used) == sorted(order[:len(used)])
    records = train_records(run)
    assert records[-1]["step"] == steps and len(records[-1]["rank_phases"]) == 2
    # Two receipts: the loss, then the join, whose state went from rank 0 to the new
    # rank 1 over the bed's link (the toy's state is too small to judge against it).
    # The live rank repeated no step and read no sample again.
    loss, join = read_receipts(run)
    assert (loss.kind, loss.step) == ("recovery", s1)
    check_receipt(join, "join", s2, (1, 2), said, float(
        re.search(r"joined at step \d+, world 1 -> 2, in ([0-9.]+) s", said).group(1)))
    assert join.ranks == [1] and join.steps_repeated == 0 and join.samples_replayed == 0
    assert join.detection_s is not None and join.detection_s >= 0
    [sent] = join.transfers
    assert (sent.peer, sent.rank) == (0, 1) and sent.bytes > 0 and sent.seconds > 0
    assert sent.interface, sent  # the one the bed node's process group talks over
    assert sent.verdict == "not judged" and "MiB" in sent.why, sent
    # report.html, written at the end, lists both.
    html = (run / "report.html").read_text()
    table = html.split("<h2>Recoveries and restarts</h2>")[1].split("</table>")[0]
    assert table.count("<tr><td>") == 2, table
    assert f"recovery at step {s1}; rank(s) 1 lost" in table
    assert f"join at step {s2}; rank(s) 1 joined" in table


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_weights_after_a_node_joins_equal_its_step_checkpoint_resumed_on_both_nodes(
        netbed, tmp_path, strategy):
    """2 -> 1 -> 2 ranks in process: the final weights equal, bit for bit, those of the
    same run's checkpoint of the step the node joined at, resumed on both nodes by the
    agents' restart (what the node's return did before)."""
    data = ["--data", "toyjob:make_slow_data", "--data.kwargs={delay = 0.01, n = 4096}"]
    steps, addr = 80, netbed.addr(0)
    args = recovering_args(addr, "runs/g", data, steps, (
        "--checkpoint.every", "10", "--checkpoint.keep_last", "50",
        "--dist.rdzv_poll_s", "0.1"), strategy)
    nodes = [start(netbed, 0, args, tmp_path, tag="-g")]
    time.sleep(0.5)
    nodes.append(start(netbed, 1, args, tmp_path, tag="-g"))
    kill_node_1_past(netbed, tmp_path / "runs" / "g", nodes, 3)
    wait_for(lambda: RECOVERED.search(nodes[0].output()), 60, nodes[:1])
    nodes.append(start(netbed, 1, args, tmp_path, tag="-g-again"))
    wait(nodes[::2], 180)
    joined = JOINED.search(nodes[0].output())
    assert joined, nodes[0].output()[-4000:]
    step = int(joined.group(2))  # a preemption check: a multiple of 10, so a checkpoint
    resumed = tmp_path / "runs" / "r"
    shutil.copytree(tmp_path / "runs" / "g", resumed)
    for path in ckpt.list_checkpoints(resumed):
        if int(re.search(r"step-(\d+)", path.name).group(1)) > step:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    again = recovering_args(addr, "runs/r", data, steps, (
        "--rdzv-id", "again", "--resume", "latest", "--checkpoint.every", "10"), strategy)
    nodes = [start(netbed, 0, again, tmp_path, tag="-r")]
    time.sleep(0.5)
    nodes.append(start(netbed, 1, again, tmp_path, tag="-r"))
    wait(nodes, 180)
    assert f"at step {step}" in nodes[0].output()
    grown, reference = final_weights(tmp_path / "runs" / "g"), final_weights(resumed)
    assert grown.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(grown[name], tensor), name


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_weights_after_recovery_equal_a_run_resumed_at_the_new_world_size(netbed, tmp_path,
                                                                         strategy):
    """Killed at step S: the survivor ends with the weights, bit for bit, of the
    uninterrupted 2-node run's step-S checkpoint resumed on one node to the same step
    (fsdp: a sharded checkpoint, resharded by torch's distributed checkpoint on load)."""
    data = ["--data", "toyjob:make_slow_data", "--data.kwargs={delay = 0.004}"]
    steps, addr = 12, netbed.addr(0)
    # The uninterrupted run, a checkpoint every step.
    straight = recovering_args(addr, "runs/u", data, steps,
                               ("--checkpoint.every", "1", "--checkpoint.keep_last", "50"),
                               strategy)
    nodes = [start(netbed, 0, straight, tmp_path, tag="-u")]
    time.sleep(0.5)
    nodes.append(start(netbed, 1, straight, tmp_path, tag="-u"))
    wait(nodes, 180)
    # The same run, node 1 killed: node 0 goes on alone from its snapshot.
    cut = recovering_args(addr, "runs/a", data, steps, ("--rdzv-id", "cut"), strategy)
    nodes = [start(netbed, 0, cut, tmp_path, tag="-a")]
    time.sleep(0.5)
    nodes.append(start(netbed, 1, cut, tmp_path, tag="-a"))
    kill_node_1_past(netbed, tmp_path / "runs" / "a", nodes, 3)
    wait(nodes[:1], 180)  # the agent then waits a while for the lost node's agent
    found = RECOVERED.search(nodes[0].output())
    assert found, nodes[0].output()[-4000:]
    step = int(found.group(1))
    # The uninterrupted run's step-S checkpoint, resumed on one node to the end.
    resumed = tmp_path / "runs" / "c"
    shutil.copytree(tmp_path / "runs" / "u", resumed)
    for path in ckpt.list_checkpoints(resumed):
        if int(re.search(r"step-(\d+)", path.name).group(1)) > step:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    again = recovering_args(addr, "runs/c", data, steps, ("--rdzv-id", "again",
                                                          "--resume", "latest"), strategy)
    node = start(netbed, 0, again, tmp_path, tag="-c")
    wait([node], 180)
    assert f"at step {step}" in node.output()
    recovered, reference = final_weights(tmp_path / "runs" / "a"), final_weights(resumed)
    assert recovered.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(recovered[name], tensor), name


@pytest.mark.slow
def test_hsdp_with_two_ranks_a_node_goes_on_from_the_survivors_own_shards(netbed, tmp_path):
    """hsdp over 2 nodes of 2 ranks: each node holds a whole replica, sharded over its
    two ranks. Node 1 killed at any moment: node 0's two ranks put the whole state
    together from their own shards (no partner copy needed) and go on at world 2, as
    hsdp within the node again, every sample of the epoch's prefix read once."""
    run, out, steps, n = tmp_path / "runs" / "h", tmp_path / "reads", 40, 4096
    data = ["--data", "toyjob:make_data_read_log",
            f"--data.kwargs={{out = '{out}', delay = 0.01, n = {n}}}"]
    args = recovering_args(netbed.addr(0), "runs/h", data, steps, ("--nproc", "2"), "hsdp")
    nodes = [start(netbed, 0, args, tmp_path)]
    time.sleep(0.5)
    nodes.append(start(netbed, 1, args, tmp_path))
    kill_node_1_past(netbed, run, nodes, 3, world=4)
    wait_for(lambda: f"step-{steps:07d}" in nodes[0].output(), 150, nodes[:1])
    said = nodes[0].output()
    found = RECOVERED.search(said)
    assert found, said[-4000:]
    step, world_from, world_to = map(int, found.groups())
    assert (world_from, world_to) == (4, 2)
    assert "restarts the ranks from the newest checkpoint" not in said
    # Built over both nodes' replicas, then again over node 0's two ranks (a node's ranks
    # shard; the regroup plans the mesh with the node's rank count).
    assert "sharded one by one over dp_replicate=2 x dp_shard=2" in said
    assert "sharded one by one over dp_shard=2, then the root" in said
    by_process = {pid: phases(got) for pid, got in reads(out).items()}
    assert len(by_process) == 4, sorted(by_process)
    survivors = [p for p in by_process.values() if len(p) == 2]
    lost = [p for p in by_process.values() if len(p) == 1]
    assert len(survivors) == 2 and [w for w, _ in survivors[0]] == [4, 2]
    used = [i for p in survivors for i in p[0][1][:16 * step] + p[1][1][:16 * (steps - step)]]
    used += [i for p in lost for i in p[0][1][:16 * step]]
    # The first samples of epoch 0's order, each once (the epoch is longer than the run).
    order = list(ResumableDistributedSampler(n, seed=1337))
    assert len(used) == 64 * step + 32 * (steps - step) < n
    assert sorted(used) == sorted(order[:len(used)])
    records = train_records(run)
    assert records[-1]["step"] == steps and len(records[-1]["rank_phases"]) == 2


@pytest.mark.slow
def test_without_a_snapshot_the_agent_restarts_the_survivor_from_the_checkpoint(
        netbed, tmp_path):
    """No snapshot taken yet when node 1 dies: in-process recovery says why it cannot go
    on, the rank ends, and its agent restarts it from the newest checkpoint alone."""
    run = tmp_path / "runs" / "fb"
    data = ["--data", "toyjob:make_slow_data", "--data.kwargs={delay = 0.004}"]
    args = recovering_args(netbed.addr(0), "runs/fb", data, 5000,
                           ("--fault.snapshot_every", "1000", "--checkpoint.every", "2"))
    nodes = [start(netbed, 0, args, tmp_path)]
    time.sleep(0.5)
    nodes.append(start(netbed, 1, args, tmp_path))
    kill_node_1_past(netbed, run, nodes, 5)
    seen = len(train_records(run))

    def alone():
        return [r for r in train_records(run)[seen:] if len(r["rank_phases"]) == 1]
    wait_for(alone, 120, nodes[:1])
    said = nodes[0].output()
    assert "in-process recovery failed (RecoveryFailed: the ranks left hold no in-memory " \
           "snapshot of one step)" in said, said[-4000:]
    assert "the elastic agent restarts the ranks from the newest checkpoint" in said
    assert re.search(r"resumed from \S+step-\d+\.pt at step \d+", said)
    assert not RECOVERED.search(said)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_cut_off_node_is_left_behind_in_process_once_its_heartbeat_stops(netbed, tmp_path,
                                                                          strategy):
    """Node 1's link cut (no connection closes): the heartbeat names it after 5 s, rank
    0 aborts its collective and goes on alone in process from its snapshot (fsdp: and
    its partner copy of node 1's shards)."""
    run = tmp_path / "runs" / "cut"
    data = ["--data", "toyjob:make_slow_data", "--data.kwargs={delay = 0.004}"]
    args = recovering_args(netbed.addr(0), "runs/cut", data, 60, (
        "--dist.timeout", "120", "--fault.heartbeat_timeout_s", "5",
        "--fault.watchdog_poll_s", "0.5"), strategy)
    nodes = [start(netbed, 0, args, tmp_path)]
    time.sleep(0.5)
    nodes.append(start(netbed, 1, args, tmp_path))

    def past_step_5():
        records = train_records(run)
        return records and records[-1]["step"] >= 5
    wait_for(past_step_5, 120, nodes)
    seen, cut_at = len(train_records(run)), time.time()
    netbed.link_down(1)
    wait_for(lambda: "step-0000060" in nodes[0].output(), 120, nodes[:1])
    said = nodes[0].output()
    assert "stopped answering" in said and RECOVERED.search(said), said[-4000:]
    records = train_records(run)
    assert records[-1]["step"] == 60
    alone = next(r for r in records[seen:] if len(r["rank_phases"]) == 1)
    print(f"\npartition, recovered in process: node 0 trained alone {alone['time'] - cut_at:.1f}"
          f" s after the cut, from the step-{RECOVERED.search(said).group(1)} snapshot")
    # The receipt names the watchdog: node 1 silent past the heartbeat timeout (5 s).
    [receipt] = read_receipts(run)
    check_receipt(receipt, "recovery", int(RECOVERED.search(said).group(1)), (2, 1), said,
                  float(TOOK.search(said).group(1)))
    assert receipt.detected_by.startswith("the watchdog: rank(s) 1 stopped answering")
    assert 5 <= receipt.detection_s < 60, receipt


@pytest.mark.slow
@pytest.mark.parametrize("netbed", [3], indirect=True)
def test_two_losses_in_a_row_each_recovered_with_exact_data(netbed, tmp_path):
    """3 nodes; node 2 killed (3 -> 2: two survivors regroup, a new snapshot ring, DDP
    at 2), then node 1 (2 -> 1, in the next generation's keys): every sample of the
    epoch read once across 3 -> 2 -> 1 ranks, with no checkpoint on disk."""
    run, out = tmp_path / "runs" / "two", tmp_path / "reads"
    data = ["--data", "toyjob:make_data_read_log",
            f"--data.kwargs={{out = '{out}', delay = 0.004, n = 480}}"]
    args = recovering_args(netbed.addr(0), "runs/two", data, 40, ("--nnodes", "1:3"))
    nodes = [start(netbed, 0, args, tmp_path)]
    time.sleep(0.5)
    nodes += [start(netbed, i, args, tmp_path) for i in (1, 2)]

    def ranks_past(count: int, step: int):
        def past():
            records = train_records(run)
            return records and records[-1]["step"] >= step and \
                len(records[-1]["rank_phases"]) == count
        return past
    wait_for(ranks_past(3, 3), 120, nodes)
    netbed.kill_node(2)
    wait_for(lambda: len(RECOVERED.findall(nodes[0].output())) == 1, 60, nodes[:2])
    first = int(RECOVERED.search(nodes[0].output()).group(1))
    wait_for(ranks_past(2, first + 2), 60, nodes[:2])
    netbed.kill_node(1)
    wait_for(lambda: "step-0000040.pt" in nodes[0].output(), 120, nodes[:1])
    found = RECOVERED.findall(nodes[0].output())
    assert [(w0, w1) for _, w0, w1 in found] == [("3", "2"), ("2", "1")], found
    s1, s2 = int(found[0][0]), int(found[1][0])
    by_world = {pid: {w: [i for i, world in got if world == w] for w in (1, 2, 3)}
                for pid, got in reads(out).items()}
    assert len(by_world) == 3  # one process per node, none restarted
    [survivor] = [r for r in by_world.values() if r[1]]
    [second] = [r for r in by_world.values() if r[2] and not r[1]]
    [third] = [r for r in by_world.values() if not r[2]]
    epoch = (survivor[3][:16 * s1] + second[3][:16 * s1] + third[3][:16 * s1]
             + survivor[2][:16 * (s2 - s1)] + second[2][:16 * (s2 - s1)])
    epoch += survivor[1][:480 - len(epoch)]
    assert sorted(epoch) == list(range(480))
    # A receipt each, in the order they happened: rank 2 lost, then rank 1.
    losses = read_receipts(run)
    assert [(r.step, r.world_from, r.world_to, r.ranks) for r in losses] == \
        [(s1, 3, 2, [2]), (s2, 2, 1, [1])], losses
    assert all(sum(r.phases.values()) <= r.total_s for r in losses)
