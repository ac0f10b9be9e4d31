"""The system sampler: GPUs (NVML) and the host (psutil), in a background thread.

One :class:`SystemSampler` per node (local rank 0) appends one JSON object per sample to
``<run_dir>/system.jsonl``::

    {"time": 1718000000.5,            # unix seconds
     "host": "node-3",                # socket.gethostname()
     "gpus": [{"index": 0,            # NVML index (as nvidia-smi numbers them)
               "name": "NVIDIA H100 80GB HBM3",
               "util_pct": 87,        # % of the last sample period a kernel ran
               "mem_used_mb": 40123.0, "mem_total_mb": 81559.0,
               "power_w": 412.5, "temp_c": 61, "sm_clock_mhz": 1980}, ...],
     "cpu_pct": [12.0, 97.5, ...],    # per logical core, since the previous sample
     "ram_used_mb": 51234.0, "ram_total_mb": 1031234.0,
     "proc_rss_mb": 9876.0,           # the training processes and all their children
     "proc_cpu_pct": 312.0,           # the same processes; 100 = one core busy
     "procs": 12,                     # how many processes that is
     "others": [{"pid": 4242, "name": "ffmpeg", "cpu_pct": 195.0}, ...],
                                      # the busiest other processes (>= 5%, 5 at most),
                                      # since the previous reading of them
     "disk_free_gb": 812.4,           # free space where the run directory lives
     "kernel": {"1": {...}}}          # per rank on this node: the kernel's counters
                                      # (gpufleet.monitor.kernel.read_counters)

Reading every process of the node (for ``others``, and for the children of the run's
processes) is the costly part of a sample: it is done on every ``SCAN_EVERY``-th sample
(and on the second, as the first only primes the counters); the samples in between
repeat the last ``others`` and measure the same processes.

``gpus`` is empty without an NVIDIA driver; a GPU field the device does not report
(power on some boards, for example) is ``null``. Every node writes its own lines; each
line is one ``write()`` to a file opened for appending, so lines of several nodes on a
shared file system do not interleave within a line on a POSIX file system. Readers skip
a line they cannot parse.

Example:
    >>> import tempfile
    >>> sampler = SystemSampler(tempfile.mkdtemp(), interval_s=0.5)
    >>> sampler.start()
    >>> sample = sampler.sample_now()
    >>> sorted(sample)[:3]
    ['cpu_pct', 'disk_free_gb', 'gpus']
    >>> sampler.stop()
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import psutil

from gpufleet.core.callbacks import Callback
from gpufleet.core.threads import ServiceThread
from gpufleet.monitor.kernel import read_counters
from gpufleet.monitor.nvml import MB, Nvml, visible_indices

log = logging.getLogger(__name__)

SYSTEM_FILE = "system.jsonl"
KEEP_S = 900.0  # seconds of samples kept in memory for latest()/window()
PIDS_REFRESH_S = 10.0  # how often the recorded ranks of the run are looked up again
SCAN_EVERY = 5  # samples per reading of the whole process table (others, children)


def host_sample(procs: Iterable[psutil.Process], path: str | Path,
                others: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """CPU per core, RAM, the given processes' RSS and CPU, disk free where ``path`` is,
    and the busiest other processes (``others`` when given, else read now:
    :func:`busiest_others`).

    CPU figures are since the previous call (the first call reads 0).
    """
    procs = list(procs)
    vm = psutil.virtual_memory()
    rss = cpu = 0.0
    count = 0
    for p in procs:
        try:
            with p.oneshot():
                rss += p.memory_info().rss
                cpu += p.cpu_percent()
            count += 1
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    try:
        disk_free = round(psutil.disk_usage(str(path)).free / 1e9, 2)
    except OSError:
        disk_free = None
    if others is None:
        others = busiest_others(procs)
    return {"cpu_pct": psutil.cpu_percent(percpu=True), "others": others,
            "ram_used_mb": round((vm.total - vm.available) / MB, 1),
            "ram_total_mb": round(vm.total / MB, 1),
            "proc_rss_mb": round(rss / MB, 1), "proc_cpu_pct": round(cpu, 1),
            "procs": count, "disk_free_gb": disk_free}


def busiest_others(ours: Iterable[psutil.Process], keep: int = 5,
                   floor_pct: float = 5.0) -> list[dict[str, Any]]:
    """The processes outside ``ours`` using the most CPU since the previous call (100 =
    one core), busiest first: what competes with the run for the node's cores.

    psutil keeps the process objects of ``process_iter`` between calls, so the CPU
    share is measured since the previous call (the first call reads 0).
    """
    mine = {p.pid for p in ours} | {os.getpid()}
    found = []
    # Name and CPU in one pass: psutil reads each /proc/<pid>/stat once for both.
    for p in psutil.process_iter(["name", "cpu_percent"]):
        pct = p.info.get("cpu_percent")
        if p.pid in mine or pct is None:  # ours, or not readable (gone, denied)
            continue
        if pct >= floor_pct:
            found.append({"pid": p.pid, "name": p.info.get("name") or "?",
                          "cpu_pct": round(pct, 1)})
    found.sort(key=lambda d: -d["cpu_pct"])
    return found[:keep]


def read_system(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every sample in ``<run_dir>/system.jsonl`` (all hosts), in file order.

    Example:
        >>> import tempfile
        >>> read_system(tempfile.mkdtemp())
        []
    """
    path = Path(run_dir) / SYSTEM_FILE
    if not path.is_file():
        return []
    samples = []
    with open(path) as f:
        for line in f:
            try:
                samples.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut short by a crash
    return samples


