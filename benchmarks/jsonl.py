"""Index build speed and DataLoader worker memory of ``JsonlDataset`` on a large file.

Generates a JSON Lines file of small records ({"id", "text", "label"}, 40-200 bytes),
then measures:

1. the cold index build (target: >= 1 million lines/s) and the reuse of the index by a
   second open;
2. the memory of a DataLoader with 4 persistent workers reading the file in random order
   for ``--seconds``: each worker's RSS, USS and PSS at the start, middle and end of the
   run (targets: < 100 MB per worker above the baseline, and flat over time).

    python benchmarks/jsonl.py                      # 10 million lines, about 2 minutes
    python benchmarks/jsonl.py --lines 200000 --seconds 5
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch
from torch.utils.data import DataLoader, RandomSampler

from gpufleet.core.machine import cpu_model
from gpufleet.data.jsonl import JsonlDataset

MB = 1 << 20
WORDS = ("the of and to in is was for on that with as by at from it an be this are have "
         "not data model train loss token batch worker memory index record label value").split()


def machine() -> str:
    ram_gib = psutil.virtual_memory().total / 2**30
    return (f"{cpu_model()}, {os.cpu_count()} cores, {ram_gib:.1f} GiB RAM"
            f"\npython {platform.python_version()}, numpy {np.__version__}, "
            f"torch {torch.__version__}")


def generate(path: Path, lines: int, seed: int = 0) -> None:
    """Write ``lines`` records in blocks of 250k lines, each block one ``write``."""
    rng = np.random.default_rng(seed)
    # A pool of texts of 0-160 characters; records pick from it at random.
    pool = [" ".join(rng.choice(WORDS, size=int(k))) for k in rng.integers(0, 32, size=4096)]
    block = 250_000
    with open(path, "w", encoding="utf-8") as f:
        for lo in range(0, lines, block):
            n = min(block, lines - lo)
            texts = rng.integers(0, len(pool), size=n).tolist()
            labels = rng.integers(0, 10, size=n).tolist()
            f.write("".join(
                f'{{"id": {lo + i}, "text": "{pool[t]}", "label": {k}}}\n'
                for i, (t, k) in enumerate(zip(texts, labels))))


def private_dirty(pid: int) -> int:
    """Bytes of memory only this process has written (Linux ``smaps_rollup``)."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return 1024 * int(next(line.split()[1] for line in f
                                if line.startswith("Private_Dirty:")))


def _collate(batch: list[dict]) -> int:
    # Keep the main process cheap: the workers parse, the main process only counts.
    return len(batch)


