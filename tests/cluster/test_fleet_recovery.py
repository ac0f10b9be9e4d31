"""A lost node inside your own loop: a Fleet loop (tests/cluster/fleet_loop.py) under
`gpufleet run --nnodes 1:2` on two bed nodes, snapshots after every step; node 1 dies
mid-run and node 0 goes on in its own process from its in-memory snapshot, at world size
1, with the registered state put back in place, reading exactly the rest of the epoch."""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import pytest
import torch

import toyjob
from gpufleet.fault.receipt import read_receipts
from gpufleet.train.checkpoint.format import load_checkpoint

from .nodes import start, wait_for
from .test_recovery import RECOVERED, reads

pytestmark = pytest.mark.timeout(300)

LOOP = Path(__file__).with_name("fleet_loop.py")


# Slow: the default run keeps one bed test of in-process recovery,
# test_recovery.py::test_survivor_recovers_in_process_with_exact_data_and_no_disk_read[ddp]
# (the same Recovery, snapshots and regroup); the Fleet contract (a snapshot of the
# registered state at the next step's start, Recovered, the loop going on from it) is
# in the default run in tests/fleet/test_recovery.py, in one process.
@pytest.mark.slow
def test_a_fleet_loop_goes_on_in_process_after_a_lost_node(netbed, tmp_path):
    run, out = tmp_path / "runs" / "fleet", tmp_path / "reads"
    # Rank 1 kills its node as it reads its 65th sample: step 5's batch, after 4 steps
    # both ranks took (16 samples a rank a step, 256 in the epoch).
    args = ["--nproc", "1", "--nnodes", "1:2", "--rdzv-endpoint", f"{netbed.addr(0)}:29400",
            "--rdzv-id", "fleet", "--max-restarts", "3", str(LOOP), str(run), str(out), "65"]
    nodes = [start(netbed, 0, args, tmp_path, command="run")]
    time.sleep(0.5)  # node 0 hosts the store: let it listen first
    nodes.append(start(netbed, 1, args, tmp_path, command="run"))
    # Trained to the end (the agent then waits for the lost node's at its exit barrier)
    wait_for(lambda: "report written" in nodes[0].output(), 150, nodes[:1])
    said = nodes[0].output()
    found = RECOVERED.search(said)
    assert found, said[-4000:]
    step, world_from, world_to = map(int, found.groups())
    assert (world_from, world_to) == (2, 1)
    assert "restarts the ranks from the newest checkpoint" not in said
    seen = json.loads((tmp_path / "runs" / "seen.json").read_text())
    # The loop caught Recovered once, at the snapshot's step, and went on to the end of
    # the epoch alone: `step` steps of 32 samples, then 16 a step.
    assert seen["recovered"] == [[step, 1]] and step == 4, (seen, said[-3000:])
    assert seen["step"] == step + (256 - 32 * step) // 16 and seen["world_size"] == 1
    # One process on node 0 from start to end (no restart): every sample of the epoch
    # read once across the two world sizes, besides what was read in the failed step.
    per_process = reads(out)
    assert len(per_process) == 2, sorted(per_process)
    survivor = max(per_process.values(), key=len)
    lost = min(per_process.values(), key=len)
    together = [i for i, world in survivor if world == 2]
    alone = [i for i, world in survivor if world == 1]
    assert len(together) == 16 * (step + 1)  # the failed step's batch read, not trained
    assert sorted(together[:16 * step] + [i for i, _ in lost][:16 * step] + alone) == \
        list(range(256))
    # The registered state is the one a loop with only the survivor from that step
    # would end with: its plain count (the failed step's batch not counted), the
    # schedule's steps, and the weights of the same training done here on one process.
    final = load_checkpoint(tmp_path / "runs" / "final.pt")
    assert final["samples"] == 256 - 16 * step  # rank 0's: 16 a step at world 2
    assert final["scheduler"]["last_epoch"] == seen["step"]
    expected = _trained_alone(load_checkpoint(tmp_path / "runs" / "start.pt")["model"], step)
    for name, tensor in expected.items():
        # (3e-8 apart when measured: DDP's average rounds differently)
        torch.testing.assert_close(final["model"][name], tensor, rtol=1e-5, atol=1e-6)
    # Its receipt: rank 1 lost, no step the survivor finished trained again.
    [receipt] = read_receipts(run)
    assert (receipt.kind, receipt.step, receipt.ranks) == ("recovery", step, [1])
    assert receipt.steps_repeated == 0, receipt


def _trained_alone(start: dict, step: int) -> dict:
    """The toy's weights after ``step`` steps over 32 samples at a time (2 ranks) and the
    rest of the epoch 16 at a time, as fleet_loop.py trains them, in one process."""
    model = toyjob.make_model()
    model.load_state_dict(start)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    x, y = toyjob.make_data().tensors
    bounds = [32 * k for k in range(step + 1)] + list(range(32 * step + 16, 257, 16))
    for a, b in itertools.pairwise(bounds):
        torch.nn.functional.mse_loss(model(x[a:b]), y[a:b]).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return model.state_dict()
