"""Causes of slowness the kernel already counts, read per rank process.

For one process (a rank), :func:`read_counters` reads cumulative counters from ``/proc``
and the process's cgroup, in both cgroup versions:

- CPU quota throttling: cgroup v2 ``cpu.stat`` (``nr_periods``, ``nr_throttled``,
  ``throttled_usec``) and ``cpu.max``; v1 ``cpu.stat`` (``throttled_time`` in ns) and
  ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``;
- memory pressure: PSI (``/proc/pressure/memory``, and the cgroup's
  ``memory.pressure`` on v2), the cgroup's ``memory.events`` (``high``, ``max``,
  ``oom_kill``);
- swapping: ``/proc/vmstat`` ``pswpin``/``pswpout`` (pages) and v2
  ``memory.swap.current``;
- shared cores: the busy time of the cores the process may run on (``/proc/stat``),
  beside the process tree's own CPU time;
- I/O wait: PSI ``/proc/pressure/io`` and those cores' ``iowait``.

:func:`delta` turns two readings into what happened in between (one log interval);
:func:`cause` words the part that explains a slow rank. Every read is a few small files;
a counter that is not there (no cgroup controller, no PSI) is left out, never guessed.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
#: (root, pid) -> (when found, its cgroup folders): looked up again after this long
_DIRS: dict[tuple[str, int], tuple[float, dict[str, Path]]] = {}
_DIRS_FOR_S = 10.0


def read_counters(pid: int, root: str | Path = "/", own_cpu_s: float | None = None
                  ) -> dict[str, float]:
    """The cumulative counters of process ``pid`` (see the module docs) as a flat dict;
    ``root``: where ``proc`` and ``sys`` are (file fixtures in tests); ``own_cpu_s``:
    the CPU seconds of the process and its children, if the caller has them (else
    read from ``/proc/PID/stat``)."""
    root = Path(root)
    out: dict[str, float] = {"time": _uptime(root)}
    now = time.monotonic()
    found, cgroup = _DIRS.get((str(root), pid), (-_DIRS_FOR_S, {}))
    if now - found >= _DIRS_FOR_S:
        cgroup = _cgroup_dirs(root, pid)
        _DIRS[(str(root), pid)] = (now, cgroup)
    out |= _cpu_throttling(cgroup)
    out |= _psi(root / "proc" / "pressure" / "memory", "mem")
    out |= _psi(root / "proc" / "pressure" / "io", "io")
    v2 = cgroup.get("v2")
    if v2 is not None:
        out |= _psi(v2 / "memory.pressure", "cg_mem")
        out |= {f"mem_{k}": v for k, v in _keyed(v2 / "memory.events").items()
                if k in ("high", "max", "oom_kill")}
        swap = _number(v2 / "memory.swap.current")
        if swap is not None:
            out["swap_bytes"] = swap
    vm = _keyed(root / "proc" / "vmstat")
    out |= {k: vm[k] for k in ("pswpin", "pswpout") if k in vm}
    out |= _cores(root, pid)
    own = own_cpu_s if own_cpu_s is not None else _process_cpu_s(root, pid)
    if own is not None:
        out["own_cpu_s"] = own
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What happened between two :func:`read_counters` readings of the same process:
    each counter's increase (``swap_bytes``, the quota and the core count as they are
    now), plus ``seconds``, ``others_cpu_s`` (busy time of the process's cores not its
    own) and ``throttled_frac`` (throttled periods / periods)."""
    levels = {"quota_s", "period_s", "cores", "swap_bytes"}
    out = {k: after[k] - before[k] for k in after
           if k in before and k not in levels and k != "time"}
    out |= {k: after[k] for k in levels if k in after}
    out["seconds"] = after.get("time", 0.0) - before.get("time", 0.0)
    if "cores_busy_s" in out and "own_cpu_s" in out:
        out["others_cpu_s"] = max(0.0, out["cores_busy_s"] - out["own_cpu_s"])
    if out.get("cpu_periods"):
        out["throttled_frac"] = out.get("cpu_throttled", 0.0) / out["cpu_periods"]
    return out


