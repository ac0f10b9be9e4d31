"""``gpufleet top``: a live view of every GPU and the processes on it (NVML + psutil).

Like ``nvidia-smi``/``gpustat``: one row per GPU (utilisation, memory, power,
temperature, SM clock) and the processes using it (pid, user, GPU memory, CPU, RSS,
command). Without an NVIDIA GPU it says so and shows the host: CPU per core, RAM and the
processes using the most memory. ``--once`` prints one snapshot, ``--json`` prints it as
JSON (one object; with ``--once`` off, one line per refresh).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

TOP_PROCESSES = 10  # processes shown without GPUs (the biggest by resident memory)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``gpufleet top`` to the CLI's subparsers.

    Example:
        >>> parser = argparse.ArgumentParser(prog="gpufleet")
        >>> add_parser(parser.add_subparsers(dest="command"))
        >>> args = parser.parse_args(["top", "--once", "--json"])
        >>> args.once, args.json, args.interval
        (True, True, 1.0)
    """
    p = sub.add_parser("top", help="live view of the GPUs and their processes",
                       description="A live per-GPU and per-process view (NVML and psutil). "
                                   "Ctrl-C ends it.")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--interval", type=float, default=1.0, metavar="S",
                   help="seconds between refreshes (default 1)")


def snapshot(nvml: Any, cpu_window_s: float = 0.2) -> dict[str, Any]:
    """What ``top`` shows, as a dict: the host, each GPU with its processes.

    Args:
        nvml: an open :class:`~gpufleet.monitor.nvml.Nvml`, or None (no GPUs).
        cpu_window_s: seconds over which CPU use is measured (per core and per process).

    Example:
        >>> snap = snapshot(None, cpu_window_s=0.05)
        >>> snap["gpus"], len(snap["processes"]) > 0
        ([], True)
    """
    import socket

    import psutil

    from gpufleet.monitor.system import host_sample

    procs = {p.pid: p for p in psutil.process_iter()}
    for p in procs.values():
        _safe(p.cpu_percent)  # starts each process's CPU clock
    psutil.cpu_percent(percpu=True)
    time.sleep(cpu_window_s)
    host = host_sample([], "/")
    gpus = nvml.sample() if nvml is not None else []
    shown: set[int] = set()
    for g in gpus:
        g["processes"] = [{**gp, **_describe(procs.get(gp["pid"]))}
                          for gp in nvml.processes(g["index"])]
        shown.update(gp["pid"] for gp in g["processes"])
    if not gpus:  # without GPUs, the host's biggest processes
        biggest = sorted(procs.values(), key=lambda p: _safe(lambda: p.memory_info().rss) or 0,
                         reverse=True)[:TOP_PROCESSES]
        shown = {p.pid for p in biggest}
    processes = [{"pid": pid, **_describe(procs.get(pid))} for pid in shown]
    processes.sort(key=lambda p: p.get("rss_mb") or 0, reverse=True)
    return {"time": round(time.time(), 3), "host": socket.gethostname(),
            "cpu_pct": host["cpu_pct"], "ram_used_mb": host["ram_used_mb"],
            "ram_total_mb": host["ram_total_mb"], "gpus": gpus, "processes": processes,
            "nvml": nvml is not None}


def render(snap: dict[str, Any]) -> Any:
    """The snapshot as rich renderables (a GPU table and a process table)."""
    from rich.console import Group
    from rich.table import Table

    cores = snap["cpu_pct"]
    head = (f"[bold]{snap['host']}[/]  {time.strftime('%H:%M:%S', time.localtime(snap['time']))}"
            f"  CPU {sum(cores) / max(1, len(cores)):.0f}% of {len(cores)} cores  RAM "
            f"{snap['ram_used_mb'] / 1024:.1f}/{snap['ram_total_mb'] / 1024:.1f} GB")
    parts: list[Any] = [head]
    if snap["gpus"]:
        gpus = Table("GPU", "name", "util", "memory", "power", "temp", "SM clock",
                     "processes", box=None, header_style="bold")
        for g in snap["gpus"]:
            memory = f"{_num(g['mem_used_mb'], '', 1024)}/{_num(g['mem_total_mb'], ' GB', 1024)}"
            gpus.add_row(str(g["index"]), g["name"], _num(g["util_pct"], "%"), memory,
                         _num(g["power_w"], " W"), _num(g["temp_c"], "°C"),
                         _num(g["sm_clock_mhz"], " MHz"),
                         ", ".join(f"{p['pid']} {p.get('name', '?')} "
                                   f"{_num(p.get('gpu_mem_mb'), ' GB', 1024)}"
                                   for p in g["processes"]) or "-")
        parts.append(gpus)
    else:
        parts.append("[yellow]No NVIDIA GPU found (NVML is not usable here); "
                     "showing the host.[/]")
        parts.append("CPU per core: " + " ".join(f"{c:.0f}%" for c in cores))
    table = Table("pid", "user", "CPU", "RSS", "command", box=None, header_style="bold")
    for p in snap["processes"]:
        table.add_row(str(p["pid"]), p.get("user") or "?", _num(p.get("cpu_pct"), "%"),
                      _num(p.get("rss_mb"), " GB", 1024), (p.get("cmd") or "")[:80])
    parts.append(table)
    return Group(*parts)


def run(args: argparse.Namespace) -> int:
    """Print snapshots until Ctrl-C (or one with ``--once``); returns 0."""
    import json

    from rich.console import Console
    from rich.live import Live

    from gpufleet.errors import ConfigError
    from gpufleet.monitor.nvml import Nvml

    if args.interval <= 0:
        raise ConfigError(f"--interval {args.interval}: must be a positive number of seconds.")
    nvml = Nvml.open()
    console = Console()
    window = min(0.5, args.interval)
    try:
        if args.once or args.json:
            while True:
                snap = snapshot(nvml, window)
                if args.json:
                    print(json.dumps(snap), flush=True)
                else:
                    console.print(render(snap))
                if args.once:
                    return 0
                time.sleep(max(0.0, args.interval - window))
        with Live(render(snapshot(nvml, window)), console=console, screen=False,
                  auto_refresh=False) as live:
            while True:
                time.sleep(max(0.0, args.interval - window))
                live.update(render(snapshot(nvml, window)), refresh=True)
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:  # `gpufleet top --json | head -1`: the reader has what it wanted
        import os
        import sys

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    finally:
        if nvml is not None:
            nvml.close()


def _describe(p: Any) -> dict[str, Any]:
    """name, user, CPU % (since the snapshot began), RSS (MB) and command of a process."""
    if p is None:
        return {}
    rss = _safe(lambda: p.memory_info().rss)
    cmd = _safe(p.cmdline)
    return {"name": _safe(p.name), "user": _safe(p.username), "cpu_pct": _safe(p.cpu_percent),
            "rss_mb": round(rss / 2**20, 1) if rss is not None else None,
            "cmd": " ".join(cmd) if cmd else _safe(p.name)}


def _safe(fn: Any) -> Any:
    import psutil

    try:
        return fn()
    except (psutil.Error, OSError):
        return None


def _num(value: Any, unit: str, scale: float = 1.0) -> str:
    if value is None:
        return "-"
    return f"{value / scale:.1f}{unit}" if scale != 1.0 else f"{value:.0f}{unit}"
