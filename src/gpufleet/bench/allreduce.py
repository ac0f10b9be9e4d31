"""``gpufleet bench allreduce``: collective bandwidth on this machine, nccl-tests style.

Starts N ranks with :func:`gpufleet.launch.launch` on the backend training would use
(nccl with GPUs, gloo on CPU) and times, for each message size:

* ``all_reduce`` (sum), reported as nccl-tests does: algorithm bandwidth
  ``algbw = bytes / time`` and bus bandwidth ``busbw = algbw * 2 (n - 1) / n``, the rate
  each link carries in a ring, comparable across rank counts;
* a parameter-server style reduce beside it: ``gather`` to rank 0, sum there,
  ``broadcast`` back. Rank 0's link carries ``2 (n - 1)`` messages, so its time grows
  with the rank count while the ring's stays flat; ``--nproc 2,4`` shows both.

Each time is the slowest rank's mean over ``--iters`` runs after ``--warmup`` untimed
ones. The table ends with the machine it ran on.

Example:
    gpufleet bench allreduce --nproc 2,4 --sizes 4K,1M,64M
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from gpufleet.errors import ConfigError

DEFAULT_SIZES = "4K,64K,1M,16M"
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def add_parser(benches: argparse._SubParsersAction) -> None:
    """Add the ``allreduce`` subcommand to ``gpufleet bench``."""
    p = benches.add_parser(
        "allreduce", help="all-reduce bus bandwidth vs a parameter-server reduce",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Time torch.distributed all_reduce over message sizes on N local ranks "
                    "(nccl on GPUs, gloo on CPU) and report algorithm and bus bandwidth as "
                    "nccl-tests does, beside a parameter-server style reduce (gather to "
                    "rank 0, sum, broadcast) whose cost grows with the rank count.",
        epilog="examples:\n"
               "  gpufleet bench allreduce                       # 2 ranks on CPU, all GPUs\n"
               "  gpufleet bench allreduce --nproc 2,4 --sizes 1K,1M,64M --iters 20")
    p.add_argument("--nproc", default=None, metavar="LIST",
                   help="rank counts to measure, e.g. 2,4 (default: the GPUs, or 2 on CPU)")
    p.add_argument("--sizes", default=DEFAULT_SIZES, metavar="LIST",
                   help=f"message sizes in bytes with K/M/G suffixes (default {DEFAULT_SIZES})")
    p.add_argument("--iters", type=int, default=10, metavar="N",
                   help="timed runs per size and method (default 10)")
    p.add_argument("--warmup", type=int, default=3, metavar="N",
                   help="untimed runs first (default 3)")
    p.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"),
                   help="process-group backend (default: nccl with GPUs, else gloo)")
    p.add_argument("--launcher", default="elastic", choices=("elastic", "spawn"),
                   help="how the ranks are started (default: torch's elastic agent)")
    nodes = p.add_argument_group("across nodes (run the same command on every node)")
    nodes.add_argument("--nnodes", type=int, default=1, metavar="N",
                       help="nodes; --nproc is then the ranks per node (default 1)")
    nodes.add_argument("--node-rank", type=int, default=0, metavar="I",
                       help="this node's index, 0 .. N-1")
    nodes.add_argument("--master-addr", default="127.0.0.1", metavar="HOST",
                       help="node 0's address")
    nodes.add_argument("--master-port", type=int, default=0, metavar="PORT",
                       help="a free port on node 0")


def run(args: argparse.Namespace) -> int:
    """Run ``gpufleet bench allreduce`` with parsed ``args``; prints the table."""
    import torch
    from rich.console import Console

    from gpufleet.core.machine import machine_summary
    from gpufleet.launch import launch

    cuda = torch.cuda.is_available()
    backend = args.backend if args.backend != "auto" else ("nccl" if cuda else "gloo")
    if backend == "nccl" and not cuda:
        raise ConfigError("--backend nccl needs CUDA GPUs, and this machine has none. Use "
                          "--backend gloo (or auto).")
    counts = parse_counts(args.nproc) if args.nproc else [max(2, torch.cuda.device_count())
                                                          if cuda else 2]
    if backend == "nccl" and max(counts) > torch.cuda.device_count():
        raise ConfigError(f"--nproc {max(counts)} with nccl needs as many GPUs; "
                          f"{torch.cuda.device_count()} visible. Lower --nproc.")
    sizes = parse_sizes(args.sizes)
    if args.iters < 1 or args.warmup < 0:
        raise ConfigError(f"--iters {args.iters} --warmup {args.warmup}: need iters >= 1 "
                          "and warmup >= 0.")
    console = Console(highlight=False, soft_wrap=True)
    console.width = max(console.width, 120)  # the table's 8 columns, unwrapped in a pipe
    rows, links = [], []
    multi = args.nnodes > 1
    for n in counts:
        results = launch(measure_rank, (backend, sizes, args.iters, args.warmup), nproc=n,
                         launcher="elastic" if multi else args.launcher,
                         nnodes=str(args.nnodes), node_rank=args.node_rank,
                         master_addr=args.master_addr, master_port=args.master_port)
        if 0 not in results:  # another node's ranks: node 0 prints the tables
            continue
        world = n * args.nnodes
        rows += [(world, *r) for r in results[0]["sizes"]]
        links = results[0]["links"]
    if not rows:
        console.print(f"node {args.node_rank}: done; node 0 prints the results", markup=False)
        return 0
    console.print(_table(rows, backend))
    if multi and links:
        console.print(_links_text(links), markup=False)
    console.print(f"machine: {machine_summary()}", markup=False)
    return 0


def measure_rank(backend: str, sizes: list[int], iters: int, warmup: int) -> dict[str, Any]:
    """Run in each rank: ``{"sizes": [(bytes, all_reduce s, parameter-server s)], "links":
    [...]}``; times are the slowest rank's mean (the same on every rank), links are
    :func:`probe_links` (rank 0's exchange with each other rank, on several nodes)."""
    import torch
    import torch.distributed as dist

    from gpufleet.launch import DistEnv, destroy_process_group, init_process_group

    env = DistEnv.detect()
    init_process_group(env, backend, timeout_s=300)
    device = torch.device("cuda", env.local_rank) if backend == "nccl" else torch.device("cpu")
    try:
        out = []
        for size in sizes:
            x = torch.ones(max(1, size // 4), dtype=torch.float32, device=device)
            ring = _time(lambda x=x: dist.all_reduce(x), iters, warmup, device)
            ps = _time(lambda x=x: _parameter_server_reduce(x, env.world_size), iters,
                       warmup, device)
            times = torch.tensor([ring, ps], dtype=torch.float64, device=device)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
            out.append((x.numel() * 4, *times.tolist()))
        multi_node = env.world_size > env.local_world_size
        links = probe_links(min(max(sizes), 4 << 20), device) if multi_node else []
        return {"sizes": out, "links": links}
    finally:
        destroy_process_group()


def probe_links(nbytes: int, device: Any) -> list[dict[str, Any]]:
    """Time rank 0's exchange of ``nbytes`` with each other rank in turn (a send and a
    receive), so one slow link stands out; every rank gets the same list.

    Returns:
        ``[{"rank", "node", "addr", "seconds", "mbit_s"}]`` for ranks 1 .. n-1, where
        ``mbit_s`` counts both directions (2 x nbytes) per second.
    """
    import torch
    import torch.distributed as dist

    from gpufleet.core.collectives import timed_swap
    from gpufleet.launch import DistEnv, gather_objects
    from gpufleet.launch.netif import node_address

    env = DistEnv.detect()
    who = gather_objects((env.node_rank, node_address(env)))  # COLLECTIVE
    x = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
    times = torch.zeros(env.world_size, dtype=torch.float64, device=device)
    for peer in range(1, env.world_size):
        times[peer] = timed_swap(x, 0, peer)  # COLLECTIVE: one pair at a time
    dist.broadcast(times, src=0)  # COLLECTIVE: rank 0's timings to every rank
    return [{"rank": r, "node": who[r][0], "addr": who[r][1], "seconds": float(times[r]),
             "mbit_s": 2 * x.numel() * 4 * 8 / float(times[r]) / 1e6}
            for r in range(1, env.world_size)]


def _links_text(links: list[dict[str, Any]]) -> str:
    lines = ["links from rank 0 (node 0), each exchange alone:"]
    for link in links:
        lines.append(f"  rank {link['rank']} (node {link['node']}, {link['addr'] or '?'}): "
                     f"{link['mbit_s']:,.1f} Mbit/s ({link['seconds'] * 1e3:,.1f} ms)")
    slowest = min(links, key=lambda link: link["mbit_s"])
    fastest = max(links, key=lambda link: link["mbit_s"])
    if len(links) > 1 and slowest["mbit_s"] < fastest["mbit_s"] / 2:
        lines.append(f"slowest: node {slowest['node']} ({slowest['addr'] or '?'}) at "
                     f"{slowest['mbit_s']:,.1f} Mbit/s: every all-reduce runs at its pace")
    elif len(links) == 1:
        lines.append(f"the all-reduce above runs at this link's pace (node "
                     f"{slowest['node']})")
    return "\n".join(lines)


def _parameter_server_reduce(x: Any, world: int) -> None:
    """Gather every rank's tensor on rank 0, sum there, broadcast the sum back."""
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.gather(x, gather_list=parts, dst=0)
        torch.sum(torch.stack(parts), dim=0, out=x)
    else:
        dist.gather(x, dst=0)
    dist.broadcast(x, src=0)


def _time(fn: Any, iters: int, warmup: int, device: Any) -> float:
    import torch
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()  # start together
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # SYNC: the GPU work is done
    return (time.perf_counter() - start) / iters


def bus_bandwidth(nbytes: int, seconds: float, ranks: int) -> tuple[float, float]:
    """``(algbw, busbw)`` in GB/s for an all-reduce of ``nbytes`` (nccl-tests' formula).

    Example:
        >>> bus_bandwidth(1_000_000_000, 1.0, 4)
        (1.0, 1.5)
    """
    algbw = nbytes / seconds / 1e9
    return algbw, algbw * 2 * (ranks - 1) / ranks


def parse_sizes(text: str) -> list[int]:
    """Message sizes like ``"4K,1M"`` in bytes (multiples of 4: float32 elements).

    Example:
        >>> parse_sizes("4K, 1M,8")
        [4096, 1048576, 8]
    """
    sizes = []
    for part in text.split(","):
        part = part.strip().upper()
        number, unit = part.rstrip("KMGB"), part[len(part.rstrip("KMGB")):]
        unit = unit[:-1] if unit.endswith("B") and len(unit) > 1 else unit
        if not number.isdigit() or unit not in _UNITS or int(number) == 0:
            raise ConfigError(f"--sizes {text!r}: {part!r} is not a size. Give bytes with an "
                              "optional K, M or G, separated by commas, e.g. 4K,1M,64M.")
        sizes.append(int(number) * _UNITS[unit])
    return sizes


def parse_counts(text: str) -> list[int]:
    """Rank counts like ``"2,4"``; each at least 2.

    Example:
        >>> parse_counts("2, 4")
        [2, 4]
    """
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() and int(p) >= 2 for p in parts):
        raise ConfigError(f"--nproc {text!r}: give rank counts of at least 2 separated by "
                          "commas, e.g. --nproc 2,4.")
    return [int(p) for p in parts]


def _human(nbytes: int) -> str:
    for unit, factor in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= factor and nbytes % factor == 0:
            return f"{nbytes // factor}{unit}"
    return f"{nbytes}B"


def _table(rows: list[tuple[int, int, float, float]], backend: str) -> Any:
    from rich.table import Table

    table = Table(title=f"all_reduce vs parameter-server reduce ({backend}, float32 sum)",
                  caption="AR: all_reduce; PS: gather to rank 0, sum, broadcast. Times: "
                          "the slowest rank's mean. algbw = bytes / time; busbw = algbw * "
                          "2(n-1)/n (nccl-tests)",
                  caption_justify="left")
    for name in ("ranks", "size", "AR us", "AR algbw GB/s", "AR busbw GB/s", "PS us",
                 "PS algbw GB/s", "PS/AR"):
        table.add_column(name, justify="right")
    for n, nbytes, ring, ps in rows:
        algbw, busbw = bus_bandwidth(nbytes, ring, n)
        table.add_row(str(n), _human(nbytes), f"{ring * 1e6:,.1f}", f"{algbw:.3f}",
                      f"{busbw:.3f}", f"{ps * 1e6:,.1f}", f"{nbytes / ps / 1e9:.3f}",
                      f"{ps / ring:.2f}x")
    return table
