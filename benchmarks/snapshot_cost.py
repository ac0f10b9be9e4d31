"""What in-memory snapshots cost a training step: the GPT default job (the built-in GPT
on the standard-library corpus, one process) with ``fault.snapshot_every`` off and on,
interleaved in one run.

The run alternates blocks of ``--block`` steps without and with snapshots (off, on,
off, on, ...; a snapshot every ``--every`` steps inside the 'on' blocks, the first at
the block's first step, so that its background copy overlaps that block's steps). Each
block is one log interval; its ``step_time_s`` is compared with the 'off' block just
before it, so a machine whose load drifts (a shared one) hits both alike. The first
pair is left out (its first step counts the FLOPs). In the 'off' blocks the snapshot
callback is still called each step and returns at once (a modulo), as it does between
snapshots in a real run.

Reported: the median per-step time of each mode, the median of the pairs' ratios
on/off, and what a snapshot held and cost the training thread (from the metrics). Also
the process's CPU time per step in each block (every thread, the background copy
included): on a shared machine the wall-clock step swings with the other jobs' load,
while the CPU seconds the run itself spends do much less, and a snapshot's extra work
(the copy) shows there.

    python benchmarks/snapshot_cost.py                 # several minutes on 2 cores
    python benchmarks/snapshot_cost.py --every 10 --block 10 --steps 120
    python benchmarks/snapshot_cost.py --nproc 2 --strategy fsdp   # each rank also
                                                       # sends its shards to its partner

With ``--nproc 2`` the job runs as 2 ranks (gloo, one node) of ``--strategy``: under
fsdp each 'on' block's snapshot is copied and then sent to the partner rank over the
snapshots' own gloo group, in the background, as on several nodes; ddp ranks keep their
whole copy to themselves (nothing is sent). The figures are rank 0's (its process's CPU
includes its copy and its send).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from gpufleet.config import load_config
from gpufleet.core.machine import machine_summary
from gpufleet.entry import train
from gpufleet.fault.snapshot import SnapshotCallback
from gpufleet.launch import launch


def interleave(block: int, every: int, cpu_at: dict[int, float]) -> None:
    """Make the snapshot callback take snapshots only in every second block of steps
    (this process only: the run must be one process); note the process's CPU seconds
    at the end of every step in ``cpu_at``."""
    def on_step_end(self: SnapshotCallback, trainer: object, step: int) -> None:
        cpu_at[step] = time.process_time()  # every thread of the process
        in_on_block = ((step - 1) // block) % 2 == 1
        if in_on_block and (step - 1) % every == 0:  # what the callback does when due
            state, storages = self.capture()
            self.snapshotter.take(step, state, storages)

    SnapshotCallback.on_step_end = on_step_end  # type: ignore[method-assign]


def run(args: argparse.Namespace, out: str) -> tuple[dict[int, float], str]:
    """Train the interleaved job (this process, or this rank of several); returns the
    process's CPU seconds at each step's end and the run directory."""
    cpu_at: dict[int, float] = {}
    interleave(args.block, args.every, cpu_at)
    cfg = load_config(overrides={
        "run.out_dir": out, "run.name": "snapshots", "run.max_steps": args.steps,
        "log.every": args.block, "fault.snapshot_every": args.every,
        "log.progress": "off", "checkpoint.every": 0, "checkpoint.save_final": False,
        "monitor.report": False, "run.eval_every": 0,
        **({"parallel.strategy": args.strategy} if args.nproc > 1 else {})})
    result = train(cfg)
    return cpu_at, result.run_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=int, default=10,
                        help="steps between snapshots in the 'on' blocks")
    parser.add_argument("--block", type=int, default=10,
                        help="steps per block (a multiple of --every)")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--nproc", type=int, default=1, help="ranks (one node)")
    parser.add_argument("--strategy", default="ddp", choices=("ddp", "fsdp"),
                        help="with --nproc > 1 (fsdp: each snapshot is also sent to a "
                             "partner)")
    args = parser.parse_args()
    if args.block % args.every:
        parser.error(f"--block {args.block} is not a multiple of --every {args.every}")
    print(f"machine: {machine_summary()}")
    print(f"torch {torch.__version__}; GPT default job, {args.nproc} rank(s)"
          f"{f' ({args.strategy})' if args.nproc > 1 else ''}, {args.steps} "
          "steps in "
          f"blocks of {args.block}, alternating off/on, a snapshot every {args.every} "
          "steps in the 'on' blocks")
    with tempfile.TemporaryDirectory() as out:
        if args.nproc > 1:  # each rank interleaves alike; rank 0's figures
            cpu_at, run_dir = launch(run, (args, out), nproc=args.nproc)[0]
        else:
            cpu_at, run_dir = run(args, out)
        lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    blocks = [r for r in map(json.loads, lines) if r.get("kind") == "train"]
    pairs = [(blocks[i]["step_time_s"], blocks[i + 1]["step_time_s"], blocks[i + 1])
             for i in range(2, len(blocks) - 1, 2)]  # (off, on) after the first pair
    off = [p[0] for p in pairs]
    on = [p[1] for p in pairs]
    ratios = [b / a for a, b, _ in pairs]
    print("pair | off step s | on step s | on/off")
    for i, (a, b, _) in enumerate(pairs):
        print(f"{i + 1:4} | {a:10.4f} | {b:9.4f} | {b / a:.3f}")
    ratio = statistics.median(ratios)
    print(f"median step: off {statistics.median(off):.4f} s, on {statistics.median(on):.4f}"
          f" s; median on/off per pair {ratio:.3f} ({(ratio - 1) * 100:+.1f}%)")
    # CPU seconds per step of block b (steps b*block+1 .. (b+1)*block), same pairs.
    def cpu(b: int) -> float:
        return (cpu_at[(b + 1) * args.block] - cpu_at[b * args.block]) / args.block
    cpu_pairs = [(cpu(i), cpu(i + 1)) for i in range(2, len(blocks) - 1, 2)]
    cpu_ratio = statistics.median(b / a for a, b in cpu_pairs)
    print("pair | off CPU s/step | on CPU s/step | on/off")
    for i, (a, b) in enumerate(cpu_pairs):
        print(f"{i + 1:4} | {a:14.4f} | {b:13.4f} | {b / a:.3f}")
    print(f"median CPU per step: off {statistics.median(p[0] for p in cpu_pairs):.4f} s, on "
          f"{statistics.median(p[1] for p in cpu_pairs):.4f} s; median on/off per pair "
          f"{cpu_ratio:.3f} ({(cpu_ratio - 1) * 100:+.1f}%)")
    snaps = [p[2] for p in pairs]
    blocking = statistics.median(r["snapshot_blocking_s"] for r in snaps)
    print(f"a snapshot: {snaps[-1]['snapshot_mb']:.2f} MB of host memory, "
          f"{blocking * 1e3:.1f} ms on the training thread (median), that is "
          f"{blocking / args.every / statistics.median(off) * 100:.3f}% of a step at one "
          f"every {args.every} steps")


if __name__ == "__main__":
    main()
