"""Step time with monitoring fully on against fully off, interleaved.

Two trainers train the same model on the same data: A with every monitor on (phase
timing, FLOP counting, diagnosis, the 1 Hz system sampler), B with all of them off. They
run in two processes that take turns, one optimizer step each (A, B, A, B, ...), so
machine noise hits both alike (two processes, not two threads: torch's thread pools are
per process, and two trainers in one process would share and skew them). Each step is
timed from the moment its trainer resumes to its step end. Each repeat reports the
median step time of each trainer and their ratio; the result is the median ratio.
Target: <= 1.01.

    python benchmarks/monitor_overhead.py                   # about a minute on 2 cores
    python benchmarks/monitor_overhead.py --repeats 3 --steps 200 --widths 256
"""

from __future__ import annotations

import os

# The idle process's OpenMP workers must sleep, not spin, while the other one steps.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import logging
import multiprocessing as mp
import platform
import statistics
import tempfile
import time
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import gpufleet
from gpufleet.bench.machine import cpu_model
from gpufleet.train.callbacks import Callback

WARMUP = 20  # steps left out of the timing

MONITORING_ON = ["monitor.phases=true", "monitor.diagnose=true",
                 "monitor.system_interval_s=1.0"]
MONITORING_OFF = ["monitor.phases=false", "monitor.diagnose=false",
                  "monitor.system_interval_s=0", "monitor.report=false"]


def make_model(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(64, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
                         nn.Linear(width, 1))


def make_data(n: int = 4096) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 64, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).tanh())


class _TakeTurns(Callback):
    """After each step, hands the turn to the other trainer and waits for it back."""

    def __init__(self, mine: Any, other: Any) -> None:
        self.mine, self.other = mine, other
        self.times: list[float] = []
        self.resumed = 0.0

    def _wait_turn(self) -> None:
        self.mine.wait()
        self.mine.clear()
        self.resumed = time.perf_counter()

    def on_fit_start(self, trainer) -> None:
        self._wait_turn()

    def on_step_end(self, trainer, step) -> None:
        self.times.append(time.perf_counter() - self.resumed)
        self.other.set()
        self._wait_turn()


def _train(mine: Any, other: Any, overrides: list[str], width: int, out: Any) -> None:
    """One trainer's process: trains in turns and sends back its step times."""
    logging.getLogger("gpufleet").setLevel("ERROR")
    timer = _TakeTurns(mine, other)
    torch.manual_seed(0)
    try:
        gpufleet.fit(make_model(width), make_data(), loss_fn=F.mse_loss, callbacks=[timer],
                     overrides=overrides)
    finally:
        other.set()  # never leave the other run waiting for its turn
        out.put(timer.times)


def interleaved(width: int, steps: int, batch: int, out_dir: str) -> tuple[float, float]:
    """Median step time (s) with monitoring on and off, the two runs taking turns."""
    ctx = mp.get_context("spawn")
    turn_on, turn_off = ctx.Event(), ctx.Event()
    results_on, results_off = ctx.Queue(), ctx.Queue()
    common = [f"run.max_steps={steps}", f"data.batch_size={batch}", "data.num_workers=0",
              "optim.lr=1e-3", "log.every=10", "log.progress=off",
              "checkpoint.save_final=false", "run.eval_every=0", "log.level=ERROR"]
    runs = [ctx.Process(target=_train, args=(turn_on, turn_off, [
                *common, *MONITORING_ON, f"run.dir='{out_dir}/on'"], width, results_on)),
            ctx.Process(target=_train, args=(turn_off, turn_on, [
                *common, *MONITORING_OFF, f"run.dir='{out_dir}/off'"], width, results_off))]
    for p in runs:
        p.start()
    turn_on.set()  # monitoring-on goes first
    on, off = results_on.get(), results_off.get()
    for p in runs:
        p.join()
    if len(on) <= WARMUP or len(off) <= WARMUP:
        raise RuntimeError("a trainer failed; run with fewer --repeats to see its error")
    return statistics.median(on[WARMUP:]), statistics.median(off[WARMUP:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--widths", default="256,1024", help="hidden widths to try")
    args = parser.parse_args()
    logging.getLogger("gpufleet").setLevel("ERROR")
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, python {platform.python_version()}")
    print(f"{args.repeats} repeats x {args.steps} interleaved steps, batch {args.batch}, "
          f"first {WARMUP} steps of each run not timed")
    print(f"on:  {' '.join(MONITORING_ON)}\noff: {' '.join(MONITORING_OFF)}\n")
    print(f"{'width':>6} {'off ms/step':>12} {'on ms/step':>11} {'ratio (median)':>15}"
          "  ratios per repeat")
    with tempfile.TemporaryDirectory() as tmp:
        for width in map(int, args.widths.split(",")):
            ons, offs, ratios = [], [], []
            for i in range(args.repeats):
                t_on, t_off = interleaved(width, args.steps, args.batch, f"{tmp}/{i}")
                ons.append(t_on)
                offs.append(t_off)
                ratios.append(t_on / t_off)
            print(f"{width:>6} {statistics.median(offs) * 1e3:>12.3f} "
                  f"{statistics.median(ons) * 1e3:>11.3f} {statistics.median(ratios):>15.3f}"
                  f"  {' '.join(f'{r:.3f}' for r in ratios)}")


if __name__ == "__main__":
    main()
