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
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from gpufleet.bench.runs import median_step_time, small_gpt_job
from gpufleet.core.machine import machine_summary


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
    job = small_gpt_job(args.steps, args.batch_size, args.n_embd, args.n_layer)
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
            ddp, hvd = median_step_time(ddp_dir), median_step_time(hvd_dir)
            ratios.append(hvd / ddp)
            print(f"{i + 1:>6} {ddp * 1e3:>12.1f} {hvd * 1e3:>16.1f} {hvd / ddp:>7.3f}")
    print(f"median ratio horovod / ddp: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
