"""Step time of ``horovod`` (under ``horovodrun``) against ``ddp``, same job, same ranks.

Each repeat trains the built-in GPT on the stdlib corpus twice, one run right after the
other: ``gpufleet train --nproc N --strategy ddp`` and ``horovodrun -np N --gloo gpufleet
train --strategy horovod``, with the same per-rank batch and steps. The step time is the
median of ``step_time_s`` over the log intervals after the first (start-up left out).
The ratio horovod / ddp is taken within each repeat, so a busy machine slows both.
Prints the machine, the per-repeat numbers and the median ratio.

Needs Horovod (``bash scripts/install-horovod.sh``).

    python benchmarks/horovod.py                      # about 3 minutes on 2 cores
    python benchmarks/horovod.py --ranks 4 --repeats 5 --n-embd 256
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from gpufleet.bench.machine import machine_summary


def step_time(run_dir: Path) -> float:
    records = [r for r in map(json.loads, open(run_dir / "metrics.jsonl"))
               if r["kind"] == "train"]
    return statistics.median(r["step_time_s"] for r in records[1:])


def run(command: list[str], cwd: Path) -> None:
    proc = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"failed: {' '.join(command)}\n{proc.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--n-layer", type=int, default=4)
    args = parser.parse_args()
    horovodrun = shutil.which("horovodrun")
    if horovodrun is None:
        sys.exit("horovodrun not found: bash scripts/install-horovod.sh")
    job = [sys.executable, "-m", "gpufleet", "train", "--max-steps", str(args.steps),
           "--log.every", "10", "--batch-size", str(args.batch_size),
           "--model.n_embd", str(args.n_embd), "--model.n_layer", str(args.n_layer),
           "--model.n_head", "4", "--model.block_size", "128", "--run.eval_every", "0",
           "--data.num_workers", "0", "--checkpoint.save_final", "false",
           "--monitor.report", "false"]
    print(machine_summary())
    print(f"GPT n_embd={args.n_embd} n_layer={args.n_layer} block 128, {args.ranks} gloo "
          f"ranks x batch {args.batch_size}, {args.steps} steps")
    print(f"{'repeat':>6} {'ddp ms/step':>12} {'horovod ms/step':>16} {'ratio':>7}")
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        for i in range(args.repeats):
            ddp_dir, hvd_dir = cwd / f"ddp-{i}", cwd / f"hvd-{i}"
            run([*job, "--nproc", str(args.ranks), "--strategy", "ddp",
                 "--run-dir", str(ddp_dir)], cwd)
            run([horovodrun, "-np", str(args.ranks), "-H", f"localhost:{args.ranks}",
                 "--gloo", *job, "--strategy", "horovod", "--run-dir", str(hvd_dir)], cwd)
            ddp, hvd = step_time(ddp_dir), step_time(hvd_dir)
            ratios.append(hvd / ddp)
            print(f"{i + 1:>6} {ddp * 1e3:>12.1f} {hvd * 1e3:>16.1f} {hvd / ddp:>7.3f}")
    print(f"median ratio horovod / ddp: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
