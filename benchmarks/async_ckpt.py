"""What a checkpoint costs training, synchronous against ``checkpoint.async_save``, on
the GPT default job (the built-in GPT on the standard-library corpus, in one process),
or on a sharded run of it (``--nproc 2 --strategy fsdp``: every rank writes its shards).

Runs alternate (sync, async, sync, async, ...) so machine noise hits both alike. Every
save logs how long it blocked the training thread and how long until the file was
complete under its name (fsynced, checksummed, renamed); reported per mode: the median
of each over all saves, the blocking share of the total, and the median train time.
``--write-mbps N`` holds the runs' disk writes to N MiB/s with the kernel's block-I/O
throttle (a slow or shared file system; needs root: :mod:`gpufleet.bench.slowdisk`).

    python benchmarks/async_ckpt.py                  # a few minutes on 2 cores
    python benchmarks/async_ckpt.py --repeats 3 --steps 40 --every 10
    sudo python benchmarks/async_ckpt.py --write-mbps 8
    python benchmarks/async_ckpt.py --nproc 2 --strategy fsdp
"""

from __future__ import annotations

import argparse
import logging
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from gpufleet.bench.runs import small_gpt_job
from gpufleet.bench.slowdisk import joined, slow_disk, slow_disk_missing
from gpufleet.config import load_config
from gpufleet.core.machine import machine_summary
from gpufleet.entry import train


class _Saves(logging.Handler):
    """Keeps the timings every checkpoint log record carries."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.times: list[tuple[float, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if hasattr(record, "checkpoint_blocking_s"):
            self.times.append((record.checkpoint_blocking_s, record.checkpoint_total_s))


def one_run(out: str, async_save: bool, steps: int, every: int) -> tuple[list, float]:
    saves = _Saves()
    logger = logging.getLogger("gpufleet.train.checkpoint.checkpointer")
    logger.addHandler(saves)
    logger.setLevel(logging.INFO)
    try:
        cfg = load_config(overrides={
            "run.out_dir": out, "run.max_steps": steps, "checkpoint.every": every,
            "checkpoint.save_final": False, "checkpoint.keep_last": 2,
            "checkpoint.async_save": async_save, "log.progress": "off",
            "monitor.report": False, "run.eval_every": 0})
        result = train(cfg)
    finally:
        logger.removeHandler(saves)
    return saves.times, result.train_time_s


_SAVED = re.compile(r"checkpoint saved: .* \(training blocked ([0-9.]+) s; written.* in "
                    r"([0-9.]+) s\)")


def cli_run(out: str, async_save: bool, steps: int, every: int, nproc: int, strategy: str,
            write_bps: int) -> tuple[list, float]:
    """One run through ``gpufleet train`` with ``nproc`` ranks; the saves rank 0 logged
    and the run's wall time (start-up included, alike in both modes)."""
    run_dir = Path(out) / f"run-{async_save}-{len(list(Path(out).iterdir()))}"
    cmd = [*small_gpt_job(steps), "--nproc", str(nproc), "--strategy", strategy,
           "--checkpoint.every", str(every), "--checkpoint.keep_last", "2",
           "--checkpoint.async_save", str(async_save).lower(), "--run-dir", str(run_dir),
           "--log.progress", "off"]
    with slow_disk(Path(out), write_bps) as prefix:
        start = time.perf_counter()
        proc = subprocess.run([*(prefix or []), *cmd], capture_output=True, text=True,
                              timeout=1800)
        wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed:\n{proc.stderr[-3000:]}")
    times = [(float(b), float(t)) for b, t in _SAVED.findall(proc.stderr)]
    return times, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--nproc", type=int, default=1,
                        help="ranks; above 1 the runs go through `gpufleet train`")
    parser.add_argument("--strategy", default="ddp", help="with --nproc > 1 (fsdp: shards)")
    parser.add_argument("--write-mbps", type=float, default=0.0,
                        help="hold the runs' disk writes to this many MiB/s (root)")
    args = parser.parse_args()
    write_bps = int(args.write_mbps * 2**20)
    if write_bps and (why := slow_disk_missing()):
        raise SystemExit(why)
    print(f"machine: {machine_summary()}")
    job = (f"GPT default job, {args.nproc} rank(s), {args.strategy}" if args.nproc > 1
           else "GPT default job, one process")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}; {job}, "
          f"{args.steps} steps, a checkpoint every {args.every}, {args.repeats} repeats; "
          f"disk writes {f'held to {args.write_mbps:g} MiB/s' if write_bps else 'free'}")
    found: dict[str, list] = {"sync": [], "async": []}
    train_s: dict[str, list[float]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as out:
        for _ in range(args.repeats):
            for mode in ("sync", "async"):
                if args.nproc > 1:
                    times, seconds = cli_run(out, mode == "async", args.steps, args.every,
                                             args.nproc, args.strategy, write_bps)
                else:
                    with joined(Path(out), write_bps):
                        times, seconds = one_run(out, mode == "async", args.steps,
                                                 args.every)
                found[mode].extend(times)
                train_s[mode].append(seconds)
    what = "wall s" if args.nproc > 1 else "train s"
    print(f"mode  | saves | blocking s (median) | total s (median) | blocking/total "
          f"| {what} (median)")
    for mode, times in found.items():
        blocking = statistics.median(b for b, _ in times)
        total = statistics.median(t for _, t in times)
        print(f"{mode:5} | {len(times):5} | {blocking:19.4f} | {total:16.4f} | "
              f"{blocking / total:14.3f} | {statistics.median(train_s[mode]):.2f}")
    ratio = (statistics.median(b for b, _ in found["async"])
             / statistics.median(b for b, _ in found["sync"]))
    print(f"async blocking / sync blocking: {ratio:.3f}")


if __name__ == "__main__":
    main()
