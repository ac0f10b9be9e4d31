"""How close `gpufleet plan` comes to what the ranks of real runs hold.

For each layout, one real 8-rank run of a small GPT on this machine (gloo, CPU) measures
every rank's parameter, gradient, optimizer-state and saved-activation bytes after a
step (gpufleet.layout.measure.MemoryParts); the planner estimates the same layout on the
fake process group. Prints both and the error per part, and the machine.

    python benchmarks/plan_check.py                   # about a minute a layout on 2 cores
    python benchmarks/plan_check.py --layouts fsdp:8,ddp:8
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

import gpufleet
from gpufleet.config import load_config
from gpufleet.core.machine import machine_summary
from gpufleet.layout.cli import layout_dims
from gpufleet.layout.estimate import estimate_layout
from gpufleet.layout.measure import MemoryParts
from gpufleet.models.gpt import GPT, GPTConfig

PARTS = ("params", "grads", "optimizer", "activations")
# name: (strategy, extra degrees)
LAYOUTS = {
    "ddp": ("ddp", {}),
    "fsdp": ("fsdp", {}),
    "hsdp2x4": ("hsdp", {"parallel.dp_replicate": 2, "parallel.dp_shard": 4}),
    "fsdp4xtp2": ("fsdp", {"parallel.tp": 2}),
}
SEQ, VOCAB = 64, 256


def make_gpt() -> GPT:
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=4, n_head=4, n_embd=128))


def make_tokens() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, VOCAB, (256, SEQ + 1), generator=g)
    return TensorDataset(seq[:, :-1].contiguous(), seq[:, 1:].contiguous())


def check(name: str, ranks: int, batch: int, out_dir: Path) -> dict:
    strategy, extra = LAYOUTS[name]
    settings = {"dist.nproc": ranks, "parallel.strategy": strategy, "data.batch_size": batch,
                **extra}
    data = make_tokens()
    sample = (data.tensors[0][:batch], data.tensors[1][:batch])
    result = gpufleet.fit(make_gpt(), data, overrides={
        **settings, "run.max_steps": 2, "run.eval_every": 0, "data.num_workers": 0,
        "log.progress": "off", "log.level": "WARNING", "run.out_dir": str(out_dir),
        "monitor.report": False, "checkpoint.save_final": False},
        callbacks=[MemoryParts(sample)])
    measured = [json.loads(p.read_text())
                for p in sorted(Path(result.run_dir).glob("memory-rank*.json"))]
    cfg = load_config(overrides=settings)
    est = estimate_layout(cfg, layout_dims(cfg, ranks, ranks), make_gpt).ranks[0]
    real = {p: max(m[p] for m in measured) for p in PARTS}
    estimated = {p: getattr(est, p) for p in PARTS}
    return {"layout": name, "ranks": ranks, "measured": real, "estimated": estimated,
            "total_error": sum(estimated.values()) / sum(real.values()) - 1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default=",".join(f"{n}:8" for n in LAYOUTS),
                    help="name:ranks,... (names: " + ", ".join(LAYOUTS) + ")")
    ap.add_argument("--batch", type=int, default=4, help="samples per rank")
    args = ap.parse_args()
    print(machine_summary())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for item in args.layouts.split(","):
            name, ranks = item.split(":")
            rows.append(check(name, int(ranks), args.batch, Path(tmp)))
    print(f"{'layout':<11}{'ranks':>6}  " + "  ".join(f"{p + ' real/est KiB':>26}"
                                                   for p in PARTS) + "  total error")
    for r in rows:
        cells = "  ".join(f"{r['measured'][p] / 1024:>12.1f} / {r['estimated'][p] / 1024:>10.1f}"
                          for p in PARTS)
        print(f"{r['layout']:<11}{r['ranks']:>6}  {cells}  {100 * r['total_error']:+.1f}%")


if __name__ == "__main__":
    main()
