"""Step time with monitoring fully on against fully off, interleaved.

Two trainers train the same model on the same data: A with every monitor on (phase
timing, FLOP counting, diagnosis, the 1 Hz system sampler), B with all of them off
(``--rows`` also compares single parts: phases, sampler, the non-finite check). They
run in two processes that take turns, one optimizer step each (A, B, A, B, ...), so
machine noise hits both alike (two processes, not two threads: torch's thread pools are
per process, and two trainers in one process would share and skew them). Each step is
timed from the moment its trainer resumes to its step end. Each repeat reports the
median step time of each trainer and their ratio; the result is the median ratio.
Target: <= 1.01. On CUDA each timed step ends with a device synchronize (both trainers
alike), so a step's time includes its GPU work.

    python benchmarks/monitor_overhead.py                   # about a minute on 2 cores
    python benchmarks/monitor_overhead.py --repeats 3 --steps 200 --widths 256
    python benchmarks/monitor_overhead.py --device cuda --model gpt --widths 768 \
        --rows monitoring,phases,sampler,nonfinite --json overhead.json
"""

from __future__ import annotations

import os

# The idle process's OpenMP workers must sleep, not spin, while the other one steps.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import logging
import multiprocessing as mp
import statistics
import tempfile
import time
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import gpufleet
from gpufleet.core.callbacks import Callback
from gpufleet.core.machine import machine_summary
from gpufleet.models.gpt import build_gpt

WARMUP = 20  # steps left out of the timing

MONITORING_ON = ["monitor.phases=true", "monitor.diagnose=true",
                 "monitor.system_interval_s=1.0"]
MONITORING_OFF = ["monitor.phases=false", "monitor.diagnose=false",
                  "monitor.system_interval_s=0", "monitor.report=false"]
# Each row: (overrides of the "on" trainer, of the "off" one). "monitoring" is everything
# the monitor does (the fault checks stay at their defaults in both); the others switch one
# part on against everything off.
ROWS: dict[str, tuple[list[str], list[str]]] = {
    "monitoring": (MONITORING_ON, MONITORING_OFF),
    "phases": ([*MONITORING_OFF, "monitor.phases=true"], MONITORING_OFF),
    "sampler": ([*MONITORING_OFF, "monitor.system_interval_s=1.0"], MONITORING_OFF),
    "nonfinite": ([*MONITORING_OFF, "fault.skip_nonfinite=true"],
                  [*MONITORING_OFF, "fault.skip_nonfinite=false"]),
}
GPT_SEQ, GPT_VOCAB = 256, 8192  # --model gpt: 4 blocks of the given width


