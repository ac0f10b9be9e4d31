"""The loop of ``fabric_loop.py`` moved onto ``gpufleet.Fleet``: not one line of its
``train`` function changed. Only how the run starts did:

    fabric = Fabric(accelerator="cpu", devices=2, precision="32-true")
    fabric.launch()
    fabric.seed_everything(0)
    train(fabric, data)

became

    fleet = gpufleet.Fleet(accelerator="cpu", devices=2, precision="32-true", seed=0)
    fleet.launch(train, data)

and the same samples, dropout masks, losses and weights follow on 1 and 2 ranks. What
came with it: phase times on every rank, the diagnosis and report.html in the run
directory, the hang watchdog, crash reports, a step with a non-finite loss or gradient
skipped on every rank, and the logged values in metrics.jsonl (and in TensorBoard,
MLflow or W&B with ``monitor.sinks``).

    gpufleet run examples/fabric_loop_fleet.py --nproc 2 -- --data /tmp/fabric-data.pt
    torchrun --nproc-per-node 2 examples/fabric_loop_fleet.py   # the same, torchrun
    python examples/fabric_loop_fleet.py --devices 2            # Fleet starts the ranks
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from fabric_loop import SEED, train

import gpufleet


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="fabric-loop-data.pt", help="the data set's file")
    p.add_argument("--devices", type=int, default=None, help="ranks (default: the "
                   "launcher's)")
    p.add_argument("--out", default=None, help="write each rank's results here")
    p.add_argument("--run-dir", default=None, help="where the run's files go")
    args = p.parse_args()
    devices = args.devices or int(os.environ.get("WORLD_SIZE", "1"))
    fleet = gpufleet.Fleet(accelerator="cpu", devices=devices, precision="32-true",
                           seed=SEED, run_dir=args.run_dir, log_every=5)
    seen = fleet.launch(_train_and_keep, Path(args.data), args.out)
    fleet.print(f"final loss {seen['losses'][-1]:.4f}, eval mse {seen['eval_mse'][-1]:.4f}")


def _train_and_keep(fleet: gpufleet.Fleet, data: Path, out: str | None) -> dict:
    seen = train(fleet, data)
    if out:
        torch.save(seen, Path(out) / f"fleet-rank{fleet.global_rank}.pt")
    return seen


if __name__ == "__main__":
    main()
