"""``gpufleet doctor``: check this machine for training; exit 1 when something blocks it.

Prints a table on a terminal, plain lines when the output goes to a file or a pipe, and
one JSON object with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from typing import Any

EPILOG = """\
exit status:
  0  nothing blocks training (warnings may still be listed)
  1  something blocks training, or a setting you made is not in effect:
     torch missing; no free TCP port; MASTER_PORT taken on the node that must listen
     on it; MASTER_ADDR not resolving; NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME matching
     no interface; a misspelled NCCL/Gloo/PyTorch variable (a known mistake, or a
     character or two from a real name), which NCCL silently ignores
  Warnings (exit 0): no GPU, small /dev/shm, few cores, old or removed variable
  names, values outside the documented ones, unknown names not close to a real one.

examples:
  gpufleet doctor
  gpufleet doctor --json > doctor.json
  NCCL_IB_DISABLED=1 gpufleet doctor     # flags the typo, suggests NCCL_IB_DISABLE
  gpufleet doctor --allow NCCL_MY_PLUGIN_KNOB
  gpufleet doctor --rdzv-endpoint 10.0.0.1:29400   # interface and store host, multi-node
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``gpufleet doctor`` to the CLI's subparsers.

    Example:
        >>> parser = argparse.ArgumentParser(prog="gpufleet")
        >>> add_parser(parser.add_subparsers(dest="command"))
        >>> parser.parse_args(["doctor", "--json"]).json
        True
    """
    p = sub.add_parser(
        "doctor", help="check versions, GPUs, shared memory, cores, ports and NCCL variables",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description="Check this machine for training: python/torch/CUDA/cuDNN/NCCL "
                    "versions, GPUs and their topology (NVML), /dev/shm size, CPU cores, "
                    "free ports, MASTER_ADDR/MASTER_PORT, and every NCCL_*, TORCH_NCCL_*, "
                    "GLOO_* variable against the names NCCL and PyTorch document.")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    p.add_argument("--allow", action="append", default=[], metavar="NAME",
                   help="a variable not to check (one a plugin of yours reads); repeatable")
    p.add_argument("--master-addr", default="", metavar="HOST",
                   help="node 0's address: which interface reaches it (else MASTER_ADDR)")
    p.add_argument("--rdzv-endpoint", default="", metavar="HOST:PORT",
                   help="an elastic run's endpoint: the interface, and whether this node "
                        "hosts the c10d store")


def run(args: argparse.Namespace) -> int:
    """Run the checks, print them, return 1 when one of them blocks training."""
    from gpufleet.doctor.checks import run_checks
    from gpufleet.doctor.result import FAIL

    environ = {k: v for k, v in os.environ.items() if k not in set(args.allow)}
    results = run_checks(environ, args.master_addr, args.rdzv_endpoint)
    code = 1 if any(r.status == FAIL for r in results) else 0
    if args.json:
        print(json.dumps(report(results, code), indent=2, default=str))
    elif sys.stdout.isatty():
        _print_table(results, code)
    else:
        _print_plain(results, code)
    return code


def report(results: list[Any], code: int) -> dict[str, Any]:
    """The ``--json`` object: host, exit code, counts and every check."""
    counts = {s: sum(r.status == s for r in results) for s in ("ok", "warn", "fail")}
    return {"host": socket.gethostname(), "blocked": code != 0, "exit_code": code,
            "counts": counts, "checks": [r.to_dict() for r in results]}


def _summary(results: list[Any], code: int) -> str:
    counts = report(results, code)["counts"]
    tail = ("something blocks training (exit 1)" if code else "nothing blocks training")
    return (f"{counts['ok']} ok, {counts['warn']} warning(s), {counts['fail']} problem(s): "
            f"{tail}")


def _print_plain(results: list[Any], code: int) -> None:
    width = max(len(r.name) for r in results)
    print(f"gpufleet doctor on {socket.gethostname()}")
    for r in results:
        label = "FAIL" if r.status == "fail" else r.status
        print(f"  {label:<4}  {r.name:<{width}}  {r.message}")
        if r.fix and r.status != "ok":
            print(f"  {'':<4}  {'':<{width}}  fix: {r.fix}")
    print(_summary(results, code))


def _print_table(results: list[Any], code: int) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    style = {"ok": "green", "warn": "yellow", "fail": "bold red"}
    table = Table(title=f"gpufleet doctor on {socket.gethostname()}", show_lines=True)
    table.add_column("check", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("found", overflow="fold")
    table.add_column("fix", overflow="fold")
    for r in results:
        table.add_row(Text(r.name), Text(r.status.upper(), style=style[r.status]),
                      Text(r.message), Text(r.fix if r.status != "ok" else ""))
    console = Console()
    console.print(table)
    console.print(_summary(results, code), style="bold red" if code else "green",
                  highlight=False)
