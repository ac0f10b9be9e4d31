"""Per-step overhead of the gpufleet loop against a hand-written PyTorch loop.

Both train the same model on the same data with the same optimizer, schedule, clipping
and batch size, on the CPU, in one process, in lockstep: one gpufleet step, then one
hand-written step, then one gpufleet step, ... (the hand-written loop is a generator
that a gpufleet callback advances). Machine noise thus hits both loops alike, which
separate runs on a shared machine do not manage. Each repeat reports the median step
time of each loop and their ratio; the result is the median ratio. Target: <= 1.02.

Where Lightning Fabric is installed (``import lightning.fabric`` or
``lightning_fabric``), the same loop written for Fabric runs in the same lockstep and
gets its own columns: it takes turns with a hand-written loop of its own (the
``fabric ratio`` is Fabric over that hand loop), in the same repeats; otherwise a note
says it was left out.

    python benchmarks/overhead.py              # about a minute on 2 cores
    python benchmarks/overhead.py --repeats 3 --steps 500 --widths 64
    python benchmarks/overhead.py --set fault.skip_nonfinite=false   # a config override
    python benchmarks/overhead.py --hand-clip gpufleet   # like for like: the hand loop
                                                         # clips with gpufleet's clip
    python benchmarks/overhead.py --clock thread   # CPU time of the training thread:
                                                   # steadier on a shared machine
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

import gpufleet
from gpufleet.core.callbacks import Callback
from gpufleet.core.machine import cpu_model

WARMUP = 20  # steps left out of the timing (allocator and thread-pool warm-up)
# What times a step: the wall clock, or with --clock thread this thread's CPU time
# (time the OS gave to other processes on a shared machine is then not counted).
CLOCK: list[Any] = [time.perf_counter]


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


def _optimizer(model: nn.Module, steps: int) -> tuple[torch.optim.Optimizer, Any]:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    # The fused kernel, as gpufleet picks where torch has it (CPU included since 2.4).
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}], lr=1e-3, betas=(0.9, 0.95),
                            fused=True)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, 20, steps))


def _batches(loader: DataLoader) -> Iterator[Any]:
    while True:
        yield from loader


def hand_written(width: int, steps: int, batch: int, clip: str = "torch") -> Iterator[float]:
    """What a careful user writes by hand: the reference. Yields after every step.
    ``clip="gpufleet"`` clips with gpufleet's own clip instead of torch's (like for
    like: what is left is the loop's own overhead)."""
    torch.manual_seed(0)
    model = make_model(width)
    data = make_data()
    loader = DataLoader(data, batch_size=batch, sampler=RandomSampler(data), drop_last=True)
    opt, sched = _optimizer(model, steps)
    params = list(model.parameters())
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
        if clip == "torch":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        else:
            from gpufleet.parallel.grad_norm import clip_whole_

            clip_whole_(params, 1.0, x.device)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss_sum += loss.detach()
        step += 1
        if step % 10 == 0:
            _ = loss_sum.item() / 10  # the log line a user prints
            loss_sum.zero_()
        yield CLOCK[0]()


def _fabric_class() -> Any:
    """Lightning Fabric's class, or None where it is not installed."""
    for name in ("lightning.fabric", "lightning_fabric"):
        try:
            return importlib.import_module(name).Fabric
        except ImportError:
            continue
    return None


def fabric_written(width: int, steps: int, batch: int) -> Iterator[float]:
    """The same loop as a Lightning Fabric user writes it (Fabric's model, optimizer and
    loader wrappers, its backward and clip). Yields after every step."""
    fabric = _fabric_class()(accelerator="cpu", devices=1, precision="32-true")
    torch.manual_seed(0)
    model = make_model(width)
    data = make_data()
    opt, sched = _optimizer(model, steps)
    model, opt = fabric.setup(model, opt)
    loader = fabric.setup_dataloaders(
        DataLoader(data, batch_size=batch, sampler=RandomSampler(data), drop_last=True))
    loss_sum = torch.zeros(())
    it = _batches(loader)
    for step in range(1, steps + 1):
        x, y = next(it)
        loss = F.mse_loss(model(x), y)
        fabric.backward(loss)
        fabric.clip_gradients(model, opt, max_norm=1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss_sum += loss.detach()
        if step % 10 == 0:
            _ = loss_sum.item() / 10
            loss_sum.zero_()
        yield CLOCK[0]()


class _Lockstep(Callback):
    """After each gpufleet step, runs one hand-written step; times both."""

    def __init__(self, hand: Iterator[float]) -> None:
        self.hand = hand
        self.ours: list[float] = []
        self.theirs: list[float] = []
        self.resumed = 0.0

    def on_fit_start(self, trainer):
        self.resumed = CLOCK[0]()

    def on_step_end(self, trainer, step):
        ours_done = CLOCK[0]()
        self.ours.append(ours_done - self.resumed)
        hand_start = CLOCK[0]()
        self.theirs.append(next(self.hand) - hand_start)
        self.resumed = CLOCK[0]()


def lockstep(width: int, steps: int, batch: int, out_dir: str, extra: tuple[str, ...] = (),
             hand_clip: str = "torch") -> tuple[float, float]:
    """Median step time (s) of the hand-written loop and of gpufleet, run in lockstep."""
    hand = hand_written(width, steps, batch, hand_clip)
    torch.manual_seed(0)
    timer = _Lockstep(hand)
    gpufleet.fit(make_model(width), make_data(), loss_fn=F.mse_loss, callbacks=[timer],
                 overrides=[f"run.max_steps={steps}", f"data.batch_size={batch}",
                            # The hand loop's recipe: AdamW, decay 0.1 on matrices, beta2
                            # 0.95, clip 1.0, 20 warm-up steps, cosine (the gpt preset).
                            "data.num_workers=0", "optim.preset=gpt", "optim.lr=1e-3",
                            "log.every=10", "log.progress=off", f"run.out_dir='{out_dir}'",
                            "checkpoint.save_final=false", "run.eval_every=0", *extra])
    return statistics.median(timer.theirs[WARMUP:]), statistics.median(timer.ours[WARMUP:])


def fabric_lockstep(width: int, steps: int, batch: int,
                    hand_clip: str = "torch") -> tuple[float, float]:
    """Median step time (s) of the hand-written loop and of the Fabric loop, in a
    lockstep of their own (two loops taking turns, as gpufleet and the hand loop do: a
    third loop in the same turn order would put each one after a different neighbour)."""
    loops = (hand_written(width, steps, batch, hand_clip), fabric_written(width, steps, batch))
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(steps):
        for loop, kept in zip(loops, times):
            start = CLOCK[0]()
            kept.append(next(loop) - start)
    return statistics.median(times[0][WARMUP:]), statistics.median(times[1][WARMUP:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--widths", default="64,256,1024", help="hidden widths to try")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a gpufleet config override (repeatable)")
    parser.add_argument("--hand-clip", choices=("torch", "gpufleet"), default="torch",
                        help="the hand-written loop's clip: torch's clip_grad_norm_ (what a "
                             "user writes) or gpufleet's (like for like)")
    parser.add_argument("--clock", choices=("wall", "thread"), default="wall",
                        help="time steps by the wall clock, or by this thread's CPU time "
                             "(not counting time other processes had the core)")
    args = parser.parse_args()
    if args.clock == "thread":
        CLOCK[0] = time.thread_time
    import logging

    logging.getLogger("gpufleet").setLevel("WARNING")
    fabric = _fabric_class() is not None
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"python {platform.python_version()}")
    print(f"{args.repeats} repeats x {args.steps} lockstep steps, batch {args.batch}, "
          f"first {WARMUP} steps of each repeat not timed; hand loop clips with "
          f"{args.hand_clip}'s clip; {args.clock} clock"
          + (f"; gpufleet overrides: {' '.join(args.set)}" if args.set else ""))
    print("Lightning Fabric: " + ("its loop takes turns with a hand loop of its own"
                                  if fabric else
                                  "not installed, left out (pip install lightning)") + "\n")
    print(f"{'width':>6} {'hand ms/step':>13} {'gpufleet ms/step':>17} {'ratio (median)':>15}"
          + (f" {'fabric ms/step':>15} {'fabric ratio':>13}" if fabric else "")
          + "  gpufleet ratios per repeat")
    with tempfile.TemporaryDirectory() as tmp:
        for width in map(int, args.widths.split(",")):
            pairs, fabric_pairs = [], []
            for _ in range(args.repeats):  # the two lockstep runs alternate
                pairs.append(lockstep(width, args.steps, args.batch, tmp, tuple(args.set),
                                      args.hand_clip))
                if fabric:
                    fabric_pairs.append(fabric_lockstep(width, args.steps, args.batch,
                                                        args.hand_clip))
            ratios = [ours / hand for hand, ours in pairs]
            line = (f"{width:>6} {statistics.median(h for h, _ in pairs) * 1e3:>13.3f} "
                    f"{statistics.median(o for _, o in pairs) * 1e3:>17.3f} "
                    f"{statistics.median(ratios):>15.3f}")
            if fabric:
                line += (f" {statistics.median(f for _, f in fabric_pairs) * 1e3:>15.3f} "
                         f"{statistics.median(f / h for h, f in fabric_pairs):>13.3f}")
            print(line + "  " + " ".join(f"{r:.3f}" for r in ratios))


if __name__ == "__main__":
    main()
