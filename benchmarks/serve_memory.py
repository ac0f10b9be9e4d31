"""The server's memory per large JSON request: peak and what stays after, per parse mode.

A server runs in a process of its own (spawned), with one model that sums its input. The
client sends ~30 MiB JSON bodies of FP32 numbers (the body tritonclient sends for a
3.3-million-element input without binary data). Measured on the server process and its
parse processes together, from the kernel's counters:

- baseline: PSS after a warm-up request (parse processes started);
- one request: the peak PSS above the baseline (sampled every few ms; PSS counts a page
  shared by the server and a parse process once);
- N at once: the same for N concurrent bodies (the in-flight cap refuses some with 429);
- after K: private dirty memory (what the processes wrote: heap and buffers) above the
  baseline's after K requests one after another (PSS moves with other processes on a
  shared machine mapping the same libraries).

Modes, side by side in one run:

- ``json-inline``: the stdlib parse on the event loop (every number a Python float);
- ``numpy-inline``: number arrays read straight into numpy, on the event loop;
- ``numpy-pool``: ``create_app`` as is (bodies over 256 KiB parsed in 2 processes that
  map the body from shared memory);
- ``cli``: as ``gpufleet serve`` runs it: ``numpy-pool`` plus a fixed glibc mmap threshold
  in the server process.

Usage:
    python benchmarks/serve_memory.py                    # 100 sequential requests
    python benchmarks/serve_memory.py --sequential 20 --concurrent 6
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import multiprocessing as mp
import threading
import time

import numpy as np
import psutil

from gpufleet.core.machine import machine_summary

MiB = 2**20


def _total(x: np.ndarray) -> np.ndarray:
    return x.sum(axis=1, keepdims=True)


def _serve(mode: str, conn) -> None:
    """The server process: ``mode`` picks the parse path; sends its address, then waits."""
    import gpufleet.serve.app as app
    import gpufleet.serve.jsonnum as jsonnum
    from gpufleet.serve.model import TensorSpec, from_module
    from gpufleet.serve.runner import BackgroundServer

    if mode.endswith("-inline"):
        app.PARSE_INLINE_BYTES = 10**12  # and no shared-memory hand-over
    if mode.startswith("json-"):
        jsonnum.MIN_FAST_CHARS = 10**12  # every array through the stdlib parser
    if mode == "cli":  # what `gpufleet serve` does in its own process
        from gpufleet.serve.trim import fix_mmap_threshold

        fix_mmap_threshold()
    model = from_module("total", _total, [TensorSpec("x", "FP32", (-1,))], "cpu")
    with BackgroundServer(app.create_app([model])) as srv:
        conn.send(srv.address)
        conn.recv()  # until told to stop


def _post(address: str, body: bytes) -> int:
    host, port = address.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    try:
        conn.request("POST", "/v2/models/total/infer", body=body)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def _procs(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _pss(pid: int) -> int:
    """Proportional set size of the server and its parse processes: a page shared by
    two of them (the shared-memory body) counts half in each, so the sum counts it once."""
    total = 0
    for p in _procs(pid):
        with contextlib.suppress(psutil.NoSuchProcess):
            total += p.memory_full_info().pss
    return total


def _private_dirty(pid: int) -> int:
    """Memory the server's processes wrote themselves (heap, buffers): unlike PSS, not
    moved by other processes on the machine mapping the same libraries."""
    total = 0
    for p in _procs(pid):
        with open(f"/proc/{p.pid}/smaps_rollup") as f:
            total += 1024 * int(next(line.split()[1] for line in f
                                     if line.startswith("Private_Dirty:")))
    return total


class PeakSampler:
    """The highest :func:`_pss` seen while the block runs, sampled every few ms."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _pss(self.pid))
            time.sleep(0.002)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _pss(self.pid))


def measure(mode: str, body: bytes, warm: bytes, concurrent: int,
            sequential: int) -> dict[str, float]:
    """Baseline RSS and the growths (MiB) of one server in ``mode``."""
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_serve, args=(mode, child))
    proc.start()
    try:
        address = parent.recv()
        warmers = [threading.Thread(target=_post, args=(address, warm)) for _ in range(2)]
        for t in warmers:  # two at once: both parse processes start
            t.start()
        for t in warmers:
            t.join()
        time.sleep(0.5)
        base, base_dirty = _pss(proc.pid), _private_dirty(proc.pid)
        with PeakSampler(proc.pid) as one:
            assert _post(address, body) == 200
        time.sleep(0.5)
        statuses: list[int] = []
        threads = [threading.Thread(target=lambda: statuses.append(_post(address, body)))
                   for _ in range(concurrent)]
        with PeakSampler(proc.pid) as many:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        for _ in range(sequential):
            assert _post(address, body) == 200
        time.sleep(0.5)
        after = _private_dirty(proc.pid) - base_dirty
        one, many = one.peak - base, many.peak - base
        return {"base": base / MiB, "one": one / MiB, "many": many / MiB,
                "ok": statuses.count(200), "refused": statuses.count(429),
                "after": after / MiB}
    finally:
        parent.send("stop")
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--floats", type=int, default=3_300_000)
    parser.add_argument("--concurrent", type=int, default=6)
    parser.add_argument("--sequential", type=int, default=100)
    parser.add_argument("--modes", default="json-inline,numpy-inline,numpy-pool,cli")
    args = parser.parse_args()

    def body_of(n: int) -> bytes:
        data = np.random.default_rng(0).random(n).round(6).tolist()
        return json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, n],
                                       "data": data}]}).encode()

    body, warm = body_of(args.floats), body_of(60_000)  # warm: over 256 KiB, pool starts
    mib = len(body) / MiB
    print(machine_summary())
    print(f"body: {mib:.1f} MiB of JSON; {args.concurrent} at once; {args.sequential} "
          "one after another; server + parse processes, MiB above the baseline")
    print(f"{'mode':<14} {'base MiB':>9} {'1 peak':>8} {'x body':>7} "
          f"{f'{args.concurrent} peak':>8} {'ok/429':>7} {f'after {args.sequential}':>10}")
    for mode in args.modes.split(","):
        r = measure(mode, body, warm, args.concurrent, args.sequential)
        print(f"{mode:<14} {r['base']:>9.0f} {r['one']:>8.0f} {r['one'] / mib:>7.2f} "
              f"{r['many']:>8.0f} {r['ok']:>3}/{r['refused']:<3} {r['after']:>10.1f}",
              flush=True)


if __name__ == "__main__":
    main()