def cause(d: dict[str, float]) -> tuple[str, float] | None:
    """The kernel's explanation of a slow rank from one :func:`delta`, and how much of
    the interval it covers (0-1); None when nothing stands out. CPU quota throttling
    comes first (the rank's own limit); else the cause covering most of the interval.

    Example:
        >>> cause({"cpu_periods": 84, "cpu_throttled": 81, "throttled_frac": 81 / 84,
        ...        "throttled_s": 7.3, "quota_s": 0.01, "period_s": 0.1, "seconds": 8.4})
        ('its cgroup throttled it in 81 of 84 CPU periods (7.3 s held back; quota 10 ms \
of CPU per 100 ms period)', 0.96...)
    """
    seconds = d.get("seconds") or 0.0
    found: list[tuple[str, float]] = []
    throttled = d.get("cpu_periods", 0) >= 5 and d.get("throttled_frac", 0.0) >= 0.2
    if throttled:
        quota = (f"; quota {d['quota_s'] * 1e3:.0f} ms of CPU per "
                 f"{d['period_s'] * 1e3:.0f} ms period" if d.get("quota_s") else "")
        found.append((f"its cgroup throttled it in {d['cpu_throttled']:.0f} of "
                      f"{d['cpu_periods']:.0f} CPU periods ({d.get('throttled_s', 0):.1f} s "
                      f"held back{quota})", d["throttled_frac"]))
    pages = d.get("pswpin", 0) + d.get("pswpout", 0)
    if pages >= 256:  # 1 MiB of 4 KiB pages
        found.append((f"the node swapped {pages * 4 / 1024:.0f} MiB in and out "
                      f"({d.get('pswpin', 0):.0f} pages in, {d.get('pswpout', 0):.0f} out)",
                      min(1.0, d.get("mem_some_us", 0) / 1e6 / seconds) if seconds else 0.5))
    for key, what in (("cg_mem_some_us", "its cgroup"), ("mem_some_us", "the node")):
        stalled = d.get(key, 0) / 1e6
        if seconds and stalled / seconds >= 0.1:
            found.append((f"{what} stalled on memory for {stalled:.1f} s of "
                          f"{seconds:.1f} s (PSI)", stalled / seconds))
            break
    busy = d.get("cores_busy_s", 0.0)
    others = d.get("others_cpu_s", 0.0)
    if seconds and d.get("cores") and others / (seconds * d["cores"]) >= 0.25:
        found.append((f"other processes used {others:.1f} CPU-s of its "
                      f"{d['cores']:.0f} core(s) in {seconds:.1f} s ({busy:.1f} CPU-s busy "
                      "in all)", others / (seconds * d["cores"])))
    io = d.get("io_some_us", 0) / 1e6
    if seconds and io / seconds >= 0.2:
        found.append((f"tasks waited on I/O for {io:.1f} s of {seconds:.1f} s (PSI)",
                      io / seconds))
    # The quota is this process's own limit, the others are shared with the node: a
    # throttled rank is named by its throttling; else the largest share of the interval.
    return found[0] if throttled else max(found, key=lambda f: f[1]) if found else None


# -- the files ------------------------------------------------------------------------
def _cgroup_dirs(root: Path, pid: int) -> dict[str, Path]:
    """``v2``: the process's unified cgroup folder; ``cpu``: its v1 cpu folder."""
    dirs: dict[str, Path] = {}
    try:
        lines = (root / "proc" / str(pid) / "cgroup").read_text().splitlines()
    except OSError:
        return dirs
    fs = root / "sys" / "fs" / "cgroup"
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        rel = path.lstrip("/")
        if controllers == "":
            for base in (fs, fs / "unified"):  # pure v2, or hybrid's unified tree
                if (base / rel / "cgroup.procs").is_file():
                    dirs["v2"] = base / rel
                    break
        elif "cpu" in controllers.split(","):
            for name in (controllers, "cpu", "cpu,cpuacct"):
                if (fs / name / rel / "cpu.stat").is_file():
                    dirs["cpu"] = fs / name / rel
                    break
    return dirs


def _cpu_throttling(cgroup: dict[str, Path]) -> dict[str, float]:
    v2, v1 = cgroup.get("v2"), cgroup.get("cpu")
    if v2 is not None and (v2 / "cpu.max").is_file():
        stat = _keyed(v2 / "cpu.stat")
        out = {"cpu_periods": stat.get("nr_periods", 0.0),
               "cpu_throttled": stat.get("nr_throttled", 0.0),
               "throttled_s": stat.get("throttled_usec", 0.0) / 1e6}
        try:
            quota, period = (v2 / "cpu.max").read_text().split()
            if quota != "max":
                out |= {"quota_s": int(quota) / 1e6, "period_s": int(period) / 1e6}
        except (OSError, ValueError):
            pass
        return out
    if v1 is not None:
        stat = _keyed(v1 / "cpu.stat")
        out = {"cpu_periods": stat.get("nr_periods", 0.0),
               "cpu_throttled": stat.get("nr_throttled", 0.0),
               "throttled_s": stat.get("throttled_time", 0.0) / 1e9}
        quota, period = _number(v1 / "cpu.cfs_quota_us"), _number(v1 / "cpu.cfs_period_us")
        if quota is not None and quota > 0 and period:
            out |= {"quota_s": quota / 1e6, "period_s": period / 1e6}
        return out
    return {}