def memory_run(ds: JsonlDataset, seconds: float, workers: int, batch_size: int) -> None:
    main = psutil.Process()
    # 4 workers on a 2-core machine is the point of the test (memory, not speed).
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    baseline = main.memory_info().rss
    print(f"\nmain process RSS before the loader (baseline): {baseline / MB:.0f} MB")
    loader = DataLoader(ds, batch_size=batch_size, sampler=RandomSampler(ds),
                        num_workers=workers, persistent_workers=True, collate_fn=_collate)
    it = iter(loader)
    next(it)
    # `_workers` is private to torch, but it is the reliable way to the worker processes.
    procs = [psutil.Process(w.pid) for w in it._workers]
    samples: dict[str, list[tuple[Any, int]]] = {}
    marks = {"start": 0.0, "middle": seconds / 2, "end": seconds}
    items, t0 = 0, time.perf_counter()
    pending = list(marks.items())
    while pending:
        elapsed = time.perf_counter() - t0
        if elapsed >= pending[0][1]:
            name, _ = pending.pop(0)
            samples[name] = [(p.memory_full_info(), private_dirty(p.pid)) for p in procs]
            continue
        try:
            items += next(it)
        except StopIteration:  # one epoch done: start another, the workers persist
            it = iter(loader)
    elapsed = time.perf_counter() - t0
    print(f"read {items:,} random records in {elapsed:.1f} s ({items / elapsed:,.0f}/s) "
          f"with {workers} workers, batch_size {batch_size}")

    # RSS counts every resident page a process maps, including the shared, file-backed
    # pages of the data file and the index that it has touched (page cache, counted once
    # per process that touches them) and the copy-on-write pages inherited from the main
    # process. So RSS climbs as random reads touch more of the file, without any extra
    # memory being used. USS (pages no other process maps) and PSS (shared pages split
    # between their sharers) are the honest per-worker figures; both still count clean
    # page-cache pages of the file (USS only while no other worker has touched them yet,
    # hence a high USS at the start that falls as the workers' reads overlap). Private
    # dirty memory (heap, copied-on-write pages) is what a worker really adds: no file
    # pages, never shared, and what the targets are checked against.
    print(f"\n{'worker':>6} {'when':>7} {'RSS MB':>8} {'RSS-base':>9} {'USS MB':>8} "
          f"{'PSS MB':>8} {'PrivDirty':>10}")
    for w in range(len(procs)):
        for name in marks:
            m, dirty = samples[name][w]
            print(f"{w:>6} {name:>7} {m.rss / MB:>8.0f} {(m.rss - baseline) / MB:>9.0f} "
                  f"{m.uss / MB:>8.1f} {m.pss / MB:>8.1f} {dirty / MB:>10.1f}")
    dirty_end = max(d for _, d in samples["end"]) / MB
    growth = max((e[1] - s[1]) / MB for s, e in zip(samples["start"], samples["end"]))
    print(f"\nper-worker private dirty memory (added above the shared baseline): max "
          f"{dirty_end:.1f} MB -> {'PASS' if dirty_end < 100 else 'FAIL'} (target < 100 MB)")
    print(f"private dirty growth start -> end: max {growth:+.1f} MB -> "
          f"{'PASS (flat)' if growth < 10 else 'FAIL (growing)'} (target < 10 MB)")
    del it, loader


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lines", type=int, default=10_000_000)
    parser.add_argument("--dir", type=Path, default=None, help="where to write the file")
    parser.add_argument("--seconds", type=float, default=20.0, help="memory run length")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--keep", action="store_true", help="keep the generated files")
    args = parser.parse_args()

    print(machine())
    workdir = Path(tempfile.mkdtemp(prefix="jsonl-bench-", dir=args.dir))
    path = workdir / "data.jsonl"
    try:
        t0 = time.perf_counter()
        generate(path, args.lines)
        gen = time.perf_counter() - t0
        size = path.stat().st_size
        print(f"\ngenerated {args.lines:,} lines, {size / MB:,.0f} MB "
              f"({size / args.lines:.0f} B/line) in {gen:.1f} s")

        # The file was just written, so it is in the page cache: this measures the scan,
        # not the disk (a cold disk read adds size / disk bandwidth).
        t0 = time.perf_counter()
        ds = JsonlDataset(path)
        build = time.perf_counter() - t0
        rate = args.lines / build
        t0 = time.perf_counter()
        ds = JsonlDataset(path)
        reuse = time.perf_counter() - t0
        idx_size = ds.index_path.stat().st_size
        print(f"index build (cold): {build:.2f} s, {rate / 1e6:.2f} M lines/s -> "
              f"{'PASS' if rate >= 1e6 else 'FAIL'} (target >= 1 M lines/s)")
        print(f"index reuse (second open): {reuse * 1e3:.2f} ms; index file {idx_size / MB:.0f} MB")
        assert len(ds) == args.lines and ds[args.lines - 1]["id"] == args.lines - 1

        # Write back the new file and index first: page-cache pages still dirty from the
        # write count as Private_Dirty (and USS) in the first worker that maps them, which
        # would charge the workers for the benchmark's own writes.
        os.sync()
        memory_run(ds, args.seconds, args.workers, args.batch_size)
    finally:
        if args.keep:
            print(f"\nkept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
