"""Per-step overhead of the gpufleet loop against a hand-written PyTorch loop.

Both train the same model on the same data with the same optimizer, schedule, clipping
and batch size, on the CPU, in one process, in lockstep: one gpufleet step, then one
hand-written step, then one gpufleet step, ... (the hand-written loop is a generator
that a gpufleet callback advances). Machine noise thus hits both loops alike, which
separate runs on a shared machine do not manage. Each repeat reports the median step
time of each loop and their ratio; the result is the median ratio. Target: <= 1.03.

    python benchmarks/overhead.py              # about a minute on 2 cores
    python benchmarks/overhead.py --repeats 3 --steps 500 --widths 64
    python benchmarks/overhead.py --set fault.skip_nonfinite=false   # a config override
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

import gpufleet
from gpufleet.bench.machine import cpu_model
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


def hand_written(width: int, steps: int, batch: int) -> Iterator[float]:
    """What a careful user writes by hand: the reference. Yields after every step."""
    torch.manual_seed(0)
    model = make_model(width)
    data = make_data()
    loader = DataLoader(data, batch_size=batch, sampler=RandomSampler(data), drop_last=True)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    # The fused kernel, as gpufleet picks where torch has it (CPU included since 2.4).
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}], lr=1e-3, betas=(0.9, 0.95),
                            fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, 20, steps))
    step, it = 0, iter(loader)
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
        yield time.perf_counter()


class _Lockstep(Callback):
    """After each gpufleet step, runs one hand-written step; times both."""

    def __init__(self, hand: Iterator[float]) -> None:
        self.hand = hand
        self.ours: list[float] = []
        self.theirs: list[float] = []
        self.resumed = 0.0

    def on_fit_start(self, trainer):
        self.resumed = time.perf_counter()

    def on_step_end(self, trainer, step):
        ours_done = time.perf_counter()
        self.ours.append(ours_done - self.resumed)
        hand_start = time.perf_counter()
        self.theirs.append(next(self.hand) - hand_start)
        self.resumed = time.perf_counter()


def lockstep(width: int, steps: int, batch: int, out_dir: str,
             extra: tuple[str, ...] = ()) -> tuple[float, float]:
    """Median step time (s) of the hand-written loop and of gpufleet, run in lockstep."""
    hand = hand_written(width, steps, batch)
    torch.manual_seed(0)
    timer = _Lockstep(hand)
    gpufleet.fit(make_model(width), make_data(), loss_fn=F.mse_loss, callbacks=[timer],
                 overrides=[f"run.max_steps={steps}", f"data.batch_size={batch}",
                            "data.num_workers=0", "optim.lr=1e-3", "optim.warmup_steps=20",
                            "log.every=10", "log.progress=off", f"run.out_dir='{out_dir}'",
                            "checkpoint.save_final=false", "run.eval_every=0", *extra])
    return statistics.median(timer.theirs[WARMUP:]), statistics.median(timer.ours[WARMUP:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--widths", default="64,256,1024", help="hidden widths to try")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a gpufleet config override (repeatable)")
    args = parser.parse_args()
    import logging

    logging.getLogger("gpufleet").setLevel("WARNING")
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"python {platform.python_version()}")
    print(f"{args.repeats} repeats x {args.steps} lockstep steps, batch {args.batch}, "
          f"first {WARMUP} steps of each repeat not timed"
          + (f"; gpufleet overrides: {' '.join(args.set)}" if args.set else "") + "\n")
    print(f"{'width':>6} {'hand ms/step':>13} {'gpufleet ms/step':>17} {'ratio (median)':>15}"
          f"  ratios per repeat")
    with tempfile.TemporaryDirectory() as tmp:
        for width in map(int, args.widths.split(",")):
            hand, ours, ratios = [], [], []
            for _ in range(args.repeats):
                h, g = lockstep(width, args.steps, args.batch, tmp, tuple(args.set))
                hand.append(h)
                ours.append(g)
                ratios.append(g / h)
            per_pair = " ".join(f"{r:.3f}" for r in ratios)
            print(f"{width:>6} {statistics.median(hand) * 1e3:>13.3f} "
                  f"{statistics.median(ours) * 1e3:>17.3f} {statistics.median(ratios):>15.3f}"
                  f"  {per_pair}")


if __name__ == "__main__":
    main()
