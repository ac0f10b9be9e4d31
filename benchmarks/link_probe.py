"""The link probe at the start of a multi-node run: what it costs, what it measures, and
what the diagnosis then says, on a 3-node bed with every link healthy and with node 1's
link at ``--mbit`` Mbit/s.

Trains the built-in GPT (n_embd 96, 2 layers: about 1 MB of fp32 gradients) with ddp
across three bed nodes (gpufleet.bench.netbed; needs root), one rank each, 20 steps.
The two settings alternate for ``--rounds`` rounds. From each run's diagnosis.json it
reads the probe's seconds on rank 0 and each node's reach (its fastest link), and it
prints the communication-bound finding of the last limited run.

    sudo python benchmarks/link_probe.py             # about 3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from slow_link import run_two_nodes  # benchmarks/slow_link.py

from gpufleet.bench.netbed import NetBed, netbed_available
from gpufleet.bench.runs import small_gpt_job
from gpufleet.core.machine import machine_summary
from gpufleet.monitor.diagnose import findings_for_run
from gpufleet.monitor.links import rate_text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mbit", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    reason = netbed_available()
    if reason:
        sys.exit(f"cannot run: {reason}")
    job = [*small_gpt_job(20, batch_size=8, n_embd=96, n_layer=2), "--strategy", "ddp"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    print(machine_summary())
    print(f"3 nodes (network namespaces), one rank each; GPT n_embd 96, 2 layers, ddp; "
          f"{args.rounds} round(s), settings interleaved")
    settings = {"healthy": None, f"node 1 at {args.mbit:g} Mbit/s": args.mbit}
    cost: dict[str, list[float]] = {name: [] for name in settings}
    last = Path()
    with tempfile.TemporaryDirectory() as tmp, NetBed(3) as bed:
        for r in range(args.rounds):
            for name, mbit in settings.items():
                bed.rate_limit(1, mbit)
                run_dir = Path(tmp) / f"{r}-{'limited' if mbit else 'healthy'}"
                run_two_nodes(bed, job, run_dir, env, nodes=3)
                links = json.loads((run_dir / "diagnosis.json").read_text())["facts"]["links"]
                cost[name].append(links["seconds"])
                reach = ", ".join(f"node {n['node']} {rate_text(n['mbit_s'])} "
                                  f"({n['latency_ms']:.2f} ms)" for n in links["nodes"])
                sizes = ", ".join(f"{a}-{b}: {p['bytes'] >> 10} KB"
                                  for p in links["pairs"] for a, b in [p["nodes"]])
                print(f"  round {r + 1}: {name:<22} probe {links['seconds']:.3f} s; reach: "
                      f"{reach}; largest swap per pair: {sizes}", flush=True)
                if mbit:
                    last = run_dir
        print("\nprobe seconds on rank 0 (median of rounds):")
        for name, values in cost.items():
            print(f"  {name:<22} {statistics.median(values):.3f} s "
                  f"({min(values):.3f}-{max(values):.3f})")
        for f in findings_for_run(last):
            if f.rule == "communication-bound":
                print(f"\nlimited run's finding:\n[{f.severity}] {f.title}: {f.message} "
                      f"Fix: {f.fix}")


if __name__ == "__main__":
    main()