class SystemSampler(Callback):
    """Samples the GPUs and the host every ``interval_s`` seconds to ``system.jsonl``.

    Create one per node (on local rank 0). It starts in ``on_fit_start`` and stops in
    ``on_fit_end``; :meth:`start` and :meth:`stop` work outside a trainer too. The
    thread is a daemon: a crashed run does not wait for it.

    Args:
        run_dir: the run directory (``system.jsonl`` goes there; its disk is measured).
        interval_s: seconds between samples; 0 turns the sampler off.
        pids: the processes to measure, each with all its children (data-loader
            workers). None: the ranks recorded on this host in ``<run_dir>/procs``
            (looked up again every 10 s), and this process.
        gpu_indices: the NVML indices of the GPUs to read; None: the ones in
            ``CUDA_VISIBLE_DEVICES`` when it lists indices, else every GPU.

    Example:
        >>> import tempfile
        >>> sampler = SystemSampler(tempfile.mkdtemp(), interval_s=0)  # off
        >>> sampler.start(); sampler.latest() is None
        True
    """

    essential = False

    def __init__(self, run_dir: str | Path, interval_s: float = 1.0,
                 pids: Sequence[int] | None = None,
                 gpu_indices: Sequence[int] | None = None) -> None:
        if interval_s < 0:
            raise ValueError(f"interval_s = {interval_s!r}: must be >= 0 (0 turns it off).")
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / SYSTEM_FILE
        self.interval_s = float(interval_s)
        self.pids = list(pids) if pids is not None else None
        self.gpu_indices = gpu_indices if gpu_indices is not None else visible_indices()
        self.host = socket.gethostname()
        self.gpus: Nvml | None = None
        keep = max(2, int(KEEP_S / interval_s)) if interval_s else 2
        self._samples: deque[dict[str, Any]] = deque(maxlen=keep)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fd: int | None = None
        self._procs: dict[int, psutil.Process] = {}
        self._roots: list[int] = []
        self._ranks: dict[int, int] = {}  # rank -> pid, on this node (from the records)
        self._roots_read = -PIDS_REFRESH_S
        self._samples_taken = 0
        self._others: list[dict[str, Any]] = []

    # -- the Callback side -------------------------------------------------------------
    def on_fit_start(self, trainer: Any) -> None:
        self.start()

    def on_fit_end(self, trainer: Any, result: Any) -> None:
        self.stop()

    def on_exception(self, trainer: Any, error: BaseException) -> None:
        self.stop()

    # -- control -----------------------------------------------------------------------
    def start(self) -> None:
        """Open NVML and the file, start the thread, which primes the counters and then
        samples (no-op if off)."""
        if not self.interval_s or self._thread is not None:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.gpus = Nvml.open(self.gpu_indices)
        self._stop.clear()
        self._thread = ServiceThread(target=self._run, name="gpufleet-system-sampler",
                                     stop=self._stop.set,
                                     join_s=max(5.0, 2 * self.interval_s))
        self._thread.start()

    def stop(self) -> None:
        """Take a last sample, end the thread, close the file and NVML."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=max(5.0, 2 * self.interval_s))
        self._thread = None
        self.sample_now()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self.gpus is not None:
            self.gpus.close()
            self.gpus = None

    # -- readings ----------------------------------------------------------------------
    def latest(self) -> dict[str, Any] | None:
        """The newest sample, or None before the first one."""
        with self._lock:
            return self._samples[-1] if self._samples else None

    def window(self, seconds: float) -> list[dict[str, Any]]:
        """The samples of the last ``seconds`` seconds (oldest first; 15 minutes at most)."""
        since = time.time() - seconds
        with self._lock:
            return [s for s in self._samples if s["time"] >= since]

    def sample_now(self) -> dict[str, Any]:
        """Take a sample now, keep it and write it; returns it."""
        sample = self._measure()
        with self._lock:
            self._samples.append(sample)
        if self._fd is not None:
            os.write(self._fd, (json.dumps(sample) + "\n").encode())
        return sample

    # -- internals ---------------------------------------------------------------------
    def _run(self) -> None:
        # Primes the CPU counters (psutil reads CPU since the last call): here, in the
        # sampler's thread, and half an interval after the start, not while the run
        # sets up and takes its first step (the scan of every process holds the
        # interpreter for milliseconds at a time).
        if self._stop.wait(self.interval_s / 2):
            return
        self._measure()
        while not self._stop.wait(self.interval_s):
            try:
                self.sample_now()
            except Exception as e:  # a sampler never takes training down
                log.warning("System sample failed (%s: %s); trying again in %.1f s.",
                            type(e).__name__, e, self.interval_s)

    def _measure(self) -> dict[str, Any]:
        gpus = self.gpus.sample() if self.gpus is not None else []
        # The first reading only primes psutil's counters (every process reads 0): read
        # again at the next sample, so the samples before the next scan carry real shares.
        scan = self._samples_taken % SCAN_EVERY == 0 or self._samples_taken == 1
        self._samples_taken += 1
        procs = self._processes(scan)
        if scan:
            self._others = busiest_others(procs)
        host = host_sample(procs, self.run_dir, self._others)
        kernel = {}
        for rank, pid in self._ranks.items():  # a few small files per rank
            counters = read_counters(pid)
            if len(counters) > 1:
                kernel[str(rank)] = counters
        return {"time": round(time.time(), 3), "host": self.host, "gpus": gpus, **host,
                "kernel": kernel}

    def _processes(self, scan: bool = True) -> list[psutil.Process]:
        """The processes to measure: the roots and all their descendants (looked up
        again with ``scan``, or when the roots change; else the last ones).

        psutil.Process objects are kept across samples: cpu_percent() needs the one from
        the previous call to measure since then.
        """
        now = time.monotonic()
        roots = self._roots
        if self.pids is not None:
            self._roots = self.pids
        elif now - self._roots_read >= PIDS_REFRESH_S:
            self._roots, self._ranks = _recorded_ranks(self.run_dir, self.host)
            self._roots_read = now
        if not scan and self._roots == roots and self._procs:
            return list(self._procs.values())
        found: dict[int, psutil.Process] = {}
        for pid in self._roots:
            try:
                root = self._procs.get(pid) or psutil.Process(pid)
                for p in [root, *root.children(recursive=True)]:
                    found[p.pid] = self._procs.get(p.pid, p)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        self._procs = found
        return list(found.values())


def _recorded_ranks(run_dir: Path, host: str) -> tuple[list[int], dict[int, int]]:
    """This process and the ranks of the run recorded on this host; and rank -> pid."""
    from gpufleet.procs import list_records

    pids = {os.getpid()}
    ranks: dict[int, int] = {}
    try:
        for r in list_records(run_dir):
            if r.role == "rank" and r.host == host:
                pids.add(r.pid)
                if r.rank is not None:
                    ranks[r.rank] = r.pid
    except (OSError, ValueError) as e:
        log.debug("Could not read the run's process records: %s", e)
    return sorted(pids), ranks
