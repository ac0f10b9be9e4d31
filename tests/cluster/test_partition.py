"""A partition: node 1's link is cut mid-run. Within the heartbeat timeout the run names
the rank and node that stopped answering (not "behind"), and nothing waits out the
collective timeout: a static run ends with that error, an elastic one goes on without
the lost node."""

from __future__ import annotations

import time

import pytest

from .nodes import TOY, start, train_records, wait, wait_for

pytestmark = pytest.mark.timeout(300)

# The collective timeout stays long (120 s): ending well before it is the point.
FAST_FAULTS = ["--dist.timeout", "120", "--fault.heartbeat_timeout_s", "5",
               "--fault.watchdog_poll_s", "0.5", "--fault.stall_min_s", "3"]


def _args(addr: str, run_dir: str, where: list[str], steps: int = 200) -> list[str]:
    return [*TOY, "--data", "toyjob:make_slow_data", "--data.kwargs={delay = 0.004}",
            "--max-steps", str(steps), "--nproc", "1", "--batch-size", "16", "--strategy", "ddp",
            "--checkpoint.every", "5", "--run-dir", run_dir, *FAST_FAULTS, *where]


def _cut_after_step(netbed, run, nodes, step: int) -> float:
    def two_nodes_training():
        records = train_records(run)
        return records and records[-1]["step"] >= step
    wait_for(two_nodes_training, 120, nodes)
    netbed.link_down(1)
    return time.monotonic()


def test_static_run_names_the_silent_node_and_ends_instead_of_hanging(netbed, tmp_path):
    where = ["--nnodes", "2", "--master-addr", netbed.addr(0), "--master-port", "29500"]
    args = _args(netbed.addr(0), "runs/static", where)
    nodes = [start(netbed, i, [*args, "--node-rank", str(i)], tmp_path) for i in range(2)]
    cut = _cut_after_step(netbed, tmp_path / "runs" / "static", nodes, 10)
    codes = wait(nodes, timeout=100, expect=None)
    took = time.monotonic() - cut
    assert codes[0] != 0 and codes[1] != 0
    assert took < 60, f"the run took {took:.0f} s to end after the cut"
    log0, log1 = nodes[0].output(), nodes[1].output()
    assert "rank 1 (node 1, " + netbed.addr(1) in log0 and "stopped answering" in log0
    assert "it is not slow" in log0 and "rank 1 is behind" not in log0
    assert "exit code 69" in log0  # the launcher's summary says why the rank ended
    assert "rank 1 (node 1" in log1 and "lost contact with the job" in log1, log1[-4000:]
    report = next((tmp_path / "runs" / "static" / "hangs").glob("*lost-rank0/report.txt"))
    assert "stopped answering" in report.read_text()
    print(f"\npartition (static): both nodes ended {took:.1f} s after the cut "
          "(heartbeat timeout 5 s, collective timeout 120 s)")


# Slow: the static partition test (named, no hang) and node loss (elastic goes on)
# run by default.
@pytest.mark.slow
def test_elastic_run_goes_on_without_the_cut_off_node(netbed, tmp_path):
    run = tmp_path / "runs" / "elastic"
    where = ["--nnodes", "1:2", "--rdzv-endpoint", f"{netbed.addr(0)}:29400", "--rdzv-id",
             "job", "--dist.rdzv_last_call_s", "2", "--dist.rdzv_keep_alive_s", "1",
             "--max-restarts", "2"]
    args = _args(netbed.addr(0), "runs/elastic", where, steps=60)
    nodes = [start(netbed, 0, args, tmp_path)]
    time.sleep(0.5)
    nodes.append(start(netbed, 1, args, tmp_path))
    cut = _cut_after_step(netbed, run, nodes, 10)
    before = len(train_records(run))

    def alone():
        return [r for r in train_records(run)[before:] if len(r["rank_phases"]) == 1]
    resumed = wait_for(alone, 90, nodes[:1])
    took = time.monotonic() - cut
    assert wait(nodes[:1], timeout=120) == [0]
    assert train_records(run)[-1]["step"] == 60
    assert "stopped answering" in nodes[0].output()
    # With the defaults (snapshots every 10 steps on an elastic CPU run) node 0 goes on
    # in its own process.
    assert "recovered in-process from the step-" in nodes[0].output()
    print(f"\npartition (elastic): node 0 trained alone again {took:.1f} s after the cut, "
          f"from step {resumed[0]['step'] - 1}")