def make_model(width: int, kind: str = "mlp") -> nn.Module:
    if kind == "gpt":
        return build_gpt(n_layer=4, n_head=max(1, width // 64), n_embd=width,
                         block_size=GPT_SEQ, vocab_size=GPT_VOCAB)
    return nn.Sequential(nn.Linear(64, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
                         nn.Linear(width, 1))


def make_data(n: int = 4096, kind: str = "mlp") -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    if kind == "gpt":  # random tokens: the loss is not the point, the step time is
        tokens = torch.randint(0, GPT_VOCAB, (n // 4, GPT_SEQ + 1), generator=g)
        return TensorDataset(tokens[:, :-1], tokens[:, 1:])
    x = torch.randn(n, 64, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).tanh())


class _TakeTurns(Callback):
    """After each step, hands the turn to the other trainer and waits for it back."""

    def __init__(self, mine: Any, other: Any, cuda: bool = False) -> None:
        self.mine, self.other = mine, other
        self.sync = torch.cuda.synchronize if cuda else (lambda: None)
        self.times: list[float] = []
        self.resumed = 0.0

    def _wait_turn(self) -> None:
        self.mine.wait()
        self.mine.clear()
        self.resumed = time.perf_counter()

    def on_fit_start(self, trainer) -> None:
        self._wait_turn()

    def on_step_end(self, trainer, step) -> None:
        self.sync()  # CUDA: the step's kernels are done before the clock is read
        self.times.append(time.perf_counter() - self.resumed)
        self.other.set()
        self._wait_turn()


def _train(mine: Any, other: Any, overrides: list[str], width: int, kind: str,
           out: Any) -> None:
    """One trainer's process: trains in turns and sends back its step times."""
    logging.getLogger("gpufleet").setLevel("ERROR")
    cuda = any(o == "run.device=cuda" for o in overrides)
    timer = _TakeTurns(mine, other, cuda)
    torch.manual_seed(0)
    loss_fn = F.mse_loss if kind == "mlp" else None  # the GPT returns its own loss
    try:
        gpufleet.fit(make_model(width, kind), make_data(kind=kind), loss_fn=loss_fn,
                     callbacks=[timer], overrides=overrides)
    finally:
        other.set()  # never leave the other run waiting for its turn
        out.put(timer.times)


def interleaved(width: int, steps: int, batch: int, out_dir: str, row: str = "monitoring",
                kind: str = "mlp", device: str = "cpu") -> tuple[float, float]:
    """Median step time (s) of a row's "on" and "off" trainers, the two taking turns."""
    ctx = mp.get_context("spawn")
    turn_on, turn_off = ctx.Event(), ctx.Event()
    results_on, results_off = ctx.Queue(), ctx.Queue()
    common = [f"run.max_steps={steps}", f"data.batch_size={batch}", "data.num_workers=0",
              "optim.lr=1e-3", "log.every=10", "log.progress=off",
              "checkpoint.save_final=false", "run.eval_every=0", "log.level=ERROR",
              f"run.device={device}"]
    on_set, off_set = ROWS[row]
    runs = [ctx.Process(target=_train, args=(turn_on, turn_off, [
                *common, *on_set, f"run.dir='{out_dir}/on'"], width, kind, results_on)),
            ctx.Process(target=_train, args=(turn_off, turn_on, [
                *common, *off_set, f"run.dir='{out_dir}/off'"], width, kind, results_off))]
    for p in runs:
        p.start()
    turn_on.set()  # monitoring-on goes first
    on, off = results_on.get(), results_off.get()
    for p in runs:
        p.join()
    if len(on) <= WARMUP or len(off) <= WARMUP:
        raise RuntimeError("a trainer failed; run with fewer --repeats to see its error")
    return statistics.median(on[WARMUP:]), statistics.median(off[WARMUP:])


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--widths", default="256,1024", help="hidden widths to try")
    parser.add_argument("--model", choices=("mlp", "gpt"), default="mlp",
                        help=f"mlp (3 layers) or gpt (4 blocks, seq {GPT_SEQ})")
    parser.add_argument("--device", choices=("cpu", "cuda", "auto"), default="auto")
    parser.add_argument("--rows", default="monitoring",
                        help=f"comma-separated, of: {', '.join(ROWS)}")
    parser.add_argument("--json", help="also write every number to this JSON file")
    args = parser.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.rows = args.rows.split(",")
    unknown = [r for r in args.rows if r not in ROWS]
    if unknown:
        parser.error(f"--rows: unknown {', '.join(unknown)}; choose from {', '.join(ROWS)}")
    if args.steps <= WARMUP:
        parser.error(f"--steps {args.steps} must exceed the {WARMUP} warm-up steps")
    return args


def main() -> None:
    args = parse_args()
    logging.getLogger("gpufleet").setLevel("ERROR")
    print(f"machine: {machine_summary()}; {torch.get_num_threads()} threads")
    print(f"{args.repeats} repeats x {args.steps} interleaved steps, batch {args.batch}, "
          f"{args.model} on {args.device}, first {WARMUP} steps of each run not timed")
    for row in args.rows:
        print(f"{row}: on = {' '.join(ROWS[row][0])}; off = {' '.join(ROWS[row][1])}")
    print(f"\n{'row':<11} {'width':>6} {'off ms/step':>12} {'on ms/step':>11} "
          f"{'ratio (median)':>15}  ratios per repeat")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for row in args.rows:
            for width in map(int, args.widths.split(",")):
                ons, offs, ratios = [], [], []
                for i in range(args.repeats):
                    t_on, t_off = interleaved(width, args.steps, args.batch,
                                              f"{tmp}/{row}-{width}-{i}", row, args.model,
                                              args.device)
                    ons.append(t_on)
                    offs.append(t_off)
                    ratios.append(t_on / t_off)
                results.append({"row": row, "width": width, "off_s": statistics.median(offs),
                                "on_s": statistics.median(ons),
                                "ratio": statistics.median(ratios), "ratios": ratios})
                print(f"{row:<11} {width:>6} {statistics.median(offs) * 1e3:>12.3f} "
                      f"{statistics.median(ons) * 1e3:>11.3f} "
                      f"{statistics.median(ratios):>15.3f}  "
                      f"{' '.join(f'{r:.3f}' for r in ratios)}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_summary(), "device": args.device,
                       "model": args.model, "steps": args.steps, "batch": args.batch,
                       "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
