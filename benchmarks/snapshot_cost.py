"""What in-memory snapshots cost a training step: the GPT default job (the built-in GPT
on the standard-library corpus) with ``fault.snapshot_every`` off and on, side by side.

Runs alternate (off, on, off, on, ...) so machine noise hits both alike. Each run logs
every ``--log-every`` steps; the per-step time is the median of the log intervals'
``step_time_s`` after the first interval (which counts the FLOPs and warms up). With
``--nproc 2`` every snapshot is also sent to the partner rank (gloo, a group of its own).
Reported: the median per-step time of each mode, the ratio on/off, and what the
snapshots held and cost the training thread (from the metrics the runs wrote).

    python benchmarks/snapshot_cost.py                      # several minutes on 2 cores
    python benchmarks/snapshot_cost.py --every 10 --nproc 2 --repeats 3 --steps 60
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from gpufleet.bench.machine import machine_summary
from gpufleet.config import load_config
from gpufleet.entry import train


def one_run(out: str, every: int, steps: int, log_every: int, nproc: int) -> list[dict]:
    """One run of the GPT default job; its train records from metrics.jsonl."""
    cfg = load_config(overrides={
        "run.out_dir": out, "run.max_steps": steps, "log.every": log_every,
        "fault.snapshot_every": every, "dist.nproc": nproc, "log.progress": "off",
        "checkpoint.every": 0, "checkpoint.save_final": False, "monitor.report": False,
        "run.eval_every": 0})
    result = train(cfg)
    lines = (Path(result.run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == "train"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=int, default=10,
                        help="fault.snapshot_every of the 'on' runs")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=1)
    args = parser.parse_args()
    print(f"machine: {machine_summary()}")
    print(f"torch {torch.__version__}; GPT default job, {args.nproc} rank(s), {args.steps} "
          f"steps, a snapshot every {args.every} in the 'on' runs, {args.repeats} repeats "
          "each, alternating")
    step_s: dict[str, list[float]] = {"off": [], "on": []}
    snaps: list[dict] = []
    with tempfile.TemporaryDirectory() as out:
        for _ in range(args.repeats):
            for mode in ("off", "on"):
                records = one_run(out, args.every if mode == "on" else 0, args.steps,
                                  args.log_every, args.nproc)
                step_s[mode].extend(r["step_time_s"] for r in records[1:])
                snaps.extend(r for r in records if "snapshot_mb" in r)
    off, on = statistics.median(step_s["off"]), statistics.median(step_s["on"])
    print("mode | intervals | step s (median) | step s (min)")
    for mode, times in step_s.items():
        print(f"{mode:4} | {len(times):9} | {statistics.median(times):15.4f} | "
              f"{min(times):.4f}")
    print(f"on / off per step: {on / off:.3f} ({(on - off) / off * 100:+.1f}%)")
    if snaps:
        mb = statistics.median(r["snapshot_mb"] for r in snaps)
        blocking = statistics.median(r["snapshot_blocking_s"] for r in snaps)
        print(f"snapshots: {mb:.1f} MB host memory on rank 0 (own + partner); training "
              f"thread per snapshot {blocking * 1e3:.1f} ms (median), i.e. "
              f"{blocking / args.every / off * 100:.2f}% of a step at this interval")


if __name__ == "__main__":
    main()
