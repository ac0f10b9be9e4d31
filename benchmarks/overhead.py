"""Per-step overhead of the gpufleet loop against a hand-written PyTorch loop.

Both train the same model on the same data with the same optimizer, schedule, clipping
and batch size, on the CPU, in one process. Runs alternate (hand, gpufleet, hand, ...) so
that machine noise hits both alike; the ratio of each pair's median step time is
reported, and the median of those ratios is the result. Target: <= 1.03.

    python benchmarks/overhead.py            # ~2 minutes on 2 cores
    python benchmarks/overhead.py --pairs 3 --steps 200
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import platform
import statistics
import tempfile
import time

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

import gpufleet
from gpufleet.train.callbacks import Callback

WARMUP = 20  # steps left out of the timing (allocator and thread-pool warm-up)


def make_model(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(64, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
                         nn.Linear(width, 1))


def make_data(n: int = 8192) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 64, generator=g)
    return TensorDataset(x, x[:, :1].sin() + 0.1 * torch.randn(n, 1, generator=g))


def lr_lambda(step: int, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - 1 - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def hand_written(width: int, steps: int, batch: int) -> list[float]:
    """What a careful user writes by hand: the reference."""
    torch.manual_seed(0)
    model = make_model(width)
    data = make_data()
    loader = DataLoader(data, batch_size=batch, sampler=RandomSampler(data), drop_last=True)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}], lr=1e-3, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, 20, steps))
    stamps, step, it = [], 0, iter(loader)
    loss_sum = torch.zeros(())
    while step < steps:
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(loader)
            x, y = next(it)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss_sum += loss.detach()
        step += 1
        if step % 10 == 0:
            _ = loss_sum.item() / 10  # the log line a user prints
            loss_sum.zero_()
        stamps.append(time.perf_counter())
    return stamps


class _Stamps(Callback):
    def __init__(self) -> None:
        self.stamps: list[float] = []

    def on_step_end(self, trainer, step):
        self.stamps.append(time.perf_counter())


def with_gpufleet(width: int, steps: int, batch: int, out_dir: str) -> list[float]:
    torch.manual_seed(0)
    stamps = _Stamps()
    gpufleet.fit(make_model(width), make_data(), loss_fn=F.mse_loss, callbacks=[stamps],
                 overrides={"run.max_steps": steps, "data.batch_size": batch,
                            "data.num_workers": 0, "optim.lr": 1e-3, "optim.warmup_steps": 20,
                            "log.every": 10, "log.progress": "off", "run.out_dir": out_dir,
                            "checkpoint.save_final": False})
    return stamps.stamps


def median_step(stamps: list[float]) -> float:
    timed = stamps[WARMUP:]
    return statistics.median(b - a for a, b in itertools.pairwise(timed))


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--widths", default="64,256,1024", help="hidden widths to try")
    args = parser.parse_args()
    import logging

    logging.getLogger("gpufleet").setLevel("WARNING")
    print(f"machine: {cpu_name()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"python {platform.python_version()}")
    print(f"{args.pairs} interleaved pairs x {args.steps} steps, batch {args.batch}, "
          f"first {WARMUP} steps of each run not timed\n")
    print(f"{'width':>6} {'hand ms/step':>13} {'gpufleet ms/step':>17} {'ratio (median)':>15}"
          f" {'ratios per pair':>30}")
    with tempfile.TemporaryDirectory() as tmp:
        for width in map(int, args.widths.split(",")):
            hand, ours, ratios = [], [], []
            for _ in range(args.pairs):
                h = median_step(hand_written(width, args.steps, args.batch))
                g = median_step(with_gpufleet(width, args.steps, args.batch, tmp))
                hand.append(h)
                ours.append(g)
                ratios.append(g / h)
            per_pair = " ".join(f"{r:.3f}" for r in ratios)
            print(f"{width:>6} {statistics.median(hand) * 1e3:>13.3f} "
                  f"{statistics.median(ours) * 1e3:>17.3f} {statistics.median(ratios):>15.3f}"
                  f" {per_pair:>30}")


if __name__ == "__main__":
    main()
