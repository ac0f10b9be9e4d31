"""DataLoader worker memory: a Hugging Face Dataset read from disk beside JsonlDataset.

The same records ({"id", "text", "label"}, from ``benchmarks/jsonl.py``'s generator) are
read in random order by a DataLoader with persistent workers, in three forms:

- ``jsonl``: gpufleet's memory-mapped ``JsonlDataset``;
- ``hf-mmap``: ``datasets.load_from_disk`` (Arrow files, memory-mapped), as gpufleet
  passes it to the loader;
- ``hf-lists``: the same rows materialised into a Python list first (what not to do:
  every worker's reference counting dirties the copy-on-write pages of the list).

For each form: the main process RSS, and per worker (max over the workers at the end of
the run) RSS, USS, PSS and private dirty memory (what a worker really adds; see
``benchmarks/jsonl.py`` for why RSS overstates it).

    python benchmarks/hf_datasets.py                     # 1 million rows, 4 workers
    python benchmarks/hf_datasets.py --lines 200000 --seconds 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import datasets
import psutil
from jsonl import generate, machine, private_dirty
from torch.utils.data import DataLoader, RandomSampler

from gpufleet.data.hf import as_map_style
from gpufleet.data.jsonl import JsonlDataset

MB = 1 << 20


def _count(batch: list) -> int:
    return len(batch)  # the workers read rows; the main process only counts


def measure(ds, seconds: float, workers: int, batch_size: int) -> dict[str, float]:
    """Read ``ds`` at random for ``seconds``; memory figures in MB at the end."""
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    loader = DataLoader(ds, batch_size=batch_size, sampler=RandomSampler(ds),
                        num_workers=workers, persistent_workers=True, collate_fn=_count)
    it = iter(loader)
    items = next(it)
    procs = [psutil.Process(w.pid) for w in it._workers]  # torch-private, but reliable
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        try:
            items += next(it)
        except StopIteration:
            it = iter(loader)
    rate = items / (time.perf_counter() - t0)
    infos = [(p.memory_full_info(), private_dirty(p.pid)) for p in procs]
    out = {"rows/s": rate, "main RSS": psutil.Process().memory_info().rss / MB,
           "RSS": max(m.rss for m, _ in infos) / MB, "USS": max(m.uss for m, _ in infos) / MB,
           "PSS": max(m.pss for m, _ in infos) / MB,
           "PrivDirty": max(d for _, d in infos) / MB}
    del it, loader
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--dir", type=Path, default=None, help="where to write the files")
    args = parser.parse_args()

    print(machine(), f"datasets {datasets.__version__}", sep="\n")
    workdir = Path(tempfile.mkdtemp(prefix="hf-bench-", dir=args.dir))
    try:
        path = workdir / "data.jsonl"
        generate(path, args.lines)
        built = datasets.Dataset.from_json(str(path), cache_dir=str(workdir / "cache"))
        built.save_to_disk(str(workdir / "arrow"))
        del built
        os.sync()  # written pages would count as the first reader's private dirty
        hf = as_map_style(datasets.load_from_disk(str(workdir / "arrow")))
        size = sum(os.path.getsize(f["filename"]) for f in hf.cache_files)
        print(f"\n{args.lines:,} rows: JSONL {path.stat().st_size / MB:.0f} MB, Arrow "
              f"{size / MB:.0f} MB; {args.workers} workers, batch {args.batch_size}, "
              f"{args.seconds:.0f} s of random reads per form; per worker: max over workers")
        forms = {"jsonl": lambda: JsonlDataset(path), "hf-mmap": lambda: hf,
                 "hf-lists": lambda: datasets.load_from_disk(str(workdir / "arrow")).to_list()}
        print(f"{'form':<9} {'rows/s':>9} {'main RSS':>9} {'RSS':>7} {'USS':>7} {'PSS':>7} "
              f"{'PrivDirty':>10}  (MB)")
        for name, make in forms.items():
            r = measure(make(), args.seconds, args.workers, args.batch_size)
            print(f"{name:<9} {r['rows/s']:>9,.0f} {r['main RSS']:>9.0f} {r['RSS']:>7.0f} "
                  f"{r['USS']:>7.1f} {r['PSS']:>7.1f} {r['PrivDirty']:>10.1f}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
