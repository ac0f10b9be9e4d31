"""Step time of ``gpufleet train --nproc N`` on CPU: each rank with every core's worth of
torch threads (what torch does unless told) against the node's cores shared out.

Every repeat runs the same 2-rank ``ddp`` job twice, one run right after the other:
with ``OMP_NUM_THREADS`` = all usable cores (each rank sizes its pool to the whole
machine) and without it (gpufleet then gives each rank cores // N threads). The step
time is the median ``step_time_s`` of the log intervals after the first. Prints the
machine, the per-repeat numbers and the median ratio.

    python benchmarks/threads.py                      # about 2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

from gpufleet.bench.runs import median_step_time, small_gpt_job
from gpufleet.core.machine import machine_summary, usable_cores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    job = [*small_gpt_job(args.steps), "--nproc", str(args.ranks), "--strategy", "ddp"]
    cores = usable_cores()
    print(machine_summary())
    print(f"GPT n_embd=128 n_layer=4 block 128, {args.ranks} gloo ranks x batch 8, "
          f"{args.steps} steps")
    print(f"{'repeat':>6} {f'{cores} thr/rank ms':>16} {'shared ms':>10} {'speed-up':>9}")
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            times = []
            for threads in (str(cores), None):
                env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
                if threads:
                    env["OMP_NUM_THREADS"] = threads
                run_dir = Path(tmp) / f"{i}-{threads or 'shared'}"
                subprocess.run([*job, "--run-dir", str(run_dir)], env=env, check=True,
                               capture_output=True)
                times.append(median_step_time(run_dir))
            ratios.append(times[0] / times[1])
            print(f"{i + 1:>6} {times[0] * 1e3:>16.1f} {times[1] * 1e3:>10.1f} "
                  f"{ratios[-1]:>9.2f}")
    print(f"median speed-up from sharing the cores: {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
