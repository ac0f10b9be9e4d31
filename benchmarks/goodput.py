"""Goodput under node loss: an elastic run whose node 1 is killed every few minutes,
beside the same run with no faults, both at once.

Two 2-node network beds (gpufleet.bench.netbed; needs root) each run the built-in GPT
(n_embd 96, 2 layers) as an elastic ``--nnodes 1:2`` run with a checkpoint every
``--every`` steps, for ``--minutes`` of wall time. On the faulted bed every process of
node 1 is killed every ``--kill-every`` seconds and started again ``--down-for`` seconds
later; the clean bed runs undisturbed. Both beds run at the same time, so they share the
machine's load, and their ratio is what counts.

Goodput is the samples the run keeps per second of wall time: for every step number the
last time it was trained (a step repeated after a resume counts once), the batch times
the ranks that trained it. The faulted run's goodput over the clean run's is the share
of its throughput that node losses leave.

    sudo python benchmarks/goodput.py                            # 10 minutes, ddp
    sudo python benchmarks/goodput.py --strategy fsdp --minutes 4 --kill-every 60
    sudo python benchmarks/goodput.py --fault.snapshot_every 1   # options after -- go
                                                                 # to both runs
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from node_loss import records, workdir

from gpufleet.bench.netbed import NetBed, netbed_available
from gpufleet.bench.runs import small_gpt_job
from gpufleet.core.machine import machine_summary

BATCH = 8


def job(bed: NetBed, run_dir: Path, args: argparse.Namespace, extra: list[str]) -> list[str]:
    """The elastic command every node of ``bed`` runs (the store on node 0)."""
    return [*small_gpt_job(10**7, batch_size=BATCH, n_embd=96, n_layer=2),
            "--log.every", "1", "--strategy", args.strategy,
            "--checkpoint.every", str(args.every), "--run-dir", str(run_dir),
            "--nproc", str(args.nproc), "--nnodes", "1:2",
            "--rdzv-endpoint", f"{bed.addr(0)}:29400", "--rdzv-id", run_dir.name,
            "--max-restarts", "1000", "--dist.rdzv_last_call_s", "2",
            "--dist.rdzv_keep_alive_s", "1", *extra]


def kept_samples(run_dir: Path, start: float, until: float) -> tuple[int, int, int]:
    """Samples kept, steps kept and steps trained more than once between ``start`` and
    ``until`` (wall clock)."""
    last: dict[int, int] = {}  # step -> ranks that trained it, the last time
    trained = 0
    for r in records(run_dir):
        if start <= r["time"] <= until:
            trained += 1
            last[r["step"]] = len(r["rank_phases"])
    return BATCH * sum(last.values()), len(last), trained - len(last)


def side_by_side(args: argparse.Namespace, extra: list[str], tmp: Path) -> dict[str, tuple]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    starts: dict[str, int] = {}

    def output(name: str, node: int) -> dict:
        """Where a node's launcher writes: nowhere, or with --keep a log per start."""
        if not args.keep:
            return {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        key = f"{name}-node{node}"
        starts[key] = starts.get(key, 0) + 1
        log = open(tmp / f"{key}-{starts[key]}.log", "w")
        return {"stdout": log, "stderr": subprocess.STDOUT}

    with NetBed(2) as clean_bed, NetBed(2) as faulted_bed:
        beds = {"clean": clean_bed, "faulted": faulted_bed}
        dirs = {name: tmp / name for name in beds}
        for name, bed in beds.items():
            command = job(bed, dirs[name], args, extra)
            bed.popen(0, command, env=env, **output(name, 0))
            time.sleep(0.5)
            bed.popen(1, command, env=env, **output(name, 1))
        start = time.time()
        end = start + 60 * args.minutes
        kills = 0
        next_kill = start + args.kill_every
        while time.time() < end:
            if time.time() >= next_kill and next_kill + args.down_for < end:
                faulted_bed.kill_node(1)
                kills += 1
                time.sleep(args.down_for)
                faulted_bed.popen(1, job(faulted_bed, dirs["faulted"], args, extra),
                                  env=env, **output("faulted", 1))
                next_kill += args.kill_every
            time.sleep(0.5)
        until = time.time()
    return {name: (*kept_samples(dirs[name], start, until), until - start, kills)
            for name in beds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--keep", metavar="DIR", default="",
                        help="keep the run directories and every launcher's log under DIR")
    parser.add_argument("--kill-every", type=float, default=120.0,
                        help="seconds between kills of node 1 on the faulted bed")
    parser.add_argument("--down-for", type=float, default=20.0,
                        help="seconds node 1 stays down before it is started again")
    parser.add_argument("--strategy", default="ddp", choices=("ddp", "fsdp", "hsdp"))
    parser.add_argument("--nproc", type=int, default=1, help="ranks per node")
    parser.add_argument("--every", type=int, default=20, help="steps between checkpoints")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    reason = netbed_available()
    if reason:
        sys.exit(f"cannot run: {reason}")
    print(machine_summary())
    print(f"elastic 1:2 nodes x {args.nproc} rank(s), {args.strategy}, checkpoint every "
          f"{args.every} steps, {args.minutes:g} minutes; faulted: node 1 killed every "
          f"{args.kill_every:g} s, back {args.down_for:g} s later; extra options: "
          f"{' '.join(extra) or '-'}", flush=True)
    load_before = os.getloadavg()[0]
    with workdir(args.keep) as tmp:
        rows = side_by_side(args, extra, Path(tmp))
    print(f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    print("| run | kills | wall s | steps kept | steps repeated | samples kept | "
          "goodput (samples/s) |")
    print("|---|---|---|---|---|---|---|")
    for name, (samples, steps, repeated, wall, kills) in rows.items():
        print(f"| {name} | {kills if name == 'faulted' else 0} | {wall:.0f} | {steps} | "
              f"{repeated} | {samples} | {samples / wall:.1f} |")
    clean, faulted = (rows[n][0] / rows[n][3] for n in ("clean", "faulted"))
    print(f"goodput, faulted / clean: {faulted / clean:.3f}" if clean else
          "the clean run kept no sample: nothing to compare")


if __name__ == "__main__":
    main()
