"""Per-rank training-state memory of ``ddp``, ``zero1`` and ``fsdp``, measured.

Each configuration starts N gloo ranks on the CPU; every rank builds the same GPT of
about 50M parameters, wraps it with the gpufleet strategy (the project's own
``distribute``/``setup_optimizer``), runs one forward/backward and one AdamW step, and
then counts the bytes of the tensors it actually holds: its parameters, their gradients
and the optimizer state, each as the local tensor (a DTensor's local shard for fsdp,
the local optimizer's state for zero1). Nothing is estimated. The table shows the
largest rank (the one that limits the model size), the smallest, and the ratio of the
largest to ddp at the same world size. Target: fsdp about 1/N of ddp plus small
overhead.

Not counted: activations (freed after backward), DDP's gradient buckets (ddp and zero1
keep a second copy of the gradients in them unless parallel.ddp.gradient_as_bucket_view),
and FSDP's transient all-gather buffers. "RSS" is the rank's resident memory after the
step, for orientation: it includes the Python interpreter and torch itself.

    python benchmarks/memory.py                    # about a minute on 2 cores
    python benchmarks/memory.py --worlds 2 --layers 4
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import tempfile
import warnings
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gpufleet.bench.loader import machine_summary
from gpufleet.config import OptimConfig, ParallelConfig
from gpufleet.launch import free_port
from gpufleet.models.gpt import build_gpt
from gpufleet.parallel import build_strategy
from gpufleet.parallel.parallelize import distribute
from gpufleet.precision import build_precision
from gpufleet.train.optim import fill_optimizer_defaults, optimizer_spec

STRATEGIES = ("ddp", "zero1", "fsdp")
MB = 1024 * 1024


def local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank stores for ``t`` (its local shard when ``t`` is a DTensor)."""
    to_local = getattr(t, "to_local", None)
    local = to_local() if to_local is not None else t
    return local.numel() * local.element_size()


def measure(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    params = list(model.parameters())  # shared (tied) parameters once
    inner = getattr(optimizer, "optim", optimizer)  # zero1: the rank's local optimizer
    state = [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v)]
    return {"params": sum(map(local_bytes, params)),
            "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
            "optim": sum(map(local_bytes, state))}


def _rank(rank: int, world: int, port: int, strategy: str, args: argparse.Namespace,
          out: str) -> None:
    torch.set_num_threads(1)  # the ranks share the machine's cores
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's DDP deprecations
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        torch.manual_seed(0)
        model = build_gpt(n_layer=args.layers, n_head=args.heads, n_embd=args.width,
                          block_size=args.seq)
        n_params = sum(p.numel() for p in model.parameters())
        precision = build_precision("fp32", "cpu")
        strat = build_strategy(strategy, ParallelConfig(), torch.device("cpu"), precision)
        optim_cfg = fill_optimizer_defaults(OptimConfig(), model)  # the GPT's defaults
        model = distribute(model, strat)
        optimizer = strat.setup_optimizer(model, optimizer_spec(optim_cfg, "cpu"))
        idx = torch.randint(0, 256, (args.batch, args.seq))
        strat.forward_backward(model, (idx, idx), lambda m, b: m(b[0], targets=b[1]),
                               precision, 1.0)
        optimizer.step()
        gc.collect()
        result = {**measure(model, optimizer), "n_params": n_params,
                  "rss": psutil.Process().memory_info().rss}
        Path(out, f"{strategy}-{world}-{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def run(strategy: str, world: int, args: argparse.Namespace, out: str) -> list[dict]:
    mp.spawn(_rank, args=(world, free_port(), strategy, args, out), nprocs=world)
    return [json.loads(Path(out, f"{strategy}-{world}-{r}.json").read_text())
            for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--width", type=int, default=640)
    parser.add_argument("--heads", type=int, default=10)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    print(f"machine: {machine_summary()}, python {platform.python_version()}, "
          f"{os.cpu_count()} logical CPUs")
    print(f"model: GPT {args.layers} layers x {args.width} wide, AdamW, fp32, gloo on CPU")
    header = (f"{'strategy':<8} {'ranks':>5} {'params MB':>10} {'grads MB':>9} "
              f"{'optim MB':>9} {'total MB':>9} {'min rank MB':>12} {'vs ddp':>7} "
              f"{'RSS MB':>7}")
    with tempfile.TemporaryDirectory() as out:
        for world in args.worlds:
            ddp_total = None
            for strategy in STRATEGIES:
                ranks = run(strategy, world, args, out)
                if ddp_total is None:
                    print(f"parameters: {ranks[0]['n_params'] / 1e6:.1f}M\n{header}")
                totals = [r["params"] + r["grads"] + r["optim"] for r in ranks]
                top = ranks[totals.index(max(totals))]
                ddp_total = ddp_total or max(totals)
                print(f"{strategy:<8} {world:>5} {top['params'] / MB:>10.1f} "
                      f"{top['grads'] / MB:>9.1f} {top['optim'] / MB:>9.1f} "
                      f"{max(totals) / MB:>9.1f} {min(totals) / MB:>12.1f} "
                      f"{max(totals) / ddp_total:>7.3f} "
                      f"{max(r['rss'] for r in ranks) / MB:>7.0f}")


if __name__ == "__main__":
    main()
