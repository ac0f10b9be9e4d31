"""What a checkpoint costs training, synchronous against ``checkpoint.async_save``, on
the GPT default job (the built-in GPT on the standard-library corpus, in one process).

Runs alternate (sync, async, sync, async, ...) so machine noise hits both alike. Every
save logs how long it blocked the training thread and how long until the file was
complete under its name (fsynced, checksummed, renamed); reported per mode: the median
of each over all saves, the blocking share of the total, and the median train time.

    python benchmarks/async_ckpt.py                  # a few minutes on 2 cores
    python benchmarks/async_ckpt.py --repeats 3 --steps 40 --every 10
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile

import torch

from gpufleet.bench.machine import machine_summary
from gpufleet.config import load_config
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
    logger = logging.getLogger("gpufleet.train.checkpointer")
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10)
    args = parser.parse_args()
    print(f"machine: {machine_summary()}")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}; GPT default job, "
          f"{args.steps} steps, a checkpoint every {args.every}, {args.repeats} repeats")
    found: dict[str, list] = {"sync": [], "async": []}
    train_s: dict[str, list[float]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory() as out:
        for _ in range(args.repeats):
            for mode in ("sync", "async"):
                times, seconds = one_run(out, mode == "async", args.steps, args.every)
                found[mode].extend(times)
                train_s[mode].append(seconds)
    print("mode  | saves | blocking s (median) | total s (median) | blocking/total "
          "| train s (median)")
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
