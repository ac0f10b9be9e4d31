"""Data wait and step time with the side-stream prefetcher on against off.

gpufleet copies the next batch to the GPU on a side CUDA stream while the current step
computes (``data.device_prefetch = true``, the default); off, each batch is copied on the
compute stream when the loop takes it, so the GPU waits for the copy. An MLP trains on
large float inputs held in host memory (pinned by the loader), so a batch's copy is a
sizable share of its step. Runs with the prefetcher on and off alternate (on, off, off,
on, ...) so machine drift and warm-up hit both; each reports, per step and as medians over its log
intervals after the first, the step time, the host's data wait and the CUDA stream's
time in the data phase (the copy, when it is on the compute stream). On a CPU the
prefetcher is a pass-through and both rows do the same thing.

    python benchmarks/prefetch.py                       # CUDA, about a minute
    python benchmarks/prefetch.py --device cpu --features 256 --hidden 64 --steps 30 \
        --workers 0
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import gpufleet
from gpufleet.core.callbacks import Callback
from gpufleet.core.machine import machine_summary


class _Intervals(Callback):
    """Keeps every logged metrics dict."""

    def __init__(self) -> None:
        self.logs: list[dict[str, Any]] = []

    def on_log(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        self.logs.append(metrics)


def make_model(features: int, hidden: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(features, hidden), nn.GELU(), nn.Linear(hidden, hidden),
                         nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, 1))


def make_data(samples: int, features: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, features, generator=g)
    return TensorDataset(x, x[:, :8].sum(dim=1, keepdim=True))


def one_run(args: argparse.Namespace, data: TensorDataset, prefetch: bool,
            out_dir: str) -> dict[str, float | None]:
    """Medians over the log intervals after the first (start-up) of one run."""
    logs = _Intervals()
    gpufleet.fit(make_model(args.features, args.hidden), data, loss_fn=F.mse_loss,
                 callbacks=[logs], overrides={
                     "run.device": args.device, "run.max_steps": args.steps,
                     "run.out_dir": out_dir, "run.eval_every": 0,
                     "checkpoint.save_final": False, "data.batch_size": args.batch,
                     "data.num_workers": args.workers, "data.pin_memory": True,
                     "data.device_prefetch": prefetch, "optim.lr": 1e-4,
                     "precision.mode": "bf16-mixed" if args.device == "cuda" else "fp32",
                     "monitor.phases": True, "monitor.system_interval_s": 0,
                     "monitor.report": False, "log.every": args.log_every,
                     "log.progress": "off", "log.level": "ERROR"})
    late = logs.logs[1:] or logs.logs

    def median(get: Any) -> float | None:
        values = [get(m) for m in late]
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    return {"step_s": median(lambda m: m["step_time_s"]),
            "data_wait_s": median(lambda m: m["phases"]["data"]),
            "device_data_s": median(lambda m: m.get("device_phases", {}).get("data"))}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    # Defaults: 8 MB of inputs per batch (the loader's pinning keeps up) and about
    # 1-2 ms of bf16 matmuls per step on an H100-class GPU, so the copy (~0.2-0.3 ms over
    # PCIe) is a visible share of a step that the prefetcher can hide.
    p.add_argument("--features", type=int, default=4096, help="floats per sample")
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--samples", type=int, default=8192, help="samples held in host memory")
    p.add_argument("--workers", type=int, default=4, help="data.num_workers")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--repeats", type=int, default=2, help="on/off pairs")
    p.add_argument("--json", help="also write every number to this JSON file")
    args = p.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.steps < 2 * args.log_every:
        p.error(f"--steps {args.steps}: need at least two log intervals of {args.log_every}")
    return args


def _ms(value: float | None) -> str:
    return f"{value * 1e3:.3f}" if value is not None else "n/a"


def main() -> None:
    args = parse_args()
    logging.getLogger("gpufleet").setLevel("ERROR")
    mb = args.batch * args.features * 4 / 2**20
    print(f"machine: {machine_summary()}")
    print(f"MLP {args.features} -> {args.hidden} x3 -> 1 on {args.device}, batch {args.batch} "
          f"({mb:.1f} MB of fp32 inputs per batch), {args.workers} workers, pinned, "
          f"{args.steps} steps per run, {args.repeats} on/off pairs")
    data = make_data(args.samples, args.features)
    runs: dict[str, list[dict[str, float | None]]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            # on, off, off, on, ...: neither setting always runs first (warm caches).
            for name in ("on", "off") if i % 2 == 0 else ("off", "on"):
                runs[name].append(one_run(args, data, name == "on", f"{tmp}/{name}{i}"))
    summary: dict[str, dict[str, float | None]] = {}
    print(f"\n{'prefetch':<9} {'ms/step':>9} {'host data wait ms':>18} {'GPU data phase ms':>18}")
    for name, rows in runs.items():
        summary[name] = {key: (statistics.median(v for r in rows if (v := r[key]) is not None)
                               if any(r[key] is not None for r in rows) else None)
                         for key in rows[0]}
        s = summary[name]
        print(f"{name:<9} {_ms(s['step_s']):>9} {_ms(s['data_wait_s']):>18} "
              f"{_ms(s['device_data_s']):>18}")
    speedup = summary["off"]["step_s"] / summary["on"]["step_s"]
    print(f"\nstep time off / on: {speedup:.3f} (medians over {args.repeats} runs each)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_summary(), "args": vars(args), "runs": runs,
                       "summary": summary, "off_over_on": speedup}, f, indent=1)


if __name__ == "__main__":
    main()
