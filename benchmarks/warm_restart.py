"""Time to the first step after a restart with perf.compile on: with the compile cache
kept in the run directory (gpufleet's default) against without it (a fresh cache).

A first run trains a few steps, compiled, and checkpoints; it leaves its inductor caches
in ``RUN_DIR/compile-cache/<host>/``. Each restart is a new process that resumes from that
checkpoint, as a rank the elastic agent restarts does: "kept" resumes a copy of the run
directory with its cache, "fresh" a copy without it (what a restart on a fresh node or
container, or one whose cache lived in another machine's /tmp, pays). Restarts alternate
(kept, fresh, fresh, kept, ...) so machine drift hits both. Reported per restart: the
seconds from the start of ``fit`` to the end of the first step (model build, compile,
the step), and inductor's FX-graph and AOT-autograd cache hits and misses.

    python benchmarks/warm_restart.py                    # CPU, inductor's C++ backend
    python benchmarks/warm_restart.py --layers 4 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import gpufleet
from gpufleet.core.callbacks import Callback
from gpufleet.core.machine import machine_summary


class _FirstStep(Callback):
    def __init__(self, start: float) -> None:
        self.start, self.first = start, None

    def on_step_end(self, trainer, step: int) -> None:
        if self.first is None:
            self.first = time.perf_counter() - self.start


class _MLP(nn.Module):
    """Blocks of Linear, LayerNorm and GELU. A module of its own: ``nn.Module.compile``
    on a plain ``nn.Sequential`` of torch's layers traces nothing, as torch skips its own
    modules' frames."""

    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width),
                                                  nn.GELU()) for _ in range(layers))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _model(layers: int, width: int) -> nn.Module:
    return _MLP(layers, width)


def child(run_dir: str, layers: int, width: int, steps: int, resume: bool) -> dict:
    """One process's run: train (or resume) compiled; its first step's time and the
    cache counters."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    x, y = torch.randn(512, width), torch.randn(512, 1)
    start = time.perf_counter()
    first = _FirstStep(start)
    overrides = {"perf.compile": True, "run.dir": run_dir, "run.max_steps": steps,
                 "checkpoint.every": 1, "log.progress": "off", "data.batch_size": 32,
                 "data.num_workers": 0, "run.eval_every": 0, "monitor.diagnose": False}
    if resume:
        overrides["checkpoint.resume"] = "latest"
    gpufleet.fit(_model(layers, width), TensorDataset(x, y), loss_fn=F.mse_loss,
                 overrides=overrides, callbacks=[first])
    inductor, aot = counters["inductor"], counters["aot_autograd"]
    return {"first_step_s": first.first,
            "fx_hit": inductor["fxgraph_cache_hit"], "fx_miss": inductor["fxgraph_cache_miss"],
            "aot_hit": aot["autograd_cache_hit"], "aot_miss": aot["autograd_cache_miss"]}


def _spawn(run_dir: Path, args: argparse.Namespace, steps: int, resume: bool) -> dict:
    cmd = [sys.executable, __file__, "--child", str(run_dir), "--layers", str(args.layers),
           "--width", str(args.width), "--steps", str(steps)] + (["--resume"] if resume else [])
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise SystemExit(f"child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="restarts of each kind")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.layers, args.width, args.steps, args.resume)))
        return
    print(f"machine: {machine_summary()}")
    print(f"torch {torch.__version__}; model: {args.layers} x (Linear {args.width}, "
          f"LayerNorm, GELU), whole-model torch.compile (inductor), fit on the CPU")
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        first = _spawn(base, args, 2, resume=False)
        print(f"first run (compiles, fills the cache): first step {first['first_step_s']:.2f} s "
              f"(fx-graph misses {first['fx_miss']}, hits {first['fx_hit']})")
        rows: dict[str, list[dict]] = {"kept": [], "fresh": []}
        order = ["kept", "fresh", "fresh", "kept"] * args.rounds
        for i, kind in enumerate(order[:2 * args.rounds]):
            run = Path(tmp) / f"{kind}-{i}"
            shutil.copytree(base, run, ignore=None if kind == "kept" else
                            shutil.ignore_patterns("compile-cache"))
            got = _spawn(run, args, 3, resume=True)
            rows[kind].append(got)
            print(f"restart {i + 1} ({kind} cache): first step {got['first_step_s']:.2f} s; "
                  f"fx-graph hits {got['fx_hit']} misses {got['fx_miss']}; "
                  f"aot-autograd hits {got['aot_hit']} misses {got['aot_miss']}")
    kept = statistics.median(r["first_step_s"] for r in rows["kept"])
    fresh = statistics.median(r["first_step_s"] for r in rows["fresh"])
    print(f"median: first step after a restart {kept:.2f} s with the kept cache, "
          f"{fresh:.2f} s without: {fresh / kept:.2f}x faster with it")


if __name__ == "__main__":
    main()
