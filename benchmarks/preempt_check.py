"""What the preemption check costs a step: PreemptionWatch.should_stop on 2 gloo ranks
(one int all-reduced on the CPU every ``--check-every`` steps), against a step of an MLP
under DDP, side by side.

Each rank alternates blocks of 200 DDP steps with and without the check after each step
(the checks interleaved with the steps, as in the loop), 5 blocks each; reported: the
median step time of each and the ratio.

Usage:
    python benchmarks/preempt_check.py
    python benchmarks/preempt_check.py --check-every 1 --width 1024
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from gpufleet.core.machine import machine_summary
from gpufleet.fault.preempt import PreemptionWatch
from gpufleet.launch import launch


def rank_main(width: int, steps: int, blocks: int, every: int) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, width), torch.randn(64, 1)
    watch = PreemptionWatch(check_every=every, distributed=True)
    times: dict[str, list[float]] = {"off": [], "on": []}
    step = 0
    for _ in range(blocks):
        for mode in ("off", "on"):
            start = time.perf_counter()
            for _ in range(steps):
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                step += 1
                if mode == "on":
                    watch.should_stop(step)  # COLLECTIVE: one int on the CPU
            times[mode].append((time.perf_counter() - start) / steps)
    watch.close()
    dist.destroy_process_group()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--check-every", type=int, default=10,
                        help="fault.preempt_check_every (default 10, the config default)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(machine_summary())
    times = launch(rank_main, (args.width, args.steps, args.blocks, args.check_every), nproc=2,
                   launcher="spawn")[0]
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    print(f"DDP MLP width {args.width}, 2 gloo ranks, {args.blocks} x {args.steps} steps "
          f"per mode, a check every {args.check_every} step(s)")
    print(f"step without check {off * 1e3:.3f} ms, with check {on * 1e3:.3f} ms, "
          f"ratio {on / off:.3f} (+{(on - off) * 1e6:.0f} us per step)")


if __name__ == "__main__":
    main()