def _psi(path: Path, name: str) -> dict[str, float]:
    """PSI's ``some`` total (microseconds some task stalled) from ``path``."""
    try:
        for line in path.read_text().splitlines():
            if line.startswith("some "):
                fields = dict(f.split("=", 1) for f in line.split()[1:])
                return {f"{name}_some_us": float(fields["total"])}
    except (OSError, ValueError, KeyError):
        pass
    return {}


def _cores(root: Path, pid: int) -> dict[str, float]:
    """The busy and iowait seconds of the cores ``pid`` may run on (``/proc/stat``)."""
    try:
        allowed = os.sched_getaffinity(pid) if str(root) == "/" else None
        lines = (root / "proc" / "stat").read_text().splitlines()
    except OSError:
        return {}
    busy = iowait = 0.0
    count = 0
    for line in lines:
        name, *ticks = line.split()
        if not name.startswith("cpu") or name == "cpu" or len(ticks) < 8:
            continue
        if allowed is not None and int(name[3:]) not in allowed:
            continue
        user, nice, system, _idle, wait, irq, softirq, steal = map(int, ticks[:8])
        busy += user + nice + system + irq + softirq + steal
        iowait += wait
        count += 1
    return {"cores": float(count), "cores_busy_s": busy / _HZ, "iowait_s": iowait / _HZ}


def _process_cpu_s(root: Path, pid: int) -> float | None:
    try:
        fields = (root / "proc" / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # utime, stime, cutime, cstime: fields 14-17 of the line (after the name: 11-14)
    return sum(int(f) for f in fields[11:15]) / _HZ


def _uptime(root: Path) -> float:
    try:
        return float((root / "proc" / "uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0


def _keyed(path: Path) -> dict[str, float]:
    """A ``key value`` per line file (cpu.stat, vmstat, memory.events)."""
    out = {}
    try:
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2:
                try:
                    out[parts[0]] = float(parts[1])
                except ValueError:
                    continue
    except OSError:
        pass
    return out


def _number(path: Path) -> float | None:
    try:
        return float(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def kernel_view(samples: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Per rank, what its counters did over ``samples`` (system samples, oldest first,
    each with ``kernel``: rank -> :func:`read_counters`): the :func:`delta` from its
    first reading in them to its last."""
    first: dict[str, dict[str, float]] = {}
    last: dict[str, dict[str, float]] = {}
    for sample in samples:
        for rank, counters in (sample.get("kernel") or {}).items():
            first.setdefault(rank, counters)
            last[rank] = counters
    return {int(r): delta(first[r], last[r]) for r in last if last[r] is not first[r]}


def explains(view: dict[int, dict[str, float]], rank: int) -> tuple[str, float] | None:
    """The kernel's :func:`cause` of rank ``rank``'s slowness when the other ranks do
    not show the same (a cause every rank shares does not explain a gap between them)."""
    own = cause(view[rank]) if rank in view else None
    if own is None:
        return None
    for r, d in view.items():
        other = cause(d) if r != rank else None
        if other is not None and other[0].split(" ")[:3] == own[0].split(" ")[:3] \
                and other[1] >= 0.5 * own[1]:
            return None
    return own


def summary(d: dict[str, Any]) -> dict[str, float]:
    """The fields of a :func:`delta` worth keeping in ``diagnosis.json`` (rounded)."""
    keys = ("seconds", "cpu_periods", "cpu_throttled", "throttled_frac", "throttled_s",
            "quota_s", "period_s", "mem_some_us", "cg_mem_some_us", "io_some_us",
            "pswpin", "pswpout", "swap_bytes", "cores", "cores_busy_s", "own_cpu_s",
            "others_cpu_s", "iowait_s", "mem_high", "mem_max", "mem_oom_kill")
    return {k: round(float(d[k]), 4) for k in keys if k in d}
