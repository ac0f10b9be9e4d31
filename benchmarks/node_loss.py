"""What losing a node costs an elastic run: seconds of progress lost and steps repeated.

Builds a 2-node network bed (gpufleet.bench.netbed; needs root) and starts the built-in
GPT (n_embd 96, 2 layers) on both nodes as an elastic ``--nnodes 1:2 --max-restarts 3``
run with a checkpoint every ``--every`` steps. Once both train past step ``--kill-at``
(by default 2 steps after a checkpoint), every process of node 1 is killed (SIGKILL).
Node 0 goes on alone from the newest checkpoint; ``--rejoin-after`` seconds after the
kill node 1 is started again and rejoins; then the run is stopped. From node 0's
metrics.jsonl:

* recovery: seconds from the kill to node 0's first step trained alone;
* steps repeated: steps done before the kill that came after the checkpoint resumed from;
* lost progress: seconds from the kill until the run is back at the step it had reached;
* rejoin: seconds from node 1's restart to the first step with both nodes again.

With ``--snapshot-every N`` every rank keeps an in-memory snapshot every N steps and node
0 goes on in its own process from its newest one (no restart, no checkpoint read);
``in_process`` says whether it did (1) or fell back to the agent's restart (0).

    sudo python benchmarks/node_loss.py                 # about 2 minutes a repeat
    sudo python benchmarks/node_loss.py --snapshot-every 1   # recovery in process
    sudo python benchmarks/node_loss.py --lose-store    # node 0, the store's host, lost

``--lose-store`` kills node 0 instead, the node whose agent hosts the rendezvous store
(``--rdzv-endpoint`` points at it): it measures what the survivor does then, whether it
trains alone, and how long until its launcher exits, with the last lines it printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpufleet.bench.machine import machine_summary
from gpufleet.bench.netbed import NetBed, netbed_available
from gpufleet.bench.runs import small_gpt_job


def records(run_dir: Path) -> list[dict]:
    path, out = run_dir / "metrics.jsonl", []
    for line in (path.read_text().splitlines() if path.exists() else []):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("kind") == "train":
            out.append(record)
    return out


def wait_until(test, timeout: float) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = test()
        if found:
            return found
        time.sleep(0.1)
    sys.exit(f"gave up after {timeout:.0f} s")


def elastic_job(bed: NetBed, run_dir: Path, args: argparse.Namespace) -> list[str]:
    """The 1:2-node elastic command every node runs, the store on node 0."""
    return [*small_gpt_job(args.steps, n_embd=96, n_layer=2), "--log.every", "1",
            "--strategy", "ddp", "--checkpoint.every", str(args.every), "--run-dir",
            str(run_dir), "--nproc", "1", "--nnodes", "1:2", "--rdzv-endpoint",
            f"{bed.addr(0)}:29400", "--rdzv-id", run_dir.name, "--max-restarts", "3",
            "--dist.rdzv_last_call_s", "2", "--dist.rdzv_keep_alive_s", "1",
            "--fault.snapshot_every", str(args.snapshot_every)]


def one_loss(bed: NetBed, run_dir: Path, args: argparse.Namespace) -> dict[str, float]:
    job = elastic_job(bed, run_dir, args)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    said = run_dir.parent / f"{run_dir.name}-node0.log"
    with open(said, "w") as out:  # which path node 0 took
        bed.popen(0, job, env=env, stdout=out, stderr=subprocess.STDOUT)
    time.sleep(0.5)
    bed.popen(1, job, env=env, **quiet)
    wait_until(lambda: [r for r in records(run_dir)
                        if r["step"] >= args.kill_at and len(r["rank_phases"]) == 2], 300)
    before = records(run_dir)
    killed_at, at_step = time.time(), before[-1]["step"]
    bed.kill_node(1)
    alone = wait_until(lambda: [r for r in records(run_dir)[len(before):]
                                if len(r["rank_phases"]) == 1], 120)
    # The step reached at the kill: the newest with both nodes (one may have ended
    # between reading the records above and the kill).
    at_step = max(r["step"] for r in records(run_dir) if len(r["rank_phases"]) == 2)
    time.sleep(max(0.0, killed_at + args.rejoin_after - time.time()))
    rejoined_at = time.time()
    bed.popen(1, job, env=env, **quiet)
    seen = len(records(run_dir))
    both = wait_until(lambda: [r for r in records(run_dir)[seen:]
                               if len(r["rank_phases"]) == 2], 300)
    # Measured: the bed's teardown ends the run (it is long so that it outlasts the rejoin).
    back = next(r for r in records(run_dir)[len(before):] if r["step"] >= at_step)
    return {"recovery_s": alone[0]["time"] - killed_at,
            "repeated": at_step - (alone[0]["step"] - 1),
            "lost_s": back["time"] - killed_at,
            "rejoin_s": both[0]["time"] - rejoined_at,
            "in_process": float("recovered in-process" in said.read_text(errors="replace"))}


def store_loss(bed: NetBed, run_dir: Path, args: argparse.Namespace,
               limit: float = 240.0) -> dict[str, object]:
    """Both nodes train; every process of node 0 (the store's host) is killed. Node 1's
    launcher is watched for ``limit`` seconds."""
    job = elastic_job(bed, run_dir, args)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    bed.popen(0, job, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    log = run_dir.parent / f"{run_dir.name}-node1.log"
    with open(log, "w") as out:
        survivor = bed.popen(1, job, env=env, stdout=out, stderr=subprocess.STDOUT)
    wait_until(lambda: [r for r in records(run_dir)
                        if r["step"] >= args.kill_at and len(r["rank_phases"]) == 2], 300)
    seen = len(records(run_dir))
    killed_at = time.time()
    bed.kill_node(0)
    try:
        code = survivor.wait(timeout=limit)
        exited = time.time() - killed_at
    except subprocess.TimeoutExpired:
        code, exited = None, float("inf")
    alone = [r for r in records(run_dir)[seen:] if len(r["rank_phases"]) == 1]
    tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return {"exit_s": exited, "exit_code": code, "trained_alone": bool(alone),
            "last_lines": tail[-4:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--rejoin-after", type=float, default=25.0)
    parser.add_argument("--kill-at", type=int, default=22)
    parser.add_argument("--snapshot-every", type=int, default=0,
                        help="fault.snapshot_every: the survivor recovers in process from "
                             "its in-memory snapshot (0: off, the agent restarts it)")
    parser.add_argument("--lose-store", action="store_true",
                        help="kill node 0 (the rendezvous store's host) instead of node 1")
    args = parser.parse_args()
    reason = netbed_available()
    if reason:
        sys.exit(f"cannot run: {reason}")
    print(machine_summary())
    print(f"elastic 1:2 nodes, 1 rank each, checkpoint every {args.every} steps, snapshot "
          f"every {args.snapshot_every or '-'} steps, rendezvous heartbeat 1 s, last call "
          f"2 s; node 1 killed past step {args.kill_at}")
    if args.lose_store:
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(args.repeats):
                with NetBed(2) as bed:
                    row = store_loss(bed, Path(tmp) / f"store{i}", args)
                print(f"  repeat {i + 1}: node 0 (store host) killed; node 1 trained alone: "
                      f"{row['trained_alone']}; its launcher exited after "
                      f"{row['exit_s']:.1f} s with code {row['exit_code']}; last lines:",
                      flush=True)
                for line in row["last_lines"]:  # type: ignore[union-attr]
                    print(f"    {line[:300]}")
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            with NetBed(2) as bed:
                rows.append(one_loss(bed, Path(tmp) / f"loss{i}", args))
            print(f"  repeat {i + 1}: " + ", ".join(f"{k} {v:.1f}" for k, v in rows[-1].items()),
                  flush=True)
    print("median: " + ", ".join(f"{k} {statistics.median(r[k] for r in rows):.1f}"
                                 for k in rows[0]))


if __name__ == "__main__":
    main()
