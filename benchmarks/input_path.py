"""What getting each batch onto the device costs the host, path by path.

On a GPU whose host is slow per CUDA call, the small MLP of ``peers.py`` ran 357 µs a
step slower under ``gpufleet.fit`` than under ``Fleet`` (HISTORY.md, the H200 check): the
lead is the input path ``fit`` takes on CUDA, pinned batches (pinned on the training
thread when the loader has no workers) and the side-stream prefetcher (a stream switch,
``wait_stream`` and ``record_stream`` a batch). ``peers.py --breakdown`` prices each as the
difference of two whole loops, which that host resolves only to about ±5%; this times
the input path alone. The same loader (the MLP's 32 x 256 float inputs and int labels,
no workers) feeds each path in turn, and a consumer queues a little work on each batch
on the compute stream (what a step would read), without a host sync:

- ``.to(device)``: a hand-written loop's copy (pageable memory);
- ``pageable, .to(non_blocking)``: what Fabric's loader wrapper does
  (``move_data_to_device``);
- ``pinned, .to(non_blocking)``: ``fit`` with ``data.device_prefetch = false``;
- ``pinned, side-stream prefetch``: ``fit``'s default on CUDA;
- ``pageable, side-stream prefetch``: ``fit`` with ``data.pin_memory = false``.

Paths take turns (a new order each repeat); each prints the median over repeats of the
host's wall and CPU µs per batch, and the ratio to Fabric's path. On a CPU every path
is a pass-through or a no-op copy: the script runs (``--device cpu``), the numbers say
nothing about a GPU.

    python benchmarks/input_path.py                  # CUDA, about 20 s
    python benchmarks/input_path.py --device cpu --batches 200 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import peers  # the peers' MLP job and its data (this script's folder)
import torch
from torch.utils.data import DataLoader

from gpufleet.core.machine import machine_summary
from gpufleet.core.tree import to_device
from gpufleet.data.prefetch import DevicePrefetcher

#: name -> (pin the loader's batches, how batches reach the device)
PATHS: dict[str, tuple[bool, str]] = {
    "pageable, .to(non_blocking) (Fabric's)": (False, "non_blocking"),
    ".to(device) (a hand-written loop's)": (False, "to"),
    "pinned, .to(non_blocking) (fit, device_prefetch off)": (True, "non_blocking"),
    "pinned, side-stream prefetch (fit's default)": (True, "prefetch"),
    "pageable, side-stream prefetch (fit, pin_memory off)": (False, "prefetch"),
}


def batches_on(device: torch.device, loader: DataLoader, how: str) -> Iterator[Any]:
    """Endless batches of ``loader`` on ``device`` by path ``how``."""
    while True:
        if how == "prefetch":
            yield from DevicePrefetcher(loader, device)
        elif how == "non_blocking":
            for batch in loader:
                yield to_device(batch, device, non_blocking=True)
        else:
            for batch in loader:
                yield [t.to(device) for t in batch]


def time_path(device: torch.device, loader: DataLoader, how: str, batches: int,
              consume: Callable[[Any], None], sync: Callable[[], None]) -> tuple[float, float]:
    """Host wall and CPU µs per batch over ``batches`` batches (after a few untimed)."""
    it = batches_on(device, loader, how)
    for _ in range(5):  # the pinned allocator's first blocks, the side stream
        consume(next(it))
    sync()
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(batches):
        consume(next(it))
    sync()
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    it.close()  # ends the pass (and the prefetcher's batch in flight)
    return wall / batches * 1e6, cpu / batches * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--batches", type=int, default=2000, help="timed batches per turn")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    print(machine_summary())
    data = peers.mlp_job(args.batches).data  # the peers' MLP inputs and labels
    features = data.tensors[0].shape[1]
    print(f"batches of {args.batch} x {features} float32 and {args.batch} int64 labels, "
          f"no loader workers, {args.batches} batches a turn, {args.repeats} turns a path; "
          f"on {device}")
    loaders = {pin: DataLoader(data, batch_size=args.batch, shuffle=True, drop_last=True,
                               pin_memory=pin and cuda) for pin in (False, True)}
    weight = torch.randn(features, 10, device=device)
    total = torch.zeros((), device=device)

    def consume(batch: Any) -> None:  # queued on the compute stream; no host read
        x, y = batch
        total.add_((x @ weight).sum() + y.sum())

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    seconds: dict[str, list[tuple[float, float]]] = {name: [] for name in PATHS}
    rng = random.Random(0)
    for r in range(args.repeats):
        order = list(PATHS)
        if r:
            rng.shuffle(order)
        for name in order:
            pin, how = PATHS[name]
            seconds[name].append(time_path(device, loaders[pin], how, args.batches,
                                           consume, sync))
    base = statistics.median(w for w, _ in seconds[next(iter(PATHS))])
    rows = []
    print(f"{'path':55s} {'wall µs':>9s} {'cpu µs':>8s} {'vs Fabric':>9s}")
    for name, runs in seconds.items():
        wall = statistics.median(w for w, _ in runs)
        cpu = statistics.median(c for _, c in runs)
        rows.append({"path": name, "wall_us": wall, "cpu_us": cpu, "ratio": wall / base})
        print(f"{name:55s} {wall:9.1f} {cpu:8.1f} {wall / base:9.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_summary(), "device": str(device),
                       "batch": args.batch, "features": features, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
