"""Two nodes, one slow link: what each fix gpufleet offers buys, measured side by side.

Builds a 2-node network bed (gpufleet.bench.netbed; needs root), limits node 1's link to
``--mbit`` Mbit/s each way, and trains the built-in GPT (n_embd 96, 2 layers: about 1 MB
of fp32 gradients) across the two nodes with ``ddp``, once per setting:

* baseline: plain ddp (and once with the link unlimited, for reference);
* parallel.ddp.comm_hook=fp16 (half the bytes) and powersgd (rank-2 low-rank gradients);
* parallel.ddp.bucket_cap_mb=100 (fewer, larger messages);
* optim.grad_accum=4 (one all-reduce per 4 micro-batches: 4x the samples per step);
* strategy local_sgd (ranks step alone, models averaged every 4 steps).

Throughput is samples per second per rank over the log intervals after the first
(PowerSGD starts compressing at step 10). Settings run in turn, ``--rounds`` times,
interleaved; the median speed-up over the baseline is printed with the machine.

    sudo python benchmarks/slow_link.py                 # about 6 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from gpufleet.bench.netbed import NetBed, netbed_available
from gpufleet.bench.runs import small_gpt_job
from gpufleet.core.machine import machine_summary

SETTINGS = {
    "baseline": [],
    "fp16 hook": ["--parallel.ddp.comm_hook", "fp16"],
    "powersgd hook": ["--parallel.ddp.comm_hook", "powersgd", "--parallel.ddp.powersgd_rank", "2"],
    "bucket 100 MB": ["--parallel.ddp.bucket_cap_mb", "100"],
    "grad_accum 4": ["--optim.grad_accum", "4"],
    "local_sgd /4": ["--strategy", "local_sgd", "--parallel.local_sgd.period", "4"],
}


def throughput(run_dir: Path, batch: int) -> float:
    """Samples per second per rank: the log intervals after the first, median step."""
    records = [r for r in map(json.loads, open(run_dir / "metrics.jsonl"))
               if r["kind"] == "train"]
    step = statistics.median(r["step_time_s"] for r in records[1:])
    return batch / step


def run_two_nodes(bed: NetBed, args: list[str], run_dir: Path, env: dict,
                  nodes: int = 2) -> None:
    """Run ``args`` (a `gpufleet train` command) as one job on nodes 0 .. ``nodes`` - 1
    of ``bed`` (two unless told), one rank each; exits with the error of a failed one."""
    procs = []
    for i in range(nodes):
        procs.append(bed.popen(i, [*args, "--run-dir", str(run_dir), "--nnodes", str(nodes),
                                   "--nproc", "1", "--node-rank", str(i), "--master-addr",
                                   bed.addr(0), "--master-port", "29500"],
                               env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True))
    for proc in procs:
        _, err = proc.communicate(timeout=900)
        if proc.returncode:
            sys.exit(f"a run failed ({' '.join(args[-4:])}):\n{err[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mbit", type=float, default=20.0)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    reason = netbed_available()
    if reason:
        sys.exit(f"cannot run: {reason}")
    batch = 8
    base = [*small_gpt_job(args.steps, batch_size=batch, n_embd=96, n_layer=2),
            "--strategy", "ddp", "--parallel.ddp.powersgd_start_step", "10"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    print(machine_summary())
    print(f"2 nodes (network namespaces), node 1's link at {args.mbit:g} Mbit/s; GPT n_embd "
          f"96, 2 layers, batch {batch} per rank, {args.steps} steps per run")
    results: dict[str, list[float]] = {name: [] for name in ["unlimited", *SETTINGS]}
    with tempfile.TemporaryDirectory() as tmp, NetBed(2) as bed:
        for r in range(args.rounds):
            for name in results:
                extra = SETTINGS.get(name, [])
                bed.rate_limit(1, None if name == "unlimited" else args.mbit)
                run_dir = Path(tmp) / f"{r}-{name.replace(' ', '_').replace('/', '')}"
                run_two_nodes(bed, [*base, *extra], run_dir, env)
                accum = 4 if name == "grad_accum 4" else 1
                results[name].append(throughput(run_dir, batch * accum))
                print(f"  round {r + 1}: {name:<14} {results[name][-1]:8.1f} samples/s/rank",
                      flush=True)
    baseline = statistics.median(results["baseline"])
    print(f"\n{'setting':<14} {'samples/s/rank':>15} {'vs baseline':>12}")
    for name, values in results.items():
        value = statistics.median(values)
        print(f"{name:<14} {value:>15.1f} {value / baseline:>11.2f}x")


if __name__ == "__main__":
    main()
