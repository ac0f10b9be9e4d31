"""How ``gpufleet plan`` prints a layout's estimate."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from gpufleet.config import Config
from gpufleet.layout.devices import GIB, USABLE_SHARE
from gpufleet.layout.estimate import LayoutEstimate
from gpufleet.monitor.flops import PEAK_FLOPS
from gpufleet.resolve import auto_tf32, recipe_preset

MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "buffers")


def gib(n: float) -> str:
    return f"{n / GIB:,.2f}"


def print_estimate(cfg: Any, est: LayoutEstimate, nodes: int, per_node: int,
                   device: Any, strategy: str | None, console: Console | None = None) -> None:
    """The layout, one row per pipeline stage, the traffic per mesh dimension, FLOPs."""
    console = console or Console()
    dims = est.dims
    console.print(f"layout: {dims.describe()} = {dims.world_size} ranks ({nodes} node(s) x "
                  f"{per_node}); micro-batch {est.micro_batch}, "
                  f"{cfg.optim.grad_accum} accumulation step(s), {cfg.precision.mode}, "
                  f"optimizer {cfg.optim.name}", highlight=False)
    table = Table(title="memory per rank (GiB)")
    for column in ("stage", "ranks", *MEMORY_PARTS, "total", "in flight"):
        table.add_column(column, justify="right")
    per_stage = dims.world_size // dims.pp
    for r in est.ranks:
        table.add_row(str(r.stage), f"{r.rank}-{r.rank + per_stage - 1}",
                      *(gib(getattr(r, p)) for p in MEMORY_PARTS), gib(r.total),
                      str(r.in_flight))
    console.print(table)
    peak = est.peak
    comm = Table(title="per optimizer step, the rank with the most memory")
    comm.add_column("what")
    comm.add_column("amount", justify="right")
    for dim, sent in sorted(peak.comm.items()):
        comm.add_row(f"sent on {dim}", f"{sent / GIB:,.3f} GiB")
    comm.add_row("FLOPs", f"{peak.flops:.3e}")
    rate = _peak_rate(device, cfg)
    if rate:
        comm.add_row("compute time at 100% / 40% MFU",
                     f"{peak.flops / rate:.3f} s / {peak.flops / rate / 0.4:.3f} s")
    console.print(comm)
    console.print("activations: the tensors autograd saves in one micro-batch's forward, "
                  "counted on fake tensors in the dtypes the device's autocast gives "
                  "(CUDA's with --gpu, else the CPU's; attention as a fused flash kernel "
                  "saves it), times the micro-batches a stage holds "
                  "(in flight); not counted: the CUDA context, NCCL buffers, temporaries "
                  "inside kernels.", highlight=False)
    if strategy:
        console.print(f"gpufleet train runs this layout with --strategy {strategy}.",
                      highlight=False)
    else:
        console.print("gpufleet train cannot run this combination of degrees yet; the "
                      "estimate shows what it would need.", highlight=False)
    if device is not None:
        fits = peak.total <= device.usable_bytes
        console.print(f"{device.name}: {gib(peak.total)} of {gib(device.usable_bytes)} GiB "
                      f"usable ({USABLE_SHARE:.0%} of {gib(device.memory_bytes)}) on rank "
                      f"{peak.rank}: {'fits' if fits else 'does NOT fit'}.", highlight=False)


def print_suggestion(found: LayoutEstimate | None, device: Any,
                     console: Console | None = None) -> None:
    """The nearest layout that fits, or what to change when none does."""
    console = console or Console()
    if found is None:
        console.print(f"no layout of this many ranks fits {device.name} within the search: "
                      "add nodes, lower --batch-size (raise --grad-accum to keep the "
                      "batch), or turn on --parallel.activation_checkpointing.",
                      highlight=False)
        return
    d = found.dims
    flags = " ".join(f"--parallel.{n}={getattr(d, n)}"
                     for n in ("dp_replicate", "dp_shard", "tp", "pp"))
    console.print(f"nearest layout that fits: {d.describe()} ({gib(found.peak.total)} GiB on "
                  f"its fullest rank): {flags}", highlight=False)


def _peak_rate(device: Any, cfg: Config) -> float | None:
    """The GPU's peak rate for the run's matmuls: fp32 ones at the TF32 rate only where
    the run turns TF32 on (``auto``: the built-in GPT's recipe does)."""
    if device is None:
        return None
    name = device.name.split("-")[0].lower()
    tf32 = cfg.perf.tf32 if cfg.perf.tf32 != "auto" else auto_tf32(recipe_preset(cfg), "cuda")
    precision = {"bf16-mixed": "bf16", "fp16-mixed": "fp16"}.get(
        cfg.precision.mode, "tf32" if tf32 == "true" else "fp32")
    for key, rates in PEAK_FLOPS.items():
        if key.lower().replace(" ", "") == name or key.lower() == name:
            return rates.get(precision)
    return None
